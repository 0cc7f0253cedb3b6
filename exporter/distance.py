"""How far a quantized (or otherwise intentionally different) export is from the PyTorch model.

A quantized base is a different model: comparing it with PyTorch at float tolerances would fail
for the right reason, and loosening those tolerances would hide real bugs. So compare switches such
graphs from *parity* to *distance*: logits are judged by top-1 agreement and mean KL divergence
against :data:`QUALITY` (thresholds by quantization, one table), and held-out text is scored
teacher-forced by both models: top-1 agreement, mean KL(PyTorch ‖ ONNX) and the perplexity of each,
so a user can judge the quality cost. Nothing here claims bit-parity.

Which graphs are quantized is read from the manifest's ``optimization`` entry (role ->
``{"passes", "target", "dtype", "quantization"}``, written by ``exporter.optimize``) and checked
against the graph itself: a graph holding quantized operators is treated as quantized even where the
manifest says ``"none"`` (the report says so). A manifest without the entry is a raw export.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from graphs.manifest import MANIFEST, Manifest

# Operators that only a weight/activation-quantized graph holds.
QUANTIZED_OPS = frozenset({
    "MatMulNBits", "DequantizeLinear", "QuantizeLinear", "DynamicQuantizeLinear", "MatMulInteger",
    "QLinearMatMul", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "GatherBlockQuantized", "QGemm",
})


@dataclass(frozen=True)
class Quality:
    top1: float  # minimum argmax agreement with PyTorch, over the positions PyTorch has decided (below)
    kl: float  # maximum mean KL(PyTorch ‖ ONNX) per position, nats
    ppl_ratio: float  # maximum perplexity(ONNX) / perplexity(PyTorch) on held-out text
    # A position counts for top-1 only where PyTorch's top probability beats its runner-up by this
    # much: where the two are near-tied (an untrained model everywhere), which one wins is noise that
    # KL already weighs correctly, and gating on it would fail a faithful quantization at random.
    margin: float = 0.1


# quantization -> quality thresholds against the float32 PyTorch model. Weight-only int8 keeps a
# model's choices almost everywhere; int4 (block 32) costs more. Anything not listed (a graph found
# quantized without a declaration) gets the loosest row. One table, never adjusted inside a test.
QUALITY: dict[str, Quality] = {
    "int8": Quality(top1=0.95, kl=0.02, ppl_ratio=1.03),
    "int4": Quality(top1=0.85, kl=0.1, ppl_ratio=1.15),
}
LOOSEST = "int4"

# Held-out text for models with a tokenizer: not Python standard-library source (what the demo
# trains on) and not the benchmark prompts. A user passes their own with ``--text``.
HELD_OUT_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting one hundred and "
    "twelve steps before the lamp room opened onto the sea. In winter the glass fogged from the inside, "
    "and he wiped it with a cloth his daughter had sewn from an old sail.\n"
    "def moving_average(values, window):\n"
    "    total = sum(values[:window])\n"
    "    out = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        out.append(total / window)\n"
    "    return out\n"
)


def optimization_entry(out_dir: Path, manifest: Manifest) -> dict:
    """The manifest's ``optimization`` dict (role -> {...}), {} for a raw export.

    Read from the Manifest object when its class knows the field, else from manifest.json itself, so
    compare works with manifests written before and after the optimize stage existed.
    """
    opt = getattr(manifest, "optimization", None)
    if opt is None:
        path = Path(out_dir) / MANIFEST
        if path.is_file():
            try:
                opt = json.loads(path.read_text()).get("optimization")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                opt = None
    return opt if isinstance(opt, dict) else {}


def quantized_ops(path: Path) -> set[str]:
    """The quantized operator types in the ONNX graph at ``path`` (structure only, no weights)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return {n.op_type for n in proto.graph.node} & QUANTIZED_OPS


def quantization_name(value) -> str:
    """A record's ``quantization`` as a :data:`QUALITY` key: "none", "int4", "int8", ...

    exporter.optimize may write a name or a dict of its settings (``{"method": "matmulnbits",
    "bits": 4, "block_size": 32, ...}``); None and "" mean none.
    """
    if not value:
        return "none"
    if isinstance(value, dict):
        bits = value.get("bits")
        return f"int{bits}" if isinstance(bits, int) else str(value.get("method") or "unknown").lower()
    return str(value).lower()


def graph_quantization(out_dir: Path, manifest: Manifest) -> dict[str, str]:
    """role -> "none" | "int8" | "int4" | ... for every graph; undeclared quantized ops are named."""
    opt = optimization_entry(out_dir, manifest)
    result = {}
    for role, spec in manifest.graphs.items():
        entry = opt.get(role) if isinstance(opt.get(role), dict) else {}
        declared = quantization_name(entry.get("quantization"))
        path = Path(out_dir) / spec.file
        found = quantized_ops(path) if path.is_file() else set()
        if declared == "none" and found:
            declared = f"undeclared ({', '.join(sorted(found))})"
        result[role] = declared
    return result


