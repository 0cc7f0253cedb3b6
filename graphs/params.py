"""Generation parameters: one dataclass, the applicable fields of HF's ``GenerationConfig`` plus ours.

    params = GenerationParams(max_new_tokens=64, do_sample=True, temperature=0.7, top_p=0.9)
    decoder.generate("def main(", params)                     # or keyword overrides:
    decoder.generate("def main(", max_new_tokens=64, temperature=0.7)

A field left ``None`` is unset: it takes the model's ``generation_config.json`` value (copied
beside the graphs at export, read by :func:`GenerationParams.from_generation_config`), else the
library default below. Explicit values always win (:meth:`GenerationParams.resolve`), as in HF's
``generate(**kwargs)``. Names follow HF (``do_sample``, ``stop_strings``, ``eos_token_id``); the
short ``stop`` is accepted as an alias of ``stop_strings``.

Sampling (HF's rule): ``do_sample=False`` is greedy whatever the temperature. Ours on top, so that
``generate(p, temperature=0.8)`` samples as it always did here: an explicit ``temperature`` without
an explicit ``do_sample`` means ``do_sample = temperature > 0``.

transformers itself is not imported (``graphs`` runs without it), so the defaults HF's
``GenerationConfig`` would apply are not all copied: ``top_k`` defaults to 0 (off) here where HF
applies 50, and ``max_new_tokens`` to 64 where HF's ``max_length`` is 20 tokens in all.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from graphs.errors import InputError, InputTypeError
from graphs.sampling import MIN_TEMPERATURE

MODES = ("auto", "speculative", "autoregressive")
SPECULATION = ("on", "off", "adaptive")
ACCEPTANCES = ("lossless", "typical")
DEFAULT_MAX_NEW_TOKENS = 64  # when neither the call nor generation_config.json sets a length
ALIASES = {"stop": "stop_strings"}
NUMBERS = {"max_new_tokens": "an int >= 1", "max_length": "an int >= 2", "temperature": ">= 0 and finite",
           "top_p": "in (0, 1]", "top_k": "an int >= 0"}
# generation_config.json keys that apply here (the rest -- beams, penalties, ... -- are not implemented)
GENERATION_CONFIG_KEYS = ("max_new_tokens", "max_length", "do_sample", "temperature", "top_p", "top_k",
                          "eos_token_id", "stop_strings")


@dataclass
class GenerationParams:
    """What to generate and how. ``None`` = unset (generation_config.json, else the default named)."""

    max_new_tokens: int | None = None
    """New tokens per sequence at most (default 64; the model's context also limits it)."""
    max_length: int | None = None
    """HF's prompt + new tokens limit (the longest prompt of a batch counts); max_new_tokens wins."""
    do_sample: bool | None = None
    """False: greedy, exactly the base's greedy tokens. True: sample from the base distribution."""
    temperature: float | None = None
    """Sampling temperature (default 1.0 when sampling); 0, or any value below
    ``graphs.sampling.MIN_TEMPERATURE`` (1e-5: a subnormal one would divide the logits to inf), means greedy."""
    top_p: float | None = None
    """Nucleus sampling mass in (0, 1] (default 1.0 = off)."""
    top_k: int | None = None
    """Sample among the k most likely tokens (default 0 = off)."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence id(s) (default: the manifest's, from generation_config.json or config.json)."""
    stop_strings: str | list[str] | None = None
    """Stop when the text contains one of these; the text is cut before it (alias: ``stop``)."""
    seed: int | None = None
    """Seed of the sampler's numpy Generator (None: fresh entropy)."""
    mode: str = "auto"
    """"auto" (speculative when the export has a drafter), "speculative" or "autoregressive"."""
    tree: object = None
    """Medusa paths (list or JSON file) or EAGLE {"topk", "depth", "total_tokens"}; default: manifest's."""
    acceptance: str = "lossless"
    """When sampling: "lossless" (rejection sampling) or "typical" (Medusa's, faster, not lossless)."""
    speculation: str | None = None
    """"on" (always the full tree), "off" (one token per step, no drafter), "adaptive" (trees cut or
    skipped when they stop paying); None: the decoder's default (adaptive unless loaded with
    adaptive=False; "on" for seeded sampling, whose tokens must not follow measured times)."""

    def __post_init__(self):
        self.max_new_tokens = _opt_int("max_new_tokens", self.max_new_tokens, 1)
        self.max_length = _opt_int("max_length", self.max_length, 2)
        if self.do_sample is not None and not isinstance(self.do_sample, (bool, np.bool_)):
            raise InputTypeError(f"do_sample must be True or False, got {self.do_sample!r}")
        if self.do_sample is not None:
            self.do_sample = bool(self.do_sample)
        self.temperature = _opt_float("temperature", self.temperature, ">= 0 and finite (0 = greedy)",
                                      lambda x: x >= 0)
        self.top_p = _opt_float("top_p", self.top_p, "in (0, 1] (1 = off)", lambda x: 0 < x <= 1)
        self.top_k = _opt_int("top_k", self.top_k, 0, ">= 0 and an int (0 = off)")
        self.eos_token_id = _eos(self.eos_token_id)
        self.stop_strings = _stops(self.stop_strings)
        self.seed = _opt_int("seed", self.seed, 0)
        if self.mode not in MODES:
            raise InputError(f"unknown mode {self.mode!r}; accepted: {', '.join(MODES)}")
        if self.acceptance not in ACCEPTANCES:
            raise InputError(f"unknown acceptance {self.acceptance!r}; accepted: {', '.join(ACCEPTANCES)}")
        if self.speculation is not None and self.speculation not in SPECULATION:
            raise InputError(f"unknown speculation {self.speculation!r}; accepted: {', '.join(SPECULATION)}")

    # ------------------------------------------------------------------ building

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def build(cls, params: GenerationParams | None = None, **overrides) -> GenerationParams:
        """``params`` (or a fresh one) with keyword ``overrides`` on top; HF names and aliases accepted.

        A keyword ``None`` leaves the field as it is (``seed=None``, ``stop=None``, ``tree=None`` read
        naturally), except for numbers, where it is an error as it always was here."""
        if params is not None and not isinstance(params, GenerationParams):
            raise InputTypeError(f"params must be a GenerationParams, got {type(params).__name__}; "
                            f"or pass the values as keywords (max_new_tokens=..., temperature=...)")
        names = cls.names()
        bad = sorted(k for k in overrides if ALIASES.get(k, k) not in names)
        if bad:
            raise InputTypeError(f"unknown argument(s) {bad}; accepted: {', '.join(names + list(ALIASES))}")
        given = {}
        for key, value in overrides.items():
            name = ALIASES.get(key, key)
            if value is None and name in NUMBERS:  # None means "unset" only inside a GenerationParams
                raise InputError(f"{name} must be {NUMBERS[name]}, got None; leave it out for the default")
            if value is None:
                continue
            if name in given:
                raise InputTypeError(f"{key!r} and {name!r} are the same argument; pass one of them")
            given[name] = value
        base = params or cls()
        return dataclasses.replace(base, **given) if given else base

    @classmethod
    def from_generation_config(cls, source) -> GenerationParams:
        """The applicable fields of a ``generation_config.json`` (a path or its dict); others ignored.

        A file that sets a value this runtime rejects is an error naming the file and the field."""
        data = source
        if not isinstance(source, dict):
            try:
                data = json.loads(Path(source).read_text())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
                raise InputError(f"cannot read {source}: {e}; fix or delete the file") from None
        picked = {k: data[k] for k in GENERATION_CONFIG_KEYS if data.get(k) is not None}
        try:
            return cls(**picked)
        except (TypeError, ValueError) as e:
            raise InputError(f"generation config {source if not isinstance(source, dict) else ''}: {e}") from None

    def set_fields(self) -> dict:
        """The fields that are set (not None), in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    # ------------------------------------------------------------------ resolving

    def resolve(self, defaults: GenerationParams | None = None) -> Resolved:
        """Explicit fields of ``self``, else those of ``defaults`` (generation_config.json), else ours."""
        d = defaults or GenerationParams()
        pick = lambda name: getattr(self, name) if getattr(self, name) is not None else getattr(d, name)
        source = lambda name: ("argument" if getattr(self, name) is not None
                               else "generation_config" if getattr(d, name) is not None else "default")
        if self.do_sample is not None:
            do_sample = self.do_sample
        elif self.temperature is not None:  # ours: an explicit temperature alone decides
            do_sample = self.temperature >= MIN_TEMPERATURE
        else:
            do_sample = bool(d.do_sample)
        temperature = pick("temperature")
        temperature = (1.0 if temperature is None else temperature) if do_sample else 0.0
        if do_sample and temperature < MIN_TEMPERATURE:
            do_sample, temperature = False, 0.0  # HF raises on temperature 0; here it (or a tinier one) means greedy
        top_p, top_k = pick("top_p"), pick("top_k")
        eos = self.eos_token_id if self.eos_token_id is not None else d.eos_token_id
        sources = {n: source(n) for n in ("max_new_tokens", "max_length", "do_sample", "temperature", "top_p",
                                          "top_k", "eos_token_id", "stop_strings")}
        if self.temperature is not None:
            sources["do_sample"] = "argument"
        return Resolved(
            max_new_tokens=pick("max_new_tokens"),
            max_length=pick("max_length") if pick("max_new_tokens") is None else None,
            do_sample=do_sample,
            temperature=temperature,
            top_p=1.0 if top_p is None or not do_sample else top_p,
            top_k=0 if top_k is None or not do_sample else top_k,
            eos_token_ids=None if eos is None else list(eos),
            stop_strings=list(pick("stop_strings") or []),
            seed=self.seed,
            mode=self.mode,
            tree=self.tree,
            acceptance=self.acceptance,
            speculation=self.speculation,
            sources=sources,
        )


@dataclass
class Resolved:
    """Every value a run uses, concrete (what :meth:`GenerationParams.resolve` returns)."""

    max_new_tokens: int | None  # None: from max_length (needs the prompts), else DEFAULT_MAX_NEW_TOKENS
    max_length: int | None
    do_sample: bool
    temperature: float  # 0.0 when greedy
    top_p: float
    top_k: int
    eos_token_ids: list[int] | None  # None: the decoder's own (the manifest's)
    stop_strings: list[str]
    seed: int | None
    mode: str
    tree: object
    acceptance: str
    speculation: str | None
    sources: dict  # field -> "argument" | "generation_config" | "manifest" | "default"

    def new_tokens_for(self, longest_prompt: int) -> int:
        """max_new_tokens, or HF's ``max_length - input length`` (the batch's padded length)."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_length is not None:
            n = self.max_length - longest_prompt
            if n < 1:
                raise InputError(f"max_length {self.max_length} leaves no room after a prompt of {longest_prompt} "
                                 f"tokens; pass max_new_tokens or a larger max_length")
            return n
        return DEFAULT_MAX_NEW_TOKENS

    def describe(self) -> str:
        """One line for the CLIs: what this run used and where each value came from."""
        def tag(name, text):
            src = self.sources.get(name, "default")
            return text if src == "argument" else f"{text} ({'generation_config.json' if src[0] == 'g' else src})"


        if self.max_new_tokens is None and self.max_length is not None:
            parts = [tag("max_length", f"max_length={self.max_length}")]
        else:
            parts = [tag("max_new_tokens", f"max_new_tokens={self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS}")]
        if self.do_sample:
            parts += [tag("do_sample", "sampling"), tag("temperature", f"temperature={self.temperature:g}"),
                      tag("top_p", f"top_p={self.top_p:g}"), tag("top_k", f"top_k={self.top_k}"),
                      f"acceptance={self.acceptance}", f"seed={self.seed}"]
        else:
            parts.append(tag("do_sample", "greedy"))
        if self.eos_token_ids is not None:
            parts.append(tag("eos_token_id", f"eos={self.eos_token_ids}"))
        if self.stop_strings:
            parts.append(tag("stop_strings", f"stop_strings={self.stop_strings}"))
        parts.append(f"mode={self.mode}")
        return ", ".join(parts)


