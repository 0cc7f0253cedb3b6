"""The compare report: tolerances by dtype and device, one row per graph/case/output, the table.

Split from :mod:`exporter.compare` (which runs the cases); every name here is also importable from
there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from exporter.distance import DistanceRow, abs_error, quality_for, sane
from graphs import contract as C


@dataclass(frozen=True)
class Tolerance:
    atol: float  # an output passes if max|onnx - torch| <= atol + rtol * max|torch|
    rtol: float
    top1: float  # minimum fraction of positions whose logits argmax agrees


# (graph dtype, device) -> tolerance against the float32 PyTorch reference. One table, never
# adjusted inside a test.
TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("float32", "cpu"): Tolerance(atol=1e-4, rtol=1e-4, top1=0.99),
    ("float32", "cuda"): Tolerance(atol=1e-3, rtol=1e-3, top1=0.99),
    ("float16", "cpu"): Tolerance(atol=2e-2, rtol=2e-2, top1=0.9),
    ("float16", "cuda"): Tolerance(atol=2e-2, rtol=2e-2, top1=0.9),
    ("bfloat16", "cpu"): Tolerance(atol=1e-1, rtol=5e-2, top1=0.8),
    ("bfloat16", "cuda"): Tolerance(atol=1e-1, rtol=5e-2, top1=0.8),
}
# Outputs compared for agreement only: equal scores may come out in either order.
AGREEMENT_ONLY = {C.TOPK_IDS}
LOGITS_OUTPUTS = {C.LOGITS}


@dataclass
class Row:
    graph: str
    case: str
    output: str
    shape: list[int]
    max_abs: float
    max_rel: float
    where: list[int]
    torch_value: float
    onnx_value: float
    top1: float | None
    limit: float
    ok: bool
    # "parity": within TOLERANCES; "distance": logits of a quantized graph against QUALITY (top1, kl);
    # "info": another output of a quantized graph, reported, failing only when non-finite or
    # misshapen; "error": the case raised (``error`` says what), always a failure.
    check: str = "parity"
    kl: float | None = None  # mean KL(torch ‖ onnx) of logits, distance rows only
    top1_decided: float | None = None  # top-1 where torch's top-1 leads (distance rows; Quality.margin)
    error: str | None = None


def error_row(graph: str, case: str, exc: BaseException) -> Row:
    text = str(exc).strip().splitlines()
    msg = f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
    return Row(graph=graph, case=case, output="<error>", shape=[], max_abs=float("inf"), max_rel=float("inf"),
               where=[], torch_value=float("nan"), onnx_value=float("nan"), top1=None, limit=0.0, ok=False,
               check="error", error=msg)


@dataclass
class CompareReport:
    dtype: str
    device: str
    tolerance: dict  # the base graph's
    rows: list[Row] = field(default_factory=list)
    tolerances: dict = field(default_factory=dict)  # role -> tolerance (optimized graphs may differ)
    quantization: dict = field(default_factory=dict)  # role -> "none" | "int8" | "int4" | ...
    distance: list[DistanceRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows) and all(d.ok for d in self.distance)

    @property
    def quantized(self) -> list[str]:
        return [role for role, q in self.quantization.items() if q != "none"]

    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "dtype": self.dtype,
            "device": self.device,
            "tolerance": self.tolerance,
            "tolerances": self.tolerances,
            "quantization": self.quantization,
            "parity": not self.quantized,  # False: a quantized graph, compared by distance only
            "rows": [asdict(r) for r in self.rows],
            "distance": [asdict(d) for d in self.distance],
        }

    def summary_rows(self) -> list[Row]:
        """One row per graph/case/output kind: the K/V outputs of all layers folded into their worst."""
        worst: dict[tuple, Row] = {}
        for r in self.rows:
            name = r.output
            for prefix in ("present.", "cache_out."):
                if name.startswith(prefix):
                    name = prefix + "*"
            key = (r.graph, r.case, name)
            if key in worst and not worst[key].ok:
                continue  # a failure stays the row shown
            if key not in worst or (r.max_abs > worst[key].max_abs) or not r.ok:
                worst[key] = Row(**{**asdict(r), "output": name})
        return list(worst.values())

    def table(self, full: bool = False) -> str:
        head = f"{'graph':6} {'case':22} {'output':18} {'max_abs':>9} {'max_rel':>9} {'top1':>6}  where"
        lines = [head, "-" * len(head)]
        for r in self.rows if full else self.summary_rows():
            if r.check == "error":
                lines.append(f"{r.graph:6} {r.case:22} ERROR: {r.error}  FAIL (the case raised)")
                continue
            top1 = "" if r.top1 is None else f"{r.top1:.3f}"
            if r.check == "distance":
                q = quality_for(self.quantization.get(r.graph, "none"))
                decided = "n/a" if r.top1_decided is None else f"{r.top1_decided:.3f}"
                extra = f" kl={r.kl:.3g} top1_decided={decided}"
                mark = "" if r.ok else f"  FAIL (quality: top1_decided>={q.top1:g}, kl<={q.kl:g})"
            else:
                why = "quantized" if self.quantization.get(r.graph, "none") != "none" else "reduced-precision tree"
                extra = f" (not gated: {why})" if r.check == "info" else ""
                mark = "" if r.ok else f"  FAIL (limit {r.limit:.2e})"
            lines.append(
                f"{r.graph:6} {r.case:22} {r.output:18} {r.max_abs:9.2e} {r.max_rel:9.2e} {top1:>6}  "
                f"{tuple(r.where)} torch={r.torch_value:.5g} onnx={r.onnx_value:.5g}{extra}{mark}"
            )
        if self.distance:
            lines.append("held-out text, teacher-forced (distance from PyTorch):")
            for d in self.distance:
                q = d.quality
                mark = "" if d.ok else (f"  FAIL (quality: top1_decided>={q['top1']:g}, kl<={q['kl']:g}, "
                                        f"ppl ratio<={q['ppl_ratio']:g})")
                decided = "n/a" if d.top1_decided is None else f"{d.top1_decided:.3f}"
                lines.append(f"  {d.graph} [{d.quantization}] {d.tokens} tokens of {d.text}: top1 {d.top1:.3f} "
                             f"(decided positions: {decided} of {d.decided}), "
                             f"mean KL {d.mean_kl:.3g}, perplexity {d.ppl_onnx:.4g} vs PyTorch {d.ppl_torch:.4g} "
                             f"(x{d.ppl_ratio:.3f}){mark}")
        n_bad = len(self.failures()) + sum(not d.ok for d in self.distance)
        verdict = "PASS" if self.ok else f"FAIL: {n_bad} output(s) over tolerance or failed"
        tol = (f"atol={self.tolerance['atol']:g}, rtol={self.tolerance['rtol']:g}, "
               f"top1>={self.tolerance['top1']:g}")
        if self.quantized:
            kinds = ", ".join(f"{role} {self.quantization[role]}" for role in self.quantized)
            lines.append(f"{verdict} (distance, not bit-parity: quantized graphs ({kinds}) are a different model, "
                         f"their logits judged by top-1 agreement and mean KL against exporter.distance.QUALITY, "
                         f"other outputs reported only; float graphs {self.dtype} on {self.device}, {tol})")
        else:
            lines.append(f"{verdict} ({self.dtype} on {self.device}, {tol})")
        return "\n".join(lines)


def compare_arrays(ref: np.ndarray, got: np.ndarray, tol: Tolerance, name: str) -> dict:
    """Errors of ``got`` against ``ref``: max abs/rel error, its index and the values there."""
    ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
    if ref.shape != got.shape:
        return dict(max_abs=float("inf"), max_rel=float("inf"), where=[], torch_value=float("nan"),
                    onnx_value=float("nan"), top1=None, limit=0.0, ok=False)
    if ref.size == 0:
        return dict(max_abs=0.0, max_rel=0.0, where=[], torch_value=0.0, onnx_value=0.0, top1=None,
                    limit=0.0, ok=True)
    if name in AGREEMENT_ONLY:
        agree = float((ref == got).mean())
        return dict(max_abs=float(np.abs(ref64 - got64).max()), max_rel=0.0, where=[], torch_value=0.0,
                    onnx_value=0.0, top1=agree, limit=0.0, ok=True)
    diff = abs_error(ref64, got64)
    idx = np.unravel_index(int(np.argmax(diff)), diff.shape)
    finite = np.abs(np.where(np.isfinite(ref64), ref64, 0.0))
    with np.errstate(invalid="ignore"):
        rel = np.nan_to_num(diff / np.maximum(finite, tol.atol), nan=np.inf)
    limit = tol.atol + tol.rtol * float(finite.max())
    top1 = None
    ok = bool(diff.max() <= limit) and sane(ref64, got64)
    if name in LOGITS_OUTPUTS:
        top1 = float((ref64.argmax(-1) == got64.argmax(-1)).mean())
        ok = ok and top1 >= tol.top1
    return dict(max_abs=float(diff.max()), max_rel=float(rel.max()), where=[int(i) for i in idx],
                torch_value=float(ref64[idx]), onnx_value=float(got64[idx]), top1=top1, limit=limit, ok=ok)