def quality_for(quantization: str) -> Quality:
    return QUALITY.get(quantization, QUALITY[LOOSEST])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@dataclass(frozen=True)
class LogitsDistance:
    top1: float  # argmax agreement over all positions
    top1_decided: float | None  # over the positions where PyTorch is decided (None: there are none)
    decided: int  # how many positions those are
    kl: float  # mean KL(softmax(ref) ‖ softmax(got)), nats

    def ok(self, q: Quality) -> bool:
        return self.kl <= q.kl and (self.top1_decided is None or self.top1_decided >= q.top1)


def abs_error(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """|ref - got| elementwise (float64), where the same infinity on both sides is 0 (a DFlash draft
    vocabulary's -inf logits) and an infinity or a nan on one side only is inf."""
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    same = np.isinf(ref) & (ref == got)
    d = np.abs(np.where(same, 0.0, ref) - np.where(same, 0.0, got))
    d[np.isnan(d)] = np.inf
    return d


def sane(ref: np.ndarray, got: np.ndarray) -> bool:
    """``got`` is finite wherever ``ref`` is, and has ``ref``'s infinities elsewhere (never a nan)."""
    return bool((np.isfinite(got) | (np.isinf(ref) & (ref == got))).all())


def logits_distance(ref: np.ndarray, got: np.ndarray, margin: float = 0.1) -> LogitsDistance:
    """Distance of ``got`` from ``ref`` over all positions of (..., V) logits (see :class:`Quality`)."""
    lp, lq = _log_softmax(ref), _log_softmax(got)
    p = np.exp(lp)
    with np.errstate(invalid="ignore"):  # (-inf - -inf where both leave a token out: weight 0)
        kl = np.where(p > 0, p * (lp - lq), 0.0).sum(-1)  # (...,)
    agree = ref.argmax(-1) == got.argmax(-1)  # (...,)
    top2 = np.sort(p, axis=-1)[..., -2:]  # (..., 2): runner-up, top
    decided = (top2[..., 1] - top2[..., 0]) >= margin
    n = int(decided.sum())
    return LogitsDistance(top1=float(agree.mean()), top1_decided=float(agree[decided].mean()) if n else None,
                          decided=n, kl=float(kl.mean()))


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """exp(mean NLL) of ``ids[1:]`` under ``logits[:-1]``; logits (S, V), ids (S,)."""
    lp = _log_softmax(logits[:-1])
    nll = -lp[np.arange(len(ids) - 1), ids[1:]]
    return float(np.exp(nll.mean()))


@dataclass
class DistanceRow:
    """Held-out text scored teacher-forced by PyTorch and by the graph."""

    graph: str
    quantization: str
    text: str  # where the tokens came from
    tokens: int
    top1: float  # all positions
    top1_decided: float | None  # positions where PyTorch's top-1 leads by Quality.margin (None: none)
    decided: int
    mean_kl: float
    ppl_torch: float
    ppl_onnx: float
    ppl_ratio: float
    quality: dict
    ok: bool


def held_out_ids(out_dir: Path, manifest: Manifest, text: str | None, max_tokens: int, vocab: int,
                 seed: int = 0) -> tuple[np.ndarray, str]:
    """Token ids of held-out text (the export's tokenizer) or, without a tokenizer, random ids."""
    if manifest.tokenizer and (Path(out_dir) / manifest.tokenizer).is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(out_dir) / manifest.tokenizer))
        ids = np.array(tok.encode(text or HELD_OUT_TEXT).ids[:max_tokens], dtype=np.int64)
        what = "--text" if text else "built-in held-out text"
        if len(ids) >= 2:
            return ids, what
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=max_tokens, dtype=np.int64), "random token ids (no tokenizer)"


def distance_row(graph: str, quantization: str, what: str, ids: np.ndarray, ref_logits: np.ndarray,
                 got_logits: np.ndarray) -> DistanceRow:
    """``ref_logits``/``got_logits``: (S, V) for the S tokens of ``ids``."""
    q = quality_for(quantization)
    d = logits_distance(ref_logits, got_logits, q.margin)
    p_ref, p_got = perplexity(ref_logits, ids), perplexity(got_logits, ids)
    ratio = p_got / p_ref
    ok = bool(np.isfinite(got_logits).all()) and d.ok(q) and ratio <= q.ppl_ratio
    return DistanceRow(graph=graph, quantization=quantization, text=what, tokens=len(ids), top1=d.top1,
                       top1_decided=d.top1_decided, decided=d.decided, mean_kl=d.kl, ppl_torch=p_ref,
                       ppl_onnx=p_got, ppl_ratio=ratio, quality=asdict(q), ok=ok)
