"""Checks of export inputs that must fail before any tracing, and the copy of the model's side files.

- ``--opset`` within what the tracer writes and the graphs need;
- ``generation_config.json`` and ``tokenizer.json`` parse (a corrupt one used to fail after tracing,
  or only at run time);
- ``rope_scaling`` names a RoPE type transformers knows, with numeric parameters (a bogus one used
  to be reported as corrupt weights);
- side files are copied only as regular files; a symlink is followed only when its target stays
  inside ``model_dir`` (or, for a Hugging Face cache snapshot, inside that model's cache entry), so
  an export never picks up an arbitrary file of the user's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

from exporter.errors import UserError

MIN_OPSET = 17  # Unsqueeze/Slice with tensor inputs, bool masks: what our graphs are tested with


def max_opset() -> int:
    """The newest opset torch's TorchScript exporter (``dynamo=False``) writes."""
    from torch.onnx import _constants

    return int(getattr(_constants, "ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET", 20))


def check_opset(opset) -> None:
    hi = max_opset()
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= hi:
        raise UserError(f"--opset {opset} is not supported; pass an opset from {MIN_OPSET} to {hi}")


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); fix or delete the {what}") from None


def check_generation_config(model_dir: Path) -> None:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return
    data = _read_json(path, "generation config")
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object, not {type(data).__name__}; fix or delete it")
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        v = data.get(key)
        ok = v is None or _is_id(v) or (key == "eos_token_id" and isinstance(v, list) and all(map(_is_id, v)))
        if not ok:
            raise UserError(f"{path}: {key} must be a token id{' or a list of ids' if key == 'eos_token_id' else ''}, "
                            f"got {v!r}; fix or delete the file")
    from transformers import GenerationConfig

    try:
        GenerationConfig.from_dict(dict(data))
    except Exception as e:  # transformers' own validation (ValueError, TypeError, ...)
        raise UserError(f"{path} is not a valid generation config ({type(e).__name__}: {e}); fix or delete "
                        f"it") from None


def _is_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_tokenizer(model_dir: Path) -> None:
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return
    real = _safe_source(model_dir, path)
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(real))
    except Exception as e:  # tokenizers raises its own Exception type for every parse error
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path} cannot be read by tokenizers ({detail}); re-save the tokenizer") from None


