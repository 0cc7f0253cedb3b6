"""A GGUF file as a Hugging Face model directory: dequantized to float32 once, cached by its sha256.

    find_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")  -> Path("SmolLM2-135M-Instruct.Q4_1.gguf")
    find_gguf("dir_with_one_gguf")                 -> Path("dir_with_one_gguf/model.gguf")
    find_gguf("hf_model_dir")                      -> None  (a config.json: a model directory)
    resolve_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
        -> ~/.cache/specexport/gguf/<sha256>/  (config.json, model.safetensors, tokenizer files,
           generation_config.json, gguf-source.json)

The conversion (:func:`convert_gguf`) is transformers' own GGUF reader
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``, which needs the ``gguf`` package)
followed by a rebuild: ``save_pretrained`` refuses a GGUF-loaded model, so the architecture is built
again from its config, given the loaded state dict (every key must match) and saved with safetensors,
beside the tokenizer (with its chat template) and the generation config. Before the directory is
kept, it is loaded back and its logits must equal the GGUF-loaded model's on a short prompt.

The cache: ``$SPECEXPORT_CACHE_DIR/gguf/<sha256>/`` (the project's cache root, as for the runtime's
integrity records: default ``$XDG_CACHE_HOME/specexport``, else ``~/.cache/specexport``). A conversion
runs in ``.<sha256>.tmp-<pid>`` beside it and is renamed into place when complete, so a killed one
leaves nothing that a later run would take for a conversion (its leftovers are removed by the next
conversion of the same file). The sha256 of a path is remembered against its size and modification
time (``sha256-index.json``), so a second resolve of an unchanged file neither rereads nor converts it.

Checks run in the order that fails fastest: the magic bytes before hashing; the header, the
architecture (transformers' and the exporter's), the tokenizer and the quantization types before
converting. Each failure is one :class:`UserError` line naming the file and what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from exporter.errors import UserError
from exporter.progress import EVERY_S, heartbeat

SUFFIX = ".gguf"
MAGIC = b"GGUF"
SOURCE_FILE = "gguf-source.json"  # written last in a conversion: what was converted, when, by which versions
INDEX_FILE = "sha256-index.json"  # {absolute path: {size, mtime_ns, sha256}}
PROGRESS_EVERY_S = EVERY_S  # the longest a phase goes without a progress line
PROBE_TEXT = "The capital of France is"  # the prompt whose logits must survive the conversion
PARITY_MAX_ABS = 1e-5  # same float32 weights, same code: the logits agree to rounding (they are equal)


@dataclass(frozen=True)
class GgufInfo:
    """What a GGUF's header says, read without dequantizing anything."""

    path: Path
    architecture: str  # general.architecture, e.g. "llama"
    name: str | None  # general.name, if any
    tensor_types: dict[str, int]  # ggml type name -> how many tensors are stored in it
    tokenizer_model: str | None  # tokenizer.ggml.model ("gpt2", "llama", ...), None: no tokenizer
    has_tokens: bool  # tokenizer.ggml.tokens present


# ----------------------------------------------------------------------------- where, and which file


def cache_root() -> Path:
    """Where converted GGUFs live: ``$SPECEXPORT_CACHE_DIR/gguf``, default ``~/.cache/specexport/gguf``."""
    from graphs.integrity import cache_dir  # the project's one cache root (the runtime's records live there too)

    return cache_dir() / "gguf"


def find_gguf(path) -> Path | None:
    """The ``.gguf`` a path names: the file itself, or the one file of a directory without config.json.

    ``None`` for anything else (a model directory, a hub id): the caller goes on as before. A directory
    with several ``.gguf`` files and no config.json is an error naming them.
    """
    path = Path(path)
    if path.suffix.lower() == SUFFIX:
        if not path.is_file():
            raise UserError(f"{path} does not exist or is not a file; pass the path of a .gguf file")
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise UserError(f"{path} holds {len(found)} .gguf files ({names}); pass the one to use, "
                        f"e.g. {found[0]}")
    return found[0] if found else None


