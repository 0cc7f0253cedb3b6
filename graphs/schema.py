"""The manifest's schema, checked before the runtime allocates anything or opens any other file.

:func:`check_manifest` validates the parsed JSON: types and ranges of every field the runtime reads,
file names confined to ``out_dir`` (relative, no ``..``), every file the runtime opens listed in
``files``, and the sizes in ``source``/``drafter`` equal to the graphs' own declared inputs (so a
``num_layers`` of 10**9 cannot allocate 10**9 caches). :func:`check_session` then compares each
graph's declared contract with the inputs/outputs of the ONNX file itself. Every failure is an
:class:`~graphs.errors.ArtifactError` naming the field.
"""

from __future__ import annotations

import re

from graphs import contract as C
from graphs.errors import ArtifactError

DTYPES = {"int64", "int32", "bool", "float32", "float16", "bfloat16"}
DRAFTER_KINDS = ("medusa", "eagle", "dflash")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# the largest sizes a manifest may declare: far above any real model, far below an allocation bomb
LIMITS = {"num_layers": 1024, "num_kv_heads": 1024, "head_dim": 4096, "hidden_size": 1 << 17,
          "vocab_size": 1 << 22, "num_heads": 64, "draft_vocab_size": 1 << 22}


def _fail(what: str, problem: str):
    raise ArtifactError(f"manifest {what} {problem}; re-export the model")


def _int(d: dict, key: str, where: str, required: bool = True, lo: int = 1) -> int | None:
    v = d.get(key)
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        _fail(f"{where}.{key}", f"must be an integer, got {v!r}" if key in d else "is missing")
    hi = LIMITS.get(key, 1 << 40)
    if not lo <= v <= hi:
        _fail(f"{where}.{key}", f"= {v} is outside [{lo}, {hi}]")
    return v


def _dict(d: dict, key: str, required: bool = True, none_ok: bool = False) -> dict | None:
    if key not in d:
        if required:
            _fail(f"key {key!r}", "is missing")
        return None
    v = d[key]
    if v is None and none_ok:
        return None
    if not isinstance(v, dict):
        _fail(key, f"must be a JSON object, got {type(v).__name__}")
    return v


def check_path(rel, where: str) -> str:
    """A file name inside out_dir: relative, '/'-separated, no '..' or '.' parts, no NUL."""
    if not isinstance(rel, str) or not rel:
        _fail(where, f"must be a file name, got {rel!r}")
    parts = rel.split("/")
    if rel.startswith("/") or "\\" in rel or "\0" in rel or any(p in ("", ".", "..") for p in parts) or (
        re.match(r"[A-Za-z]:", rel)
    ):
        _fail(where, f"names {rel!r}, which is not a plain relative path inside the export")
    return rel


def _tensor(t, where: str) -> None:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("dtype") not in DTYPES:
        _fail(where, f"is not a tensor spec {{name, dtype in {sorted(DTYPES)}, dims}}: {str(t)[:80]}")
    dims = t.get("dims")
    if not isinstance(dims, list) or not all(
        (isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 1 << 24) or isinstance(x, str) for x in dims
    ):
        _fail(where, f"has bad dims {str(dims)[:80]}")


def _graph(role: str, g, files: dict) -> None:
    if not isinstance(g, dict):
        _fail(f"graphs.{role}", "must be a JSON object")
    check_path(g.get("file"), f"graphs.{role}.file")
    if g["file"] not in files:
        _fail(f"graphs.{role}.file", f"{g['file']!r} is not listed in files (its sha256 is unknown)")
    for side in ("inputs", "outputs"):
        ts = g.get(side)
        if not isinstance(ts, list) or not ts:
            _fail(f"graphs.{role}.{side}", "must be a non-empty list")
        for i, t in enumerate(ts):
            _tensor(t, f"graphs.{role}.{side}[{i}]")


def _kv_dims(g: dict, role: str, layers: int, kv_heads: int, head_dim: int) -> None:
    """The graph declares exactly ``layers`` past K/V pairs of (B, kv_heads, P, head_dim)."""
    past = [t for t in g["inputs"] if t["name"].startswith("past_key_values.")]
    want = [n for i in range(layers) for n in (C.past_key(i), C.past_value(i))]
    if [t["name"] for t in past] != want:
        _fail(f"graphs.{role}", f"declares {len(past) // 2} past K/V layers where the manifest says {layers}")
    in_place = any(t["name"] == C.KV_WRITE for t in g["inputs"])
    for t in past:
        d = t["dims"]
        if in_place and len(d) == 3 and d[2] == kv_heads * head_dim:  # the "bsh" buffers (graphs.contract)
            continue
        if len(d) != 4 or d[1] != kv_heads or d[3] != head_dim:
            _fail(f"graphs.{role}", f"input {t['name']} has dims {d}, not [batch, {kv_heads}, past, {head_dim}]")