def check_rope(config, model_dir: Path) -> None:
    """``rope_scaling`` (``rope_parameters`` in transformers 5) must name a known type with numeric values."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not rope:
        return
    if not isinstance(rope, dict):
        raise UserError(f"{model_dir}/config.json: rope_scaling must be an object, got {rope!r}; fix the config")
    kind = rope.get("rope_type", rope.get("type", "default"))
    known = sorted({"default", *ROPE_INIT_FUNCTIONS})
    if kind not in known:
        raise UserError(f"{model_dir}/config.json: rope_scaling type {kind!r} is unknown; transformers knows "
                        f"{', '.join(known)}")
    for k, v in rope.items():
        if k not in ("rope_type", "type") and not isinstance(v, (int, float, list, type(None))):
            raise UserError(f"{model_dir}/config.json: rope_scaling {k} must be a number, got {v!r}; fix the config")


def check_export_inputs(model_dir: Path, copied=()) -> None:
    """Everything about ``model_dir`` that can be checked without building the model; ``copied``: the
    side files the export will copy (each must be a regular file or an allowed link)."""
    model_dir = Path(model_dir)
    if model_dir.is_dir():
        for name in copied:
            if os.path.lexists(model_dir / name):
                _safe_source(model_dir, model_dir / name)
        for name in COPIED_DIRS:
            if os.path.lexists(model_dir / name):
                _safe_dir(model_dir, model_dir / name)
        check_shard_index(model_dir)
        check_generation_config(model_dir)
        check_tokenizer(model_dir)


SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def check_shard_index(model_dir: Path) -> None:
    """A shard index names its shards as files of ``model_dir``: a name with a directory part
    (``../foreign/x.safetensors``, an absolute path) or a shard that is a link out of ``model_dir``
    would load weights from elsewhere (transformers follows it), so it is refused, as the tokenizer
    files are."""
    for index in SHARD_INDEXES:
        path = model_dir / index
        if not os.path.lexists(path):
            continue
        data = _read_json(_safe_source(model_dir, path), "shard index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise UserError(f"{path} has no weight_map object; re-save the model with save_pretrained")
        for shard in sorted(set(map(str, weight_map.values()))):
            if not shard or Path(shard).name != shard or shard in (".", ".."):
                tensor = next(k for k, v in weight_map.items() if str(v) == shard)
                raise UserError(f"{path}: {tensor} is mapped to {shard!r}, outside {model_dir}; a shard index "
                                f"names files of the model directory: copy the shard into {model_dir}")
            if os.path.lexists(model_dir / shard):
                _safe_source(model_dir, model_dir / shard)


def _safe_dir(model_dir: Path, path: Path) -> Path:
    """``path`` if it is a directory; its target if it is a link to a directory inside the allowed root."""
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if _allowed_root(model_dir) not in target.parents or not target.is_dir():
            raise UserError(f"{path} is a symlink to {target}, outside {model_dir}; copy the directory into "
                            f"{model_dir} instead of linking it")
        return target
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; it must hold the named chat templates (*.jinja)")
    return path


def _allowed_root(model_dir: Path) -> Path:
    """Where links in ``model_dir`` may point: itself, or a HF cache entry (snapshots/<rev> -> ../../blobs)."""
    real = Path(os.path.realpath(model_dir))
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return real


def _safe_source(model_dir: Path, path: Path) -> Path:
    """``path`` itself if it is a regular file; its target if it is a link that stays inside the allowed root."""
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode):
        return path
    if not stat.S_ISLNK(st.st_mode):
        raise UserError(f"{path} is not a regular file; replace it with the file itself")
    target = Path(os.path.realpath(path))
    root = _allowed_root(model_dir)
    if root not in target.parents or not target.is_file():
        raise UserError(f"{path} is a symlink to {target}, outside {model_dir}; copy the file into {model_dir} "
                        f"instead of linking it")
    return target


def copy_model_files(model_dir: Path, dst: Path, names) -> None:
    """Copy the side files (tokenizer, generation config) that exist in ``model_dir`` into ``dst``."""
    for name in names:
        src = Path(model_dir) / name
        if not os.path.lexists(src):
            continue
        shutil.copyfile(_safe_source(Path(model_dir), src), dst / name)  # content only, mode from the umask


# Files copied from model_dir so that the runtime can tokenize and stop without transformers, and
# other tools (AutoTokenizer, AutoConfig, GenerationConfig, chat templates) read the export directory
# as they read the model's. config.json is written by copy_model_files (the base's, no drafter key).
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
COPIED_DIRS = ("additional_chat_templates",)  # transformers' extra named chat templates (*.jinja)
DRAFTER_CONFIG_KEYS = ("speculative_decoding",)  # ours, in config.json: the export's config is the base's


def copy_export_files(model_dir: Path, dst: Path) -> None:
    """The tokenizer, chat template and generation files of ``model_dir``, and the base's config.json
    (without our drafter key), so that HF loaders read the export directory as they read a model's."""
    copy_model_files(model_dir, dst, COPIED_FILES)  # regular files only; links must stay in model_dir
    for name in COPIED_DIRS:
        if not os.path.lexists(model_dir / name):
            continue
        src = _safe_dir(model_dir, model_dir / name)  # a link inside model_dir is copied as a directory
        (dst / name).mkdir()
        copy_model_files(src, dst / name, sorted(p.name for p in src.iterdir() if not p.is_dir()))
    config = json.loads((model_dir / "config.json").read_text())
    for key in DRAFTER_CONFIG_KEYS:
        config.pop(key, None)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


