"""Saving and restoring converted models: whole models via HF checkpointing, or the drafter alone.

Whole model: after :func:`enable_huggingface_checkpointing`, ``model.save_pretrained(d)`` writes
base and drafter weights (safetensors) with the drafter config inside ``config.json``
(``speculative_decoding``), and ``AutoModelForCausalLM.from_pretrained(d)`` returns the converted
model. Drafter alone: :func:`save_drafter` writes ``drafter.safetensors`` + ``drafter_config.json``,
a small file that pairs with an unchanged base through :func:`load_drafter`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from exporter.speculative.convert import (
    CONFIG_KEY,
    DRAFTER_PREFIX,
    convert_from_saved,
    is_converted,
    undo_convert_on_error,
)

DRAFTER_WEIGHTS = "drafter.safetensors"
DRAFTER_CONFIG = "drafter_config.json"

_original_from_pretrained = None


def _from_pretrained_and_restore(cls, *args, **kwargs):
    with quiet_transformers():  # the drafter keys are "unexpected" for the plain base class
        model = _original_from_pretrained.__func__(cls, *args, **kwargs)
    saved = getattr(model.config, CONFIG_KEY, None)
    if saved and not is_converted(model):
        path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        restore_drafter(model, saved, Path(path))
    return model


@contextlib.contextmanager
def quiet_transformers():
    log = logging.getLogger("transformers")
    old = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(old)


class _Checkpointing(contextlib.AbstractContextManager):
    def __init__(self, installed: bool):
        self.installed = installed

    def __exit__(self, *exc):
        if self.installed:  # a nested `with` leaves an outer enable in place
            disable_huggingface_checkpointing()
        return False


def enable_huggingface_checkpointing():
    """Make ``from_pretrained`` restore drafters saved with ``save_pretrained``. Idempotent.

    Returns a context manager; leaving it undoes the patch of ``PreTrainedModel.from_pretrained`` if
    this call installed it (so nesting is safe); :func:`disable_huggingface_checkpointing` always does.
    """
    global _original_from_pretrained
    from transformers import PreTrainedModel

    installed = _original_from_pretrained is None
    if installed:
        _original_from_pretrained = PreTrainedModel.__dict__["from_pretrained"]
        PreTrainedModel.from_pretrained = classmethod(_from_pretrained_and_restore)
    return _Checkpointing(installed)


def disable_huggingface_checkpointing() -> None:
    global _original_from_pretrained
    from transformers import PreTrainedModel

    if _original_from_pretrained is not None:
        PreTrainedModel.from_pretrained = _original_from_pretrained
        _original_from_pretrained = None


@contextlib.contextmanager
def huggingface_checkpointing_disabled():
    """``from_pretrained`` inside loads the plain base (drafter weights ignored), then the patch is back."""
    was_enabled = _original_from_pretrained is not None
    disable_huggingface_checkpointing()
    try:
        yield
    finally:
        if was_enabled:
            enable_huggingface_checkpointing()


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    files = [f for f in files if f.name != DRAFTER_WEIGHTS] or files
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}; save with save_pretrained(safe_serialization=True)")
    return files


def read_prefixed(files: list[Path], prefix: str) -> dict[str, torch.Tensor]:
    """Tensors whose key starts with ``prefix`` (prefix stripped), from safetensors files."""
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                if k.startswith(prefix):
                    out[k[len(prefix) :]] = sf.get_tensor(k)
    return out


def load_drafter_state(model, state: dict[str, torch.Tensor], source: str) -> None:
    """Load drafter weights strictly, with a one-line error naming the first mismatch."""
    module = model.drafter
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"drafter weights in {source} do not fit this drafter: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}; was it trained for this configuration?"
        )
    for k, v in state.items():
        if v.shape != own[k].shape:
            raise ValueError(
                f"drafter weight {k} in {source} has shape {tuple(v.shape)}, this base needs "
                f"{tuple(own[k].shape)}: the drafter was trained for a different base model"
            )
    ref = next(model.parameters())
    module.load_state_dict({k: v.to(dtype=own[k].dtype, device=ref.device) for k, v in state.items()})


def restore_drafter(model, saved: dict, model_dir: Path):
    """Convert a freshly loaded base per ``saved`` and load the drafter weights from ``model_dir``."""
    with undo_convert_on_error(model):
        convert_from_saved(model, saved)
        prefix = DRAFTER_PREFIX[model.spec_mode]
        state = read_prefixed(_weight_files(model_dir), prefix)
        load_drafter_state(model, state, str(model_dir))
    return model


def save_drafter(model, path) -> Path:
    """Write the drafter alone: ``path/drafter.safetensors`` and ``path/drafter_config.json``."""
    if not is_converted(model):
        raise ValueError("model has no drafter; call exporter.speculative.convert first")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    prefix = DRAFTER_PREFIX[model.spec_mode]
    state = {prefix + k: v.detach().contiguous().cpu() for k, v in model.drafter.state_dict().items()}
    save_file(state, str(path / DRAFTER_WEIGHTS), metadata={"format": "pt"})
    cfg = model.config
    meta = {
        **getattr(cfg, CONFIG_KEY),
        "base": {
            "model_type": cfg.model_type,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "num_hidden_layers": cfg.num_hidden_layers,
        },
    }
    (path / DRAFTER_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return path


def load_drafter(model, path):
    """Attach a drafter saved by :func:`save_drafter` to an unconverted base ``model``."""
    path = Path(path)
    cfg_file = path / DRAFTER_CONFIG if path.is_dir() else path.with_name(DRAFTER_CONFIG)
    weights = path / DRAFTER_WEIGHTS if path.is_dir() else path
    if not cfg_file.is_file() or not weights.is_file():
        raise ValueError(f"{path} has no {DRAFTER_CONFIG} and {DRAFTER_WEIGHTS}; save it with save_drafter")
    meta = json.loads(cfg_file.read_text())
    base = meta.get("base", {})
    for key in ("model_type", "hidden_size", "vocab_size"):
        if key in base and base[key] != getattr(model.config, key):
            raise ValueError(
                f"drafter in {path} was trained for {key}={base[key]}, this base has "
                f"{key}={getattr(model.config, key)}"
            )
    with undo_convert_on_error(model):
        convert_from_saved(model, meta)
        state = read_prefixed([weights], DRAFTER_PREFIX[model.spec_mode])
        load_drafter_state(model, state, str(weights))
    return model