def _out_dim(g: dict, name: str, axis: int):
    t = next((t for t in g["outputs"] if t["name"] == name), None)
    return None if t is None or len(t["dims"]) <= abs(axis) else t["dims"][axis]


def _dflash(drafter: dict, graphs: dict, n_layers: int, vocab: int) -> None:
    """A DFlash drafter: its cache dims, block, mask token and target layers, and a base that emits them."""
    _kv_dims(graphs["draft"], "draft", _int(drafter, "num_layers", "drafter"),
             _int(drafter, "num_kv_heads", "drafter"), _int(drafter, "head_dim", "drafter"))
    _int(drafter, "block_size", "drafter", lo=2)
    _int(drafter, "mask_token_id", "drafter", lo=0)
    if drafter["mask_token_id"] >= vocab:
        _fail("drafter.mask_token_id", f"= {drafter['mask_token_id']} is outside the vocabulary ({vocab})")
    if "draft_vocab_size" in drafter and _int(drafter, "draft_vocab_size", "drafter") > vocab:  # (older: absent)
        _fail("drafter.draft_vocab_size", f"= {drafter['draft_vocab_size']} is over the vocabulary ({vocab})")
    ids = drafter.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in ids):
        _fail("drafter.target_layer_ids", f"must be a non-empty list of base layers in [0, {n_layers}), got {ids!r}")
    width = _out_dim(graphs["base"], C.AUX_HIDDEN, -1)
    if width is None or width != _in_dim(graphs["draft"], C.AUX_HIDDEN, -1):
        _fail("graphs.base", f"does not emit the {len(ids)} target layers the DFlash drafter reads")


def _in_dim(g: dict, name: str, axis: int):
    t = next((t for t in g["inputs"] if t["name"] == name), None)
    return None if t is None or len(t["dims"]) <= abs(axis) else t["dims"][axis]