_LAYER_KEY = re.compile(r"^(?:model\.(?:decoder\.)?layers|transformer\.h|gpt_neox\.layers)\.(\d+)\.")


def _safetensors_header(f: Path) -> dict | None:
    """The JSON header of one safetensors file ({name: {"dtype", "shape", ...}}), no tensor read;
    ``None`` when it cannot be read or is not a plausible header."""
    try:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n <= 100 << 20:
                return None
            header = json.loads(fh.read(n))
    except (OSError, ValueError):
        return None
    return header if isinstance(header, dict) else None


def checkpoint_tensor_names(model_dir: Path) -> list[str] | None:
    """The tensor names of ``model_dir``'s safetensors checkpoint, read from the shard index or the
    files' headers (no tensor is read); ``None`` when it has none (``*.bin`` only) or a header is bad
    (the load then names the damage)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            return list(json.loads(index.read_bytes())["weight_map"])
        except (ValueError, KeyError, TypeError):
            return None
    names = []
    files = sorted(model_dir.glob("*.safetensors"))
    for f in files:
        header = _safetensors_header(f)
        if header is None:
            return None
        names += [k for k in header if k != "__metadata__"]
    return names if files else None


def checkpoint_tensor_shape(model_dir: Path, name: str) -> list[int] | None:
    """The shape of tensor ``name`` in ``model_dir``'s safetensors checkpoint, from the header of the
    file that holds it (the shard the index names, or any ``*.safetensors``); ``None`` if not found."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shard = json.loads(index.read_bytes())["weight_map"].get(name)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        # check_shard_index confines the shards; a name with a directory part is never opened here
        files = [model_dir / shard] if isinstance(shard, str) and Path(shard).name == shard else []
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    for f in files:
        entry = (_safetensors_header(f) or {}).get(name)
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if isinstance(shape, list) and all(isinstance(d, int) for d in shape):
            return shape
    return None


# the input embedding of each supported layout: rows = vocab_size, columns = hidden_size
_EMBEDDINGS = ("model.embed_tokens.weight", "model.decoder.embed_tokens.weight", "transformer.wte.weight",
               "gpt_neox.embed_in.weight")


def check_checkpoint_sizes(config, model_dir: Path) -> None:
    """``vocab_size`` and ``hidden_size`` of ``config.json`` against the checkpoint's embedding (read from
    the safetensors header, no tensor loaded), before the model is built: a vocab_size of 10**9 used
    to build (or try to allocate) the model, then fail with transformers' "look at the above report"
    and no report above."""
    for name in _EMBEDDINGS:
        shape = checkpoint_tensor_shape(model_dir, name)
        if shape is None or len(shape) != 2:
            continue
        for key, have in (("vocab_size", shape[0]), ("hidden_size", shape[1])):
            want = getattr(config, key, None)
            if isinstance(want, int) and not isinstance(want, bool) and want != have:
                raise UserError(f"{model_dir}/config.json says {key}={want} but the checkpoint's {name} has "
                                f"shape {shape} ({key} {have}); fix {key} in config.json (or re-save the model)")
        return


def check_checkpoint_layers(config, model_dir: Path) -> None:
    """A config asking for more decoder layers than the checkpoint holds fails here, before the model
    is built (100,000 layers against a 2-layer checkpoint used to build them all, then fail on the
    missing weights)."""
    want = getattr(config, "num_hidden_layers", None)
    names = checkpoint_tensor_names(model_dir)
    if not isinstance(want, int) or names is None:
        return
    have = {int(m.group(1)) for m in map(_LAYER_KEY.match, names) if m}
    if have and want > len(have):
        raise UserError(f"{model_dir}/config.json asks for num_hidden_layers={want} but the checkpoint holds "
                        f"{len(have)} decoder layers; fix num_hidden_layers (or re-save the model)")