# ----------------------------------------------------------------------------- the top level


def resolve_gguf(path, *, root: Path | None = None, log=print) -> Path:
    """The cached model directory converted from the GGUF ``path``, converting it on the first call."""
    path = Path(path).resolve()
    check_magic(path)
    root = Path(root) if root is not None else cache_root()
    sha = file_sha256(path, root=root, log=log)
    done = root / sha
    if (done / SOURCE_FILE).is_file():
        log(f"gguf: reusing the converted GGUF in {done}", flush=True)
        return done
    with _phase(f"checking the header of {path.name}", log):
        info = read_gguf_info(path)
        model_type = check_gguf(info)
    log(f"gguf: {path.name}: {info.architecture} ({model_type}), tensors "
        f"{', '.join(f'{n} x{c}' for n, c in info.tensor_types.items())}", flush=True)
    return _convert_into_cache(path, sha, root, log)


def _convert_into_cache(path: Path, sha: str, root: Path, log) -> Path:
    """Convert into a temporary directory beside the final one, then rename it into place."""
    root.mkdir(parents=True, exist_ok=True)
    done = root / sha
    _remove_dead_attempts(root, sha)
    tmp = root / f".{sha}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        convert_gguf(path, tmp, log=log)
        source = {"gguf": str(path), "sha256": sha, "size": path.stat().st_size,
                  "seconds": round(time.perf_counter() - t0, 1), "versions": _versions()}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")
        try:
            os.rename(tmp, done)
        except OSError:
            if not (done / SOURCE_FILE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another run converted the same file first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"gguf: converted {path.name} in {time.perf_counter() - t0:.1f} s into {done}", flush=True)
    return done