def check_manifest(d) -> None:
    """Raise ArtifactError unless ``d`` (parsed manifest.json) is a well-formed, self-consistent manifest."""
    if not isinstance(d, dict):
        _fail("", f"must be a JSON object, got {type(d).__name__}")
    files = _dict(d, "files")
    for rel, digest in files.items():
        check_path(rel, "files key")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            _fail(f"files[{rel!r}]", "is not a sha256 hex digest")
    src = _dict(d, "source")
    n_layers = _int(src, "num_layers", "source")
    kv_heads = _int(src, "num_kv_heads", "source")
    head_dim = _int(src, "head_dim", "source")
    vocab = _int(src, "vocab_size", "source")
    _int(src, "max_position_embeddings", "source", required=False)
    _int(src, "sliding_window", "source", required=False)
    graphs = _dict(d, "graphs")
    if "base" not in graphs:
        _fail("graphs", f"has no 'base' graph (it lists {sorted(graphs)})")
    for role, g in graphs.items():
        _graph(role, g, files)
    base = graphs["base"]
    _kv_dims(base, "base", n_layers, kv_heads, head_dim)
    if _out_dim(base, C.LOGITS, -1) != vocab:
        _fail("graphs.base", f"logits do not end in the vocabulary size {vocab}")
    drafter = _dict(d, "drafter", required=False, none_ok=True)
    if (drafter is None) != ("draft" not in graphs):
        _fail("drafter", "and graphs.draft must be both present or both absent")
    if drafter is not None:
        kind = drafter.get("kind")
        if kind not in DRAFTER_KINDS:
            _fail("drafter.kind", f"{kind!r} is unknown; this runtime reads {', '.join(DRAFTER_KINDS)}")
        if kind == "medusa":
            heads = _int(drafter, "num_heads", "drafter")
            if _out_dim(graphs["draft"], C.LOGITS, 2) != heads:
                _fail("graphs.draft", f"logits do not have {heads} Medusa heads")
        elif kind == "dflash":
            _dflash(drafter, graphs, n_layers, vocab)
        else:
            _kv_dims(graphs["draft"], "draft", _int(drafter, "num_layers", "drafter"),
                     _int(drafter, "num_kv_heads", "drafter"), _int(drafter, "head_dim", "drafter"))
            _int(drafter, "draft_vocab_size", "drafter", required=False)
            if not isinstance(drafter.get("eagle3", False), bool):
                _fail("drafter.eagle3", "must be true or false")
    tree = _dict(d, "tree", required=False) or {}
    if "medusa_paths" in tree and not isinstance(tree["medusa_paths"], list):
        _fail("tree.medusa_paths", "must be a list of paths")
    if "eagle" in tree and not isinstance(tree["eagle"], dict):
        _fail("tree.eagle", "must be {topk, depth, total_tokens}")
    if "dflash" in tree:
        if not isinstance(tree["dflash"], dict):
            _fail("tree.dflash", "must be {topk, total_tokens}")
        _int(tree["dflash"], "topk", "tree.dflash")
        _int(tree["dflash"], "total_tokens", "tree.dflash")
    gen = _dict(d, "generation")  # the exporter always writes it (eos ids): missing means tampered
    eos = gen.get("eos_token_ids") or []
    if not isinstance(eos, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
        _fail("generation.eos_token_ids", f"must be a list of token ids, got {eos!r}")
    for key in ("bos_token_id", "pad_token_id"):
        _int(gen, key, "generation", required=False, lo=0)
    tok = d.get("tokenizer")
    if tok is not None:
        check_path(tok, "tokenizer")
        if tok not in files:
            _fail("tokenizer", f"{tok!r} is not listed in files (its sha256 is unknown)")
    for key in ("versions", "validation", "optimization"):
        _dict(d, key, required=False, none_ok=True)
    base_opt = (d.get("optimization") or {}).get("base")
    one = base_opt.get("one_sequence") if isinstance(base_opt, dict) else None
    if one is not None:  # the base's one-sequence graph: a file of the export, like the graphs
        if not isinstance(one, dict) or not isinstance(one.get("file"), str):
            _fail("optimization.base.one_sequence", "must be {\"file\": a graph file of the export, ...}")
        check_path(one["file"], "optimization.base.one_sequence.file")
        _int(one, "max_columns", "optimization.base.one_sequence", required=False, lo=1)
        if one["file"] not in files:
            _fail("optimization.base.one_sequence.file", f"{one['file']!r} is not listed in files (its sha256 is "
                                                          f"unknown)")
    forms = base_opt.get("attention_forms") if isinstance(base_opt, dict) else None
    if forms is not None:  # --target cuda: the attention forms built, and the one the device measured faster
        where = "optimization.base.attention_forms"
        cands = forms.get("candidates") if isinstance(forms, dict) else None
        if not isinstance(cands, dict) or not cands or forms.get("chosen") not in cands:
            _fail(where, "must be {\"candidates\": {form: {\"file\": ...}}, \"chosen\": one of the candidates}")
        for form, cand in cands.items():
            if not isinstance(cand, dict) or not isinstance(cand.get("file"), str):
                _fail(f"{where}.candidates.{form}", "must be {\"file\": a graph file of the export, ...}")
            check_path(cand["file"], f"{where}.candidates.{form}.file")
            if cand["file"] not in files:
                _fail(f"{where}.candidates.{form}.file", f"{cand['file']!r} is not listed in files (its sha256 is "
                                                          f"unknown)")
    if not isinstance(d.get("opset", 17), int):
        _fail("opset", "must be an integer")


def check_session(spec: C.GraphSpec, session, role: str) -> None:
    """The ONNX file's own inputs/outputs must be the ones the manifest declares (names, dtypes, fixed dims)."""
    for side, declared, actual in (("input", spec.inputs, session.get_inputs()),
                                   ("output", spec.outputs, session.get_outputs())):
        got = {a.name: a for a in actual}
        if set(got) != {t.name for t in declared}:
            extra = sorted(set(got) ^ {t.name for t in declared})
            raise ArtifactError(f"the {role} graph {spec.file} does not have the {side}s its manifest declares "
                                f"(differs in {extra[:3]}); re-export the model")
        for t in declared:
            a = got[t.name]
            fixed = [(x, y) for x, y in zip(t.dims, a.shape) if isinstance(x, int) and isinstance(y, int)]
            if len(a.shape) != len(t.dims) or any(x != y for x, y in fixed) or f"({t.dtype})" not in a.type.replace(
                    "float)", "float32)").replace("double)", "float64)"):
                raise ArtifactError(f"the {role} graph {spec.file}'s {side} {t.name} is {a.type} {a.shape}, its "
                                    f"manifest declares {t.dtype} {list(t.dims)}; re-export the model")


def load_graph(make_session, path, *args):
    """``make_session(path, *args)``; a graph ONNX Runtime refuses to load (damaged, external data
    outside the export, unknown ops) is an ArtifactError, not a raw ONNX Runtime exception."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    try:
        return make_session(path, *args)
    except (ort_state.Fail, ort_state.InvalidGraph, ort_state.InvalidProtobuf, ort_state.NoSuchFile,
            ort_state.InvalidArgument) as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ArtifactError(f"ONNX Runtime cannot load {path} ({detail}); re-export the model") from None
