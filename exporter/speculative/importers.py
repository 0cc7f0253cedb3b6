"""Load drafters trained elsewhere onto an unconverted base: ModelOpt, FasterDecoding/Medusa, SafeAILab/EAGLE,
z-lab/DFlash.

Each format is one small function that maps the foreign key layout onto ours and infers the
drafter config from the tensor shapes (and a ``config.json`` next to the weights, when there is one):

=====================  ==========================================================================
format                 keys in the file                          -> ours
=====================  ==========================================================================
``drafter``            this project's :func:`save_drafter` output (``drafter.safetensors``)
``modelopt``           ``medusa_heads.{k}.{j}.linear.*``, ``medusa_heads.{k}.{n}.weight`` (or our
                       ``medusa_layers``/``lm_head`` names); ``eagle_module.*`` (same names as ours)
``fasterdecoding_      ``{k}.{j}.linear.{weight,bias}``         -> ``{k}.medusa_layers.{j}.linear.*``
medusa``               ``{k}.{n}.weight`` (n = layers per head) -> ``{k}.lm_head.weight``
``safeailab_eagle``    EAGLE-1: ``fc.{weight [H,2H],bias}``, ``layers.{i}.*`` (layer 0 without
                       ``input_layernorm``); ``embed_tokens.weight`` is the base's and is ignored
``safeailab_eagle3``   EAGLE-3: ``fc.weight [H,n*H]``, ``midlayer.*`` -> ``layers.0.*``, ``norm``,
                       ``lm_head [Vd,H]``, ``d2t``; ``t2d`` and ``embed_tokens`` are ignored
``zlab_dflash``        DFlash drafter as z-lab ships it and ModelOpt exports it: ``fc.weight [H,n*H]``,
                       top-level ``hidden_norm.weight``, ``norm``, ``layers.{i}.*`` (names as ours);
                       ``config.json`` gives ``block_size``, ``dflash_config.{mask_token_id,
                       target_layer_ids}`` and the dims (checked against the tensors)
=====================  ==========================================================================

A raw ModelOpt DFlash checkpoint (``dflash_module.*`` beside the base's keys) keeps its block size and
mask token in ModelOpt's own state, ``modelopt_state.pth`` beside the weights: read with
``torch.load(weights_only=True)`` (plain dicts; a file that needs more is not read), else pass them as
``config={"dflash_block_size": 8, "dflash_mask_token_id": ...}``; its target layers are ModelOpt's
``build_target_layer_ids``.

Attention biases a foreign Llama-style drafter lacks (a Qwen2 base has q/k/v biases) are zero: the
same function. ``.pt``/``.bin`` files load with ``torch.load(weights_only=True)``; prefer safetensors.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from exporter.arch import check_causal_lm
from exporter.speculative.checkpoint import DRAFTER_CONFIG, DRAFTER_WEIGHTS, load_drafter, load_drafter_state
from exporter.speculative.convert import CONFIG_KEY, DRAFTER_PREFIX, convert, is_converted, undo_convert_on_error

log = logging.getLogger(__name__)

FORMATS = {
    "drafter": "this project's save_drafter output (drafter.safetensors + drafter_config.json)",
    "modelopt": "ModelOpt / HF checkpoint with medusa_heads.*, eagle_module.* or dflash_module.* keys",
    "fasterdecoding_medusa": "FasterDecoding/Medusa head file (medusa_lm_head.safetensors|.pt; "
    "{k}.{j}.linear.*, {k}.{n}.weight)",
    "safeailab_eagle": "SafeAILab/EAGLE EAGLE-1 drafter (fc.weight [H, 2H], layers.{i}.*)",
    "safeailab_eagle3": "SafeAILab/EAGLE EAGLE-3 drafter (fc.weight [H, n*H], midlayer.*, norm, lm_head, d2t)",
    "zlab_dflash": "z-lab DFlash drafter / ModelOpt DFlash export (fc.weight, hidden_norm.weight, norm, layers.{i}.* "
    "+ config.json with block_size, dflash_config)",
}
_WEIGHT_SUFFIXES = (".safetensors", ".pt", ".bin", ".pth")
# Foreign tensors we know and do not need: the base's embedding, EAGLE-3's target->draft mask, RoPE.
_IGNORED = re.compile(r"(^|\.)(embed_tokens\.weight|t2d|rotary_emb\.inv_freq)$")


def _accepted() -> str:
    return "; ".join(f"{name!r}: {what}" for name, what in FORMATS.items())


# ---------------------------------------------------------------------------------------------
# Reading a source: weight files + optional config.json


class _Source:
    """The weight files (and config.json) at ``path``; tensors are read lazily by key."""

    def __init__(self, path: Path):
        self.path = path
        if path.is_file():
            files = [path]
            cfg = path.with_name("config.json")
        else:
            files = sorted(f for f in path.iterdir() if f.suffix == ".safetensors")
            if not files:
                files = sorted(f for f in path.iterdir() if f.suffix in _WEIGHT_SUFFIXES)
            cfg = path / "config.json"
        if not files:
            raise ValueError(f"no weight file (*.safetensors, *.pt, *.bin) in {path}")
        self.files = files
        self.config = json.loads(cfg.read_text()) if cfg.is_file() else {}
        self._keys: dict[str, Path] = {}
        self._loaded: dict[Path, dict[str, torch.Tensor]] = {}
        for f in files:
            for k in self._file_keys(f):
                self._keys[k] = f

    def _file_keys(self, f: Path) -> list[str]:
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as sf:
                return list(sf.keys())
        return list(self._torch_load(f))

    def _torch_load(self, f: Path) -> dict[str, torch.Tensor]:
        if f not in self._loaded:
            try:
                obj = torch.load(str(f), map_location="cpu", weights_only=True)
            except Exception as e:  # a pickle with code in it, or not a torch file at all
                raise ValueError(f"cannot read {f} with torch.load(weights_only=True): {e}") from e
            if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
                raise ValueError(f"{f} is not a state dict of tensors")
            self._loaded[f] = obj
        return self._loaded[f]

    def names(self) -> list[str]:
        return list(self._keys)

    def get(self, key: str) -> torch.Tensor:
        f = self._keys[key]
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as sf:
                return sf.get_tensor(key)
        return self._torch_load(f)[key]

    def shape(self, key: str) -> tuple[int, ...]:
        f = self._keys[key]
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as sf:
                return tuple(sf.get_slice(key).get_shape())
        return tuple(self._torch_load(f)[key].shape)


@dataclass
class _Plan:
    """What a format importer decided: the convert() call and where each of our tensors comes from."""

    mode: str
    config: dict
    sources: dict[str, str] = field(default_factory=dict)  # our drafter key -> foreign key
    copies: dict[str, str] = field(default_factory=dict)  # our key -> our key it duplicates


def detect_format(keys) -> str:
    """The format of a drafter file from its tensor names (see the module docstring)."""
    keys = list(keys)
    if any(k.startswith(tuple(DRAFTER_PREFIX.values())) for k in keys):
        return "modelopt"
    if any(k.startswith("midlayer.") for k in keys):
        return "safeailab_eagle3"
    if "hidden_norm.weight" in keys:  # top level: DFlash (EAGLE-3's is layers.0.hidden_norm); before EAGLE-1
        return "zlab_dflash"
    if "fc.weight" in keys and any(k.startswith("layers.") for k in keys):
        return "safeailab_eagle"
    if keys and all(re.fullmatch(r"\d+\.\d+\.(linear\.)?(weight|bias)", k) for k in keys):
        return "fasterdecoding_medusa"
    raise ValueError(
        f"unrecognised drafter format (first keys: {sorted(keys)[:5]}); accepted formats: {_accepted()}"
    )


def _shape_error(fmt, src, key, shape, expected, base_cfg) -> ValueError:
    return ValueError(
        f"{fmt} tensor {key!r} in {src.path} has shape {tuple(shape)}, expected {tuple(expected)} for this "
        f"base ({base_cfg.model_type}, hidden_size={base_cfg.hidden_size}, vocab_size={base_cfg.vocab_size})"
    )


# ---------------------------------------------------------------------------------------------
# Medusa: FasterDecoding files and ModelOpt's nn.Sequential heads


def _medusa_plan(src: _Source, keys: list[str], prefix: str, base_cfg, fmt: str, hint: dict) -> _Plan:
    """Heads as ``{k}.{j}.linear.*`` + ``{k}.{n}.weight`` (or our names), after ``prefix``."""
    heads: dict[int, dict] = {}
    plan = _Plan("medusa", {})
    for key in keys:
        rest = key[len(prefix) :]
        m = re.fullmatch(r"(\d+)\.(?:medusa_layers\.)?(\d+)\.linear\.(weight|bias)", rest)
        if m:
            heads.setdefault(int(m[1]), {"layers": {}, "head": None})["layers"][(int(m[2]), m[3])] = key
            continue
        m = re.fullmatch(r"(\d+)\.(?:(\d+)\.|lm_head\.)weight", rest)
        if m:
            heads.setdefault(int(m[1]), {"layers": {}, "head": None})
            heads[int(m[1])]["head"] = (None if m[2] is None else int(m[2]), key)
            continue
        raise ValueError(f"{fmt}: unexpected Medusa tensor {key!r} in {src.path}; accepted formats: {_accepted()}")
    if not heads or sorted(heads) != list(range(len(heads))):
        raise ValueError(f"{fmt}: Medusa heads in {src.path} are {sorted(heads)}, expected 0..K-1")
    n_heads = hint.get("medusa_num_heads", len(heads))
    if n_heads > len(heads):
        raise ValueError(f"{fmt}: config asks for {n_heads} Medusa heads, {src.path} has {len(heads)}")
    if n_heads < len(heads):
        log.warning("%s: using the first %d of %d Medusa heads (config.json)", src.path, n_heads, len(heads))
    n_layers = None
    for k in range(n_heads):
        head = heads[k]
        if head["head"] is None:
            raise ValueError(f"{fmt}: Medusa head {k} in {src.path} has no vocabulary projection")
        idx, head_key = head["head"]
        # In nn.Sequential(*blocks, lm_head) the projection's index is the number of blocks.
        layers_k = idx if idx is not None else 1 + max((j for j, _ in head["layers"]), default=-1)
        if n_layers not in (None, layers_k):
            raise ValueError(f"{fmt}: Medusa heads in {src.path} have different numbers of layers")
        n_layers = layers_k
        plan.sources[f"{k}.lm_head.weight"] = head_key
        for j in range(n_layers):
            for part in ("weight", "bias"):
                ours = f"{k}.medusa_layers.{j}.linear.{part}"
                if (j, part) in head["layers"]:
                    plan.sources[ours] = head["layers"][(j, part)]
                else:
                    # `[ResBlock(h)] * n` files share one block; safetensors stores it once.
                    present = sorted(i for i, p in head["layers"] if p == part)
                    if not present:
                        raise ValueError(f"{fmt}: Medusa head {k} in {src.path} has no layer {j} {part}")
                    plan.copies[ours] = f"{k}.medusa_layers.{present[0]}.linear.{part}"
    if "medusa_num_layers" in hint and hint["medusa_num_layers"] != n_layers:
        raise ValueError(
            f"{fmt}: config.json says medusa_num_layers={hint['medusa_num_layers']}, "
            f"the tensors in {src.path} have {n_layers} layers per head"
        )
    plan.config = {"medusa_num_heads": n_heads, "medusa_num_layers": n_layers}
    h, v = base_cfg.hidden_size, base_cfg.vocab_size
    for ours, key in plan.sources.items():
        expected = (v, h) if ours.endswith("lm_head.weight") else (h, h) if ours.endswith("weight") else (h,)
        if src.shape(key) != expected:
            raise _shape_error(fmt, src, key, src.shape(key), expected, base_cfg)
    return plan


def _fasterdecoding_medusa(src: _Source, base_cfg, overrides) -> _Plan:
    hint = {k: src.config[k] for k in ("medusa_num_heads", "medusa_num_layers") if k in src.config}
    return _medusa_plan(src, src.names(), "", base_cfg, "fasterdecoding_medusa", hint)


# ---------------------------------------------------------------------------------------------
# EAGLE: SafeAILab files and ModelOpt's eagle_module


def _find_aux_ids(cfg: dict):
    """EAGLE-3 aux layer ids anywhere ModelOpt / this project write them in a config.json."""
    for d in (cfg, cfg.get("eagle_architecture_config"), cfg.get("eagle"), cfg.get("eagle_config"),
              (cfg.get(CONFIG_KEY) or {}).get("config")):
        if isinstance(d, dict) and d.get("eagle_aux_hidden_state_layer_ids"):
            return list(d["eagle_aux_hidden_state_layer_ids"])
    return None


def _default_aux_ids(n_aux: int, base_cfg, src, fmt) -> list[int]:
    n = base_cfg.num_hidden_layers
    default = [min(1, n - 1), max(0, n // 2 - 1), max(0, n - 4)]  # ModelOpt's and SafeAILab's choice
    for ids in (default, sorted(set(default))):
        if len(ids) == n_aux:
            return ids
    raise ValueError(
        f"{fmt}: the EAGLE-3 drafter in {src.path} fuses {n_aux} base layers and names none; pass "
        f"config={{'eagle_aux_hidden_state_layer_ids': [...]}} ({n_aux} ids in 0..{n - 1})"
    )


def _eagle_plan(src: _Source, mapping: dict[str, str], base_cfg, fmt: str, eagle3: bool, overrides) -> _Plan:
    """``mapping``: our drafter key -> foreign key, for every tensor the file has."""
    h = base_cfg.hidden_size
    if "fc.weight" not in mapping:
        raise ValueError(f"{fmt}: no fc.weight in {src.path}; accepted formats: {_accepted()}")
    fc = src.shape(mapping["fc.weight"])
    n_in = 3 if eagle3 else 2
    if len(fc) != 2 or fc[0] != h or fc[1] % h or (not eagle3 and fc[1] != 2 * h):
        raise _shape_error(fmt, src, mapping["fc.weight"], fc, (h, n_in * h), base_cfg)
    layers = {int(m[1]) for k in mapping if (m := re.match(r"layers\.(\d+)\.", k))}
    if not layers or sorted(layers) != list(range(len(layers))):
        raise ValueError(f"{fmt}: drafter layers in {src.path} are {sorted(layers)}, expected 0..N-1")
    cfg: dict = {"eagle_num_layers": len(layers)}
    gate = "layers.0.mlp.gate_proj.weight"
    if gate in mapping and src.shape(mapping[gate])[0] != base_cfg.intermediate_size:
        cfg["layer_overrides"] = {"intermediate_size": src.shape(mapping[gate])[0]}
    if eagle3:
        n_aux = fc[1] // h
        ids = _find_aux_ids(overrides) or _find_aux_ids(src.config) or _default_aux_ids(n_aux, base_cfg, src, fmt)
        if len(ids) != n_aux:
            raise ValueError(
                f"{fmt}: config.json names {len(ids)} aux layers {ids}, but {mapping['fc.weight']!r} in "
                f"{src.path} has shape {fc}, i.e. {n_aux} layers"
            )
        cfg.update(use_aux_hidden_state=True, eagle_aux_hidden_state_layer_ids=ids)
        if "lm_head.weight" in mapping:
            vd, hd = src.shape(mapping["lm_head.weight"])
            if vd > base_cfg.vocab_size or hd != h:
                raise ValueError(
                    f"{fmt} tensor {mapping['lm_head.weight']!r} in {src.path} has shape {(vd, hd)}, expected "
                    f"(draft_vocab_size <= {base_cfg.vocab_size}, {h}) for this base ({base_cfg.model_type})"
                )
            cfg["draft_vocab_size"] = vd
    else:
        cfg["use_input_layernorm_in_first_layer"] = "layers.0.input_layernorm.weight" in mapping
    return _Plan("eagle", cfg, sources=dict(mapping))


def _safeailab(src: _Source, base_cfg, overrides, eagle3: bool) -> _Plan:
    mapping = {}
    for key in src.names():
        if _IGNORED.search(key):
            continue
        mapping["layers.0." + key[len("midlayer.") :] if key.startswith("midlayer.") else key] = key
    fmt = "safeailab_eagle3" if eagle3 else "safeailab_eagle"
    return _eagle_plan(src, mapping, base_cfg, fmt, eagle3, overrides)


def _modelopt(src: _Source, base_cfg, overrides) -> _Plan:
    keys = src.names()
    saved = src.config.get(CONFIG_KEY)
    medusa = [k for k in keys if k.startswith(DRAFTER_PREFIX["medusa"])]
    eagle = [k for k in keys if k.startswith(DRAFTER_PREFIX["eagle"])]
    if medusa and eagle:
        raise ValueError(f"modelopt: {src.path} has both medusa_heads.* and eagle_module.* tensors")
    if medusa:
        hint = {}
        mo = src.config.get("medusa")  # ModelOpt's HFMedusaModel writes {"num_medusa_heads", ...}
        if isinstance(mo, dict):
            hint = {"medusa_num_heads": mo.get("num_medusa_heads"), "medusa_num_layers": mo.get("num_medusa_layers")}
        if isinstance(saved, dict) and saved.get("mode") == "medusa":
            hint = {k: saved.get("config", {}).get(k) for k in ("medusa_num_heads", "medusa_num_layers")}
        hint = {k: v for k, v in hint.items() if v is not None}
        plan = _medusa_plan(src, medusa, DRAFTER_PREFIX["medusa"], base_cfg, "modelopt", hint)
        if isinstance(saved, dict) and saved.get("mode") == "medusa":
            plan.config = {**saved.get("config", {}), **plan.config}
        return plan
    dflash = [k for k in keys if k.startswith(DRAFTER_PREFIX["dflash"])]
    if dflash:
        if eagle:
            raise ValueError(f"modelopt: {src.path} has both eagle_module.* and dflash_module.* tensors")
        prefix = DRAFTER_PREFIX["dflash"]
        mapping = {k[len(prefix) :]: k for k in dflash if not _IGNORED.search(k)}
        ours = saved.get("config") if isinstance(saved, dict) and saved.get("mode") == "dflash" else None
        return _dflash_plan(src, mapping, base_cfg, "modelopt", overrides, ours or _modelopt_dflash_state(src))
    prefix = DRAFTER_PREFIX["eagle"]
    mapping = {k[len(prefix) :]: k for k in eagle if not _IGNORED.search(k)}
    eagle3 = "layers.0.hidden_norm.weight" in mapping
    plan = _eagle_plan(src, mapping, base_cfg, "modelopt", eagle3, overrides)
    if isinstance(saved, dict) and saved.get("mode") == "eagle":  # our own save_pretrained: exact config
        plan.config = {**plan.config, **saved.get("config", {})}
    return plan


# ---------------------------------------------------------------------------------------------
# DFlash: z-lab / ModelOpt-exported drafters, ModelOpt's dflash_module


def _dflash_dims(src: _Source, mapping: dict[str, str], base_cfg, fmt: str) -> dict:
    """The draft architecture read from the tensor shapes (never assumed: ModelOpt's defaults are
    Qwen3-8B's dims, whatever the base, docs/dflash.md 1.2)."""
    h = base_cfg.hidden_size
    for key in ("fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
                "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                "layers.0.mlp.gate_proj.weight"):
        if key not in mapping:
            raise ValueError(f"{fmt}: no {key} in {src.path}: not a DFlash drafter; accepted formats: {_accepted()}")
    fc = src.shape(mapping["fc.weight"])
    if len(fc) != 2 or fc[0] != h or fc[1] % h:
        raise _shape_error(fmt, src, mapping["fc.weight"], fc, (h, "n*" + str(h)), base_cfg)
    layers = {int(m[1]) for k in mapping if (m := re.match(r"layers\.(\d+)\.", k))}
    if sorted(layers) != list(range(len(layers))):
        raise ValueError(f"{fmt}: drafter layers in {src.path} are {sorted(layers)}, expected 0..N-1")
    d = src.shape(mapping["layers.0.self_attn.q_norm.weight"])[0]
    q = src.shape(mapping["layers.0.self_attn.q_proj.weight"])[0]
    k = src.shape(mapping["layers.0.self_attn.k_proj.weight"])[0]
    return {"num_hidden_layers": len(layers), "head_dim": d, "num_attention_heads": q // d,
            "num_key_value_heads": k // d,
            "intermediate_size": src.shape(mapping["layers.0.mlp.gate_proj.weight"])[0],
            "attention_bias": "layers.0.self_attn.q_proj.bias" in mapping, "n_target": fc[1] // h}


def _dflash_plan(src: _Source, mapping: dict[str, str], base_cfg, fmt: str, overrides: dict, saved: dict) -> _Plan:
    """A DFlash drafter's convert() config: the dims from the tensors, block size / mask token / target
    layers / RoPE base from ``overrides``, else ``saved`` (our own config), else ``config.json`` (z-lab's
    fields), else ModelOpt's defaults (the mask token has none: one line naming the fix)."""
    for bad in ("lm_head.weight", "d2t"):
        if bad in mapping:
            raise ValueError(f"{fmt}: {src.path} carries its own {bad} (a draft vocabulary): not supported, a DFlash "
                             f"drafter here shares the base's LM head")
    if src.path.is_dir() and (src.path / "mask_embedding.pt").exists():
        raise ValueError(f"{fmt}: {src.path} has a trained mask_embedding.pt: not supported (the mask token's "
                         f"embedding is the base's)")
    dims = _dflash_dims(src, mapping, base_cfg, fmt)
    n_target = dims.pop("n_target")
    cfg = src.config if fmt == "zlab_dflash" else {}
    dcfg = cfg.get("dflash_config") or {}
    n_layers = base_cfg.num_hidden_layers
    if fmt == "zlab_dflash":
        for key, ours in (("hidden_size", base_cfg.hidden_size), ("vocab_size", base_cfg.vocab_size),
                          ("num_target_layers", n_layers)):
            if key in cfg and cfg[key] != ours:
                raise ValueError(f"{fmt}: {src.path}/config.json says {key}={cfg[key]}, this base has {ours}: the "
                                 f"drafter was trained for another base")
        swa = dcfg.get("use_swa") or (cfg.get("sliding_window") and cfg.get("use_sliding_window"))
        if cfg.get("rope_scaling") or swa:
            raise ValueError(f"{fmt}: {src.path} uses rope_scaling or sliding-window attention: not supported yet")
        if any(t != "full_attention" for t in cfg.get("layer_types") or []):
            raise ValueError(f"{fmt}: {src.path} has layer_types {cfg['layer_types']}: only full attention is "
                             f"supported yet")
        for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                    "num_hidden_layers"):
            if key in cfg and cfg[key] != dims[key]:
                raise ValueError(f"{fmt}: {src.path}/config.json says {key}={cfg[key]}, its tensors say "
                                 f"{dims[key]}")
    arch = dict(dims)
    for key in ("rms_norm_eps", "hidden_act"):
        if key in cfg:
            arch[key] = cfg[key]
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta:
        arch["rope_theta"] = theta
    arch.update((saved.get("dflash_architecture_config") or {}) | (overrides.get("dflash_architecture_config") or {}))
    out = {k: v for k, v in saved.items() if k != "dflash_architecture_config"}
    out["dflash_architecture_config"] = arch
    if "block_size" in cfg:
        out.setdefault("dflash_block_size", cfg["block_size"])
    if dcfg.get("mask_token_id") is not None:
        out.setdefault("dflash_mask_token_id", dcfg["mask_token_id"])
    if dcfg.get("target_layer_ids"):
        out.setdefault("dflash_target_layer_ids", list(dcfg["target_layer_ids"]))
    out.update({k: v for k, v in overrides.items() if k != "dflash_architecture_config"})
    if out.get("dflash_mask_token_id") is None:
        raise ValueError(f"{fmt}: {src.path} does not say its mask token; pass config={{'dflash_mask_token_id': ID, "
                         f"'dflash_block_size': B}} as it was trained (ModelOpt keeps them in its own state)")
    ids = out.get("dflash_target_layer_ids")
    if ids is None:
        from exporter.speculative.config import build_target_layer_ids

        if n_target != dims["num_hidden_layers"] or n_layers < n_target:
            raise ValueError(f"{fmt}: the DFlash drafter in {src.path} fuses {n_target} base layers and names none; "
                             f"pass config={{'dflash_target_layer_ids': [...]}} ({n_target} ids in 0..{n_layers - 2})")
        ids = out["dflash_target_layer_ids"] = build_target_layer_ids(n_layers, n_target)
        log.warning("%s: %s names no target layers: using ModelOpt's build_target_layer_ids -> %s", fmt, src.path, ids)
    if len(ids) != n_target:
        raise ValueError(f"{fmt}: {src.path} names {len(ids)} target layers {ids}, but its fc.weight "
                         f"{src.shape(mapping['fc.weight'])} fuses {n_target}")
    return _Plan("dflash", out, sources=dict(mapping))


MODELOPT_STATE = "modelopt_state.pth"  # ModelOpt's HF checkpointing writes it beside the weights
# what this drafter takes from ModelOpt's saved DFlashConfig (its dims come from the tensors)
_MODELOPT_DFLASH_KEYS = ("dflash_block_size", "dflash_mask_token_id", "dflash_loss_objective",
                         "dflash_loss_decay_factor", "dflash_dpace_alpha", "dflash_num_anchors",
                         "dflash_self_logit_distillation")


def _modelopt_dflash_state(src: _Source) -> dict:
    """The ``dflash`` mode's config in ModelOpt's ``modelopt_state.pth`` (``{"modelopt_state_dict": [(mode,
    {"config": dict, "metadata": dict}), ...]}``), as our config keys; {} when absent or not plain data."""
    f = (src.path if src.path.is_dir() else src.path.parent) / MODELOPT_STATE
    if not f.is_file():
        return {}
    try:
        state = torch.load(str(f), map_location="cpu", weights_only=True)
    except Exception as e:  # pickled classes: not read (no code runs from a checkpoint)
        log.warning("%s is not plain data (%s); pass the DFlash block size and mask token as config=", f, e)
        return {}
    modes = state.get("modelopt_state_dict") if isinstance(state, dict) else None
    cfg = next((m[1].get("config") for m in modes or [] if isinstance(m, (list, tuple)) and len(m) == 2
                and m[0] == "dflash" and isinstance(m[1], dict)), None)
    if not isinstance(cfg, dict):
        return {}
    out = {k: cfg[k] for k in _MODELOPT_DFLASH_KEYS if cfg.get(k) is not None}
    arch = cfg.get("dflash_architecture_config") or {}
    out["dflash_architecture_config"] = {k: arch[k] for k in ("rms_norm_eps", "hidden_act") if k in arch}
    return out


def _zlab_dflash(src: _Source, base_cfg, overrides) -> _Plan:
    mapping = {k: k for k in src.names() if not _IGNORED.search(k)}
    return _dflash_plan(src, mapping, base_cfg, "zlab_dflash", overrides, {})


# format -> importer(source, base HF config, user overrides) -> plan
_IMPORTERS: dict[str, Callable[[_Source, object, dict], _Plan]] = {
    "modelopt": _modelopt,
    "fasterdecoding_medusa": _fasterdecoding_medusa,
    "safeailab_eagle": lambda src, cfg, over: _safeailab(src, cfg, over, eagle3=False),
    "safeailab_eagle3": lambda src, cfg, over: _safeailab(src, cfg, over, eagle3=True),
    "zlab_dflash": _zlab_dflash,
}


# ---------------------------------------------------------------------------------------------
# Loading


def _zero_fill(ours: str, own: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Tensors a foreign drafter may lack that have an exact neutral value in ours."""
    if re.fullmatch(r"fc\.bias|layers\.\d+\.self_attn\.[qkv]_proj\.bias", ours):
        return torch.zeros_like(own[ours])  # no bias == zero bias
    if ours == "d2t":
        return torch.zeros_like(own[ours])  # draft vocabulary == target vocabulary
    return None


def _build_state(model, src: _Source, plan: _Plan, fmt: str) -> dict[str, torch.Tensor]:
    own = model.drafter.state_dict()
    state: dict[str, torch.Tensor] = {}
    for ours, key in plan.sources.items():
        if ours not in own:
            raise ValueError(
                f"{fmt}: tensor {key!r} in {src.path} has no place in a {plan.mode} drafter for this base "
                f"({model.config.model_type}); was it trained for another architecture?"
            )
        t = src.get(key)
        if tuple(t.shape) != tuple(own[ours].shape):
            raise _shape_error(fmt, src, key, t.shape, own[ours].shape, model.config)
        state[ours] = t
    for ours, same in plan.copies.items():
        state[ours] = state[same]
    for ours in own:
        if ours in state:
            continue
        if ours == "lm_head.weight" and model.drafter.lm_head.out_features == model.config.vocab_size:
            state[ours] = model.get_output_embeddings().weight.detach().clone()  # ModelOpt: base lm_head
            continue
        fill = _zero_fill(ours, own)
        if fill is None:
            raise ValueError(
                f"{fmt}: {src.path} has no tensor for {ours!r} of this base's {plan.mode} drafter "
                f"({model.config.model_type}); was it trained for another architecture?"
            )
        log.info("%s: %s absent in %s, using zeros", fmt, ours, src.path)
        state[ours] = fill
    return state


def load_external_drafter(model, path, fmt: str = "auto", config: dict | None = None):
    """Convert the unconverted base ``model`` and load a drafter trained elsewhere; returns ``model``.

    ``path``: a drafter file (``.safetensors``, ``.pt``, ``.bin``) or a directory holding one (plus an
    optional ``config.json``). ``fmt``: ``"auto"`` (detect from the tensor names) or one of
    :data:`FORMATS`. ``config``: drafter config keys that override what is inferred, e.g.
    ``{"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}`` or ``{"eagle_ttt_steps": 5}``.
    A drafter that does not fit raises ``ValueError`` and leaves ``model`` unconverted.
    """
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"unknown drafter format {fmt!r}; accepted: 'auto' or {_accepted()}")
    if is_converted(model):
        raise ValueError(f"model already has a {model.spec_mode} drafter; load into a fresh base model")
    check_causal_lm(model)
    path = Path(path)
    if not path.exists():
        raise ValueError(f"drafter path {path} does not exist")
    ours = path / DRAFTER_WEIGHTS if path.is_dir() else path
    if fmt == "drafter" or (
        fmt == "auto" and ours.name == DRAFTER_WEIGHTS and ours.with_name(DRAFTER_CONFIG).is_file()
    ):
        if config:
            raise ValueError("config overrides are not supported for the 'drafter' format (it stores its config)")
        return load_drafter(model, path)
    src = _Source(path)
    fmt = detect_format(src.names()) if fmt == "auto" else fmt
    plan = _IMPORTERS[fmt](src, model.config, dict(config or {}))
    with undo_convert_on_error(model):  # (a DFlash plan has merged the overrides already, nested ones too)
        convert(model, [(plan.mode, plan.config if plan.mode == "dflash" else {**plan.config, **(config or {})})])
        state = _build_state(model, src, plan, fmt)
        load_drafter_state(model, state, f"{src.path} ({fmt})")
    log.info("loaded a %s drafter from %s (%s): %s", plan.mode, path, fmt, model.config.speculative_decoding)
    return model