def _remove_dead_attempts(root: Path, sha: str) -> None:
    """Remove temporary directories that conversions killed before their end left behind."""
    for old in root.glob(f".{sha}.tmp-*"):
        pid = old.name.rpartition("-")[2]
        if not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(old, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ----------------------------------------------------------------------------- checks


def check_magic(path: Path) -> None:
    """One read of four bytes: a file that is not GGUF fails before it is hashed."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}; check the path and its permissions") from None
    if head != MAGIC:
        raise UserError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'); pass a .gguf "
                        f"file or a Hugging Face model directory")


def read_gguf_info(path: Path) -> GgufInfo:
    """The header of ``path``, through the ``gguf`` package; a truncated or damaged file is a UserError."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise UserError(f"reading {path.name} needs the gguf package: pip install gguf") from None
    try:
        reader = GGUFReader(path)
    except Exception as e:  # struct, numpy reshape and value errors: the file ends early or is garbled
        raise UserError(f"{path} is truncated or damaged ({path.stat().st_size} bytes; the gguf package says "
                        f"{_one_line(e)}); download or convert it again") from None
    size = path.stat().st_size
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise UserError(f"{path} is truncated ({size} bytes, its tensors need {end}); download or convert it again")

    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    architecture = field("general.architecture")
    if not architecture:
        raise UserError(f"{path} has no general.architecture in its metadata; it is not a model GGUF")
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return GgufInfo(path=path, architecture=str(architecture), name=field("general.name"),
                    tensor_types=dict(types.most_common()), tokenizer_model=field("tokenizer.ggml.model"),
                    has_tokens="tokenizer.ggml.tokens" in reader.fields)


def check_gguf(info: GgufInfo) -> str:
    """Everything checkable before converting; returns the transformers ``model_type`` it loads as."""
    from exporter.arch import ARCHITECTURES

    model_type = _transformers_model_type(info)
    if model_type not in ARCHITECTURES:
        raise UserError(f"{info.path}: transformers reads this GGUF as {model_type!r}, which the exporter does not "
                        f"support (supported: {', '.join(sorted(ARCHITECTURES))}); use a GGUF of one of those")
    if not info.has_tokens or not info.tokenizer_model:
        raise UserError(f"{info.path} has no tokenizer in its metadata (tokenizer.ggml.model/tokens); the export "
                        f"needs one: use a GGUF written with its tokenizer (llama.cpp's convert_hf_to_gguf.py does)")
    bad = sorted(name for name in info.tensor_types if not dequantizable(name))
    if bad:
        raise UserError(f"{info.path} stores tensors as {', '.join(bad)}, which the gguf package cannot dequantize "
                        f"(it can: {', '.join(dequantizable_types())}); use a GGUF quantized to one of those")
    return model_type


def supported_architectures() -> list[str]:
    """The GGUF architectures (general.architecture) this transformers can load."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    names = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}  # metadata sections, not models
    with contextlib.suppress(ImportError):  # transformers >= 5.24 reads some architectures a newer way
        from transformers.integrations.gguf import GGUF_ARCHS

        names |= set(GGUF_ARCHS)
    return sorted(names)


def _transformers_model_type(info: GgufInfo) -> str:
    """transformers' own verdict on the architecture: its config from the GGUF, or a UserError."""
    from transformers import AutoConfig

    try:
        with _transformers_quiet():
            config = AutoConfig.from_pretrained(info.path.parent, gguf_file=info.path.name)
    except (ValueError, KeyError, NotImplementedError) as e:
        if info.architecture in supported_architectures():
            raise UserError(f"transformers cannot read the config of {info.path} ({_one_line(e)})") from None
        raise UserError(
            f"{info.path}: transformers cannot load GGUF architecture {info.architecture!r} (general.architecture); "
            f"it loads: {', '.join(supported_architectures())}; use a GGUF of one of those or the original model"
        ) from None
    return config.model_type


def dequantizable(type_name: str) -> bool:
    """Whether the gguf package (transformers' dequantizer for these architectures) reads this ggml type."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType[type_name]
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        dequantize(np.zeros((1, block_bytes), dtype=np.uint8), qtype)  # one block of zeros
    except (KeyError, NotImplementedError, ValueError, TypeError):
        return False
    return True


def dequantizable_types() -> list[str]:
    from gguf import GGMLQuantizationType

    return [t.name for t in GGMLQuantizationType if dequantizable(t.name)]


# ----------------------------------------------------------------------------- hashing


def file_sha256(path: Path, *, root: Path, log=print) -> str:
    """sha256 of ``path``, remembered against its size and mtime in ``root/sha256-index.json``."""
    st = path.stat()
    index_file = root / INDEX_FILE
    index = _read_json(index_file)
    seen = index.get(str(path))
    if seen and seen.get("size") == st.st_size and seen.get("mtime_ns") == st.st_mtime_ns:
        return seen["sha256"]
    sha = sha256_streamed(path, log=log)
    index[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    with contextlib.suppress(OSError):  # only a shortcut: a cache that cannot be written is hashed again
        root.mkdir(parents=True, exist_ok=True)
        tmp = index_file.with_name(f".{INDEX_FILE}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(index, indent=1) + "\n")
        os.replace(tmp, index_file)
    return sha


def sha256_streamed(path: Path, *, log=print, chunk: int = 1 << 20, every_s: float = PROGRESS_EVERY_S) -> str:
    """sha256 of a file read in ``chunk``-byte pieces, with a progress line every ``every_s`` seconds."""
    size = path.stat().st_size
    h = hashlib.sha256()
    t0 = last = time.perf_counter()
    done = 0
    log(f"gguf: hashing {path.name} ({size / 1e6:.0f} MB) ...", flush=True)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            done += len(block)
            now = time.perf_counter()
            if now - last >= every_s:
                last = now
                log(f"gguf: hashing {path.name}: {100 * done / max(size, 1):.0f}% "
                    f"({done / 1e6 / (now - t0):.0f} MB/s)", flush=True)
    log(f"gguf: hashed {path.name} in {time.perf_counter() - t0:.1f} s: sha256 {h.hexdigest()[:16]}...", flush=True)
    return h.hexdigest()


# ----------------------------------------------------------------------------- the conversion


def convert_gguf(path: Path, out_dir: Path, *, log=print) -> None:
    """Write ``path`` (a GGUF) into ``out_dir`` as a float32 safetensors model directory, checked.

    Tokenizer first (seconds, and the likelier to fail), then the dequantized model, rebuilt from its
    config and given the loaded state dict, then a reload whose logits must equal the GGUF model's.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = path.parent, path.name
    with _phase(f"reading the tokenizer of {name}", log), _transformers_quiet():
        try:
            tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        except (ValueError, KeyError, NotImplementedError) as e:
            raise UserError(f"transformers cannot build a tokenizer from {path} ({_one_line(e)}); "
                            f"use a GGUF whose tokenizer.ggml.model it supports") from None
    with _phase(f"dequantizing {name} to float32", log), _transformers_quiet():
        try:
            loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32,
                                                          **_dequantize_kwargs())
        except (ValueError, KeyError, NotImplementedError) as e:
            raise UserError(f"transformers cannot dequantize {path} ({_one_line(e)}); use a GGUF quantized "
                            f"to a type it reads (e.g. Q8_0, Q4_K, F16)") from None
        probe = tokenizer(PROBE_TEXT, return_tensors="pt")["input_ids"][:, :32]
        if probe.shape[1] == 0:
            probe = torch.zeros(1, 1, dtype=torch.long)
        with torch.no_grad():
            reference = loaded(probe).logits
    with _phase("rebuilding the model from its config", log):
        config = loaded.config
        for key in ("quantization_config", "_pre_quantization_dtype"):  # the GGUF loader's, not the model's
            if hasattr(config, key):
                delattr(config, key)
        with _no_init_weights():  # every weight is overwritten below: random init would only cost time
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = loaded.state_dict()
        result = model.load_state_dict(state, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise RuntimeError(f"the GGUF-loaded state dict does not fit its own architecture: missing "
                               f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
        generation = loaded.generation_config
        del loaded, state
    with _phase(f"saving float32 safetensors to {out_dir}", log), _transformers_quiet():
        model.eval().save_pretrained(out_dir, safe_serialization=True)
        tokenizer.model_max_length = config.max_position_embeddings  # the GGUF states no limit of its own
        tokenizer.save_pretrained(out_dir)
        generation.save_pretrained(out_dir)
        del model
    with _phase("checking the saved directory against the GGUF model", log), _transformers_quiet():
        saved = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
        with torch.no_grad():
            got = saved(probe).logits
        diff = (got - reference).abs().max().item()
        if diff > PARITY_MAX_ABS:
            raise RuntimeError(f"the converted {path.name} gives other logits than the GGUF model "
                               f"(max |diff| {diff:.3g} > {PARITY_MAX_ABS}) on {probe.shape[1]} tokens")


def _dequantize_kwargs() -> dict:
    """transformers >= 5.24 may keep GGUF blocks packed; ask for the plain float32 model."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}  # older transformers always dequantize
    return {"quantization_config": GgufConfig(dequantize=True)}


def _no_init_weights():
    """transformers' switch that skips the random init of a model built from a config, where it has one."""
    import importlib

    for module in ("transformers.initialization", "transformers.modeling_utils"):  # 5.x, 4.x
        switch = getattr(importlib.import_module(module), "no_init_weights", None)
        if switch is not None:
            return switch()
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- small helpers


@contextlib.contextmanager
def _phase(what: str, log, every_s: float = PROGRESS_EVERY_S):
    """``gguf: <what> ...``, a line every ``every_s`` while it runs, then ``done in N s``."""
    t0 = time.perf_counter()
    log(f"gguf: {what} ...", flush=True)
    with heartbeat(f"gguf: {what}", log, every_s):
        yield
    log(f"gguf: {what} done in {time.perf_counter() - t0:.1f} s", flush=True)


@contextlib.contextmanager
def _transformers_quiet():
    """No transformers progress bars or warnings while it runs (the phase lines say what happens)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("transformers", "gguf", "torch"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