# ---------------------------------------------------------------------- prompt checks


def check_prompt(prompt) -> list:
    """``prompt`` as a list of prompts (each a str or a list of int ids); bad input -> one clear error.

    Accepted: a string, a list of int token ids (numpy integers too), or a non-empty list of either.
    """
    if isinstance(prompt, str):
        return [_check_text(prompt, "prompt")]
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise InputTypeError(f"prompt must be a string, a list of token ids, or a list of those; got "
                        f"{type(prompt).__name__}")
    if not prompt:  # one prompt of no tokens (an empty batch is not expressible: [] is read as this)
        raise InputError("empty prompt: pass at least one token of text")
    if all(isinstance(t, (numbers.Number, np.number)) for t in prompt):  # one prompt of token ids
        return [_check_ids(prompt, "prompt")]
    out = []
    for i, p in enumerate(prompt):
        where = f"prompt[{i}]"
        if isinstance(p, str):
            out.append(_check_text(p, where))
        elif isinstance(p, (list, tuple, np.ndarray)):
            out.append(_check_ids(list(np.asarray(p).tolist()) if isinstance(p, np.ndarray) else p, where))
        else:
            kind = "a list of token ids mixed with other values" if any(_is_id(t) for t in prompt) else "a list"
            raise InputTypeError(f"{where} is {type(p).__name__} {p!r} in {kind}: a prompt is a string or a list of "
                                 f"int token ids (e.g. [5, 9, 3]); round or encode the values first")
    return out


