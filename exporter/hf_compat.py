"""Where Hugging Face transformers' interfaces differ between the versions we support (4.57 – 5.x).

Everything version-dependent lives here, so the rest of the exporter wraps HF's own modules the same
way on every supported release:

- the cache keyword of attention and decoder layers: ``past_key_values`` up to 4.x, ``cache`` on
  the 5.x line (``past_key_values`` is a deprecated alias there, removed in 5.40);
- ``Cache.update``'s extra arguments: ``cache_kwargs`` (positional) up to 4.x, ``kwargs=`` on 5.x.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import transformers

TRANSFORMERS_VERSION = transformers.__version__
MIN_VERSION = "4.57"  # the oldest line the test suite runs on (CI: a cross-version subset)


@functools.cache
def _cache_kwarg_name(cls: type) -> str:
    """``"cache"`` or ``"past_key_values"``: the keyword ``cls.forward`` takes its cache under."""
    fn = inspect.unwrap(cls.forward)
    params = inspect.signature(fn).parameters
    if "cache" in params:
        return "cache"
    return "past_key_values"


def cache_kwargs(module, cache) -> dict:
    """``{name: cache}`` for calling an HF decoder layer or attention module with our duck-typed cache."""
    return {_cache_kwarg_name(type(module)): cache}


@contextlib.contextmanager
def no_progress_bars():
    """Silence HF's own progress bars (5.x draws one for every ``from_pretrained``) inside our CLIs,
    which print their own per-step progress; the user's setting is restored after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