def _is_id(t) -> bool:
    return isinstance(t, (numbers.Integral, np.integer)) and not isinstance(t, (bool, np.bool_))


def _check_ids(ids, where: str) -> list[int]:
    for t in ids:
        if not _is_id(t):
            raise InputTypeError(f"{where} holds {type(t).__name__} {t!r}: token ids must be ints (e.g. [5, 9, 3]); "
                            f"pass text as a string")
    return [int(t) for t in ids]


def _check_text(text: str, where: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{where} holds an unpaired surrogate {text[e.start]!r} at index {e.start}, not valid "
                         f"Unicode; decode the source bytes with errors='replace' or drop it") from None
    return text


# ---------------------------------------------------------------------- field checks


# Bad numbers raise ValueError whatever their type ("3", 1.5, nan): one kind of error per argument.


def _opt_int(name: str, value, minimum: int, what: str = ""):
    if value is None:
        return None
    if not _is_id(value) or value < minimum:
        got = f"{type(value).__name__} {value!r}" if not _is_id(value) else str(value)
        # (no suggestion for a float too large to mean a count: 1e308 would print 309 digits)
        fix = (f"; e.g. {name}={max(minimum, round(value))}"
               if isinstance(value, float) and math.isfinite(value) and abs(value) < 1e15 else "")
        raise InputError(f"{name} must be {what or f'an int >= {minimum}'}, got {got}{fix}")
    return int(value)


def _opt_float(name: str, value, what: str, ok):
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise InputError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or not ok(value):
        raise InputError(f"{name} must be {what}, got {value}")
    return value


def _eos(value):
    if value is None:
        return None
    ids = [value] if _is_id(value) else value
    if not isinstance(ids, (list, tuple)) or not all(_is_id(t) and t >= 0 for t in ids):
        raise InputTypeError(f"eos_token_id must be a token id or a list of them (ints >= 0), got {value!r}")
    return [int(t) for t in ids]


def _stops(value):
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise InputTypeError(f"stop_strings (stop) must be a string or a list of strings, got "
                        f"{type(value).__name__} {value!r}")
    if any(s == "" for s in stops):
        raise InputError("stop_strings holds an empty string, which would stop at once; remove it")
    return [_check_text(s, "stop_strings") for s in stops]
