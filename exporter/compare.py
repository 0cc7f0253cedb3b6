"""PyTorch vs ONNX Runtime: where the exported graphs differ from the model, and by how much.

    python -m exporter.compare model_dir out_dir [--json report.json] [--provider cpu] [--text FILE]

Runs the float32 PyTorch model and the exported graphs on the same inputs and reports, per graph,
case and output: max absolute error, max relative error, the index where the largest error
occurs (with both values there) and top-1 agreement of logits. Two references:

- the traced wrappers (:mod:`exporter.trace`), for what only they can run: prefill, a one-token
  decode, tree verification with a non-causal tree mask at batch 2 with a past, a batch with holes
  in the past, and the draft graph's steps;
- Hugging Face's own forward with its own cache (:mod:`exporter.hf_reference`, none of the
  exporter's modelling code), for the causal cases ``hf_*``: prefill, one-token steps and a chunk
  over a past, EAGLE-3 auxiliary states against ``output_hidden_states`` at the configured layers.
  A bug in the traced code is in the graph *and* the first reference; it cannot hide from this one.

A case that raises (in ONNX Runtime or in a reference) is a failed row, never a skipped one. Exits
non-zero when an output exceeds the tolerance for its dtype and device (:data:`TOLERANCES`).

A quantized graph (the manifest's ``optimization`` entry, or quantized operators found in it) is a
different model: its logits are judged by top-1 agreement and mean KL against quality thresholds
(:data:`exporter.distance.QUALITY`), held-out text is scored by both models (top-1, KL,
perplexity), and the report says it is a distance, not bit-parity (``--distance`` adds the
held-out rows for float graphs too).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from exporter.distance import (
    DistanceRow,
    distance_row,
    graph_quantization,
    held_out_ids,
    logits_distance,
    optimization_entry,
    quality_for,
)
from exporter.hf_reference import causal_bool_mask, hf_base_cases
from exporter.loading import UserError
from exporter.trace import flatten_kv, graph_module
from graphs import contract as C
from graphs.manifest import Manifest
from graphs.trees import Tree


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
_AGREEMENT_ONLY = {C.TOPK_IDS}
_LOGITS = {C.LOGITS}


class UnsupportedProviderError(UserError):
    """ONNX Runtime has no kernel for this graph on this provider (e.g. bfloat16 ops on the CPU EP)."""


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
                extra = " (not gated: quantized)" if r.check == "info" else ""
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
            lines.append(f"{verdict} (distance, not bit-parity: quantized {kinds} is a different model, its logits "
                         f"judged by top-1 agreement and mean KL against exporter.distance.QUALITY; other outputs "
                         f"reported only; float graphs {self.dtype} on {self.device}, {tol})")
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
    if name in _AGREEMENT_ONLY:
        agree = float((ref == got).mean())
        return dict(max_abs=float(np.abs(ref64 - got64).max()), max_rel=0.0, where=[], torch_value=0.0,
                    onnx_value=0.0, top1=agree, limit=0.0, ok=True)
    diff = np.abs(ref64 - got64)
    idx = np.unravel_index(int(np.argmax(diff)), diff.shape)
    rel = diff / np.maximum(np.abs(ref64), tol.atol)
    limit = tol.atol + tol.rtol * float(np.abs(ref64).max())
    top1 = None
    ok = bool(diff.max() <= limit) and bool(np.isfinite(got64).all())
    if name in _LOGITS:
        top1 = float((ref64.argmax(-1) == got64.argmax(-1)).mean())
        ok = ok and top1 >= tol.top1
    return dict(max_abs=float(diff.max()), max_rel=float(rel.max()), where=[int(i) for i in idx],
                torch_value=float(ref64[idx]), onnx_value=float(got64[idx]), top1=top1, limit=limit, ok=ok)


# ----------------------------------------------------------------------------- cases


def tree_mask(parents: list[int]) -> torch.Tensor:
    """(T, T) bool ancestor-or-self mask of a tree given by parent indices (-1 = root)."""
    return torch.from_numpy(Tree.from_parents(np.array(parents)).mask)


def _depths(parents: list[int]) -> torch.Tensor:
    return torch.from_numpy(Tree.from_parents(np.array(parents)).depth)


def _empty_past(n_layers, b, kv, hd):
    return [(torch.zeros(b, kv, 0, hd), torch.zeros(b, kv, 0, hd)) for _ in range(n_layers)]


def base_cases(model, spec: C.GraphSpec, seed: int = 0) -> list[tuple[str, list[torch.Tensor]]]:
    """(name, inputs in spec order) for the base graph; pasts are real K/V from a prefix run."""
    g = torch.Generator().manual_seed(seed)
    vocab = spec.output(C.LOGITS).dims[-1]
    k0 = spec.input(C.past_key(0))
    kv, hd = k0.dims[1], k0.dims[3]
    n_layers = sum(1 for t in spec.inputs if t.name.endswith(".key"))
    base = graph_module(model, "base")

    def ids(b, s):
        return torch.randint(0, vocab, (b, s), generator=g)

    p = 6
    prefix = ids(2, p)
    causal = tree_mask(list(range(-1, p - 1)))
    with torch.no_grad():
        empty = flatten_kv(_empty_past(n_layers, 2, kv, hd))
        out = base(prefix, torch.arange(p).expand(2, p), causal.expand(2, 1, p, p), *empty)
    new = out[-2 * n_layers :]
    past = [(new[2 * i], new[2 * i + 1]) for i in range(n_layers)]

    cases = []
    s = 7
    cases.append(("prefill", [ids(1, s), torch.arange(s)[None], tree_mask(list(range(-1, s - 1)))[None, None],
                              *flatten_kv(_empty_past(n_layers, 1, kv, hd))]))
    cases.append(("decode", [ids(1, 1), torch.tensor([[p]]), torch.ones(1, 1, 1, p + 1, dtype=torch.bool),
                             *flatten_kv([(k[:1], v[:1]) for k, v in past])]))
    parents = [-1, 0, 0, 1, 1, 2]  # a non-causal tree: siblings never see each other
    tm = tree_mask(parents)
    t = len(parents)
    mask = torch.cat([torch.ones(t, p, dtype=torch.bool), tm], dim=1).expand(2, 1, t, p + t)
    cases.append(("tree_b2_past6", [ids(2, t), (p + _depths(parents)).expand(2, t), mask.contiguous(),
                                    *flatten_kv(past)]))
    # sequence 1 is 2 tokens shorter: its last two past columns are holes it must not see
    s = 3
    m = torch.cat([torch.ones(2, s, p, dtype=torch.bool), tree_mask([-1, 0, 1]).expand(2, s, s)], dim=2)
    m[1, :, p - 2 : p] = False
    pos = torch.stack([torch.arange(p, p + s), torch.arange(p - 2, p - 2 + s)])
    cases.append(("batch2_holes", [ids(2, s), pos, m[:, None].contiguous(), *flatten_kv(past)]))
    return cases


def draft_cases(model, specs, seed: int = 0) -> list[tuple[str, list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed + 1)
    base_spec = specs["base"]
    topk = torch.tensor([4])
    _, base_inputs = base_cases(model, base_spec, seed)[2]  # the tree case
    with torch.no_grad():
        base_out = graph_module(model, "base")(*base_inputs)
    hidden = base_out[1]
    if model.spec_mode == "medusa":
        return [("heads_b2_tree", [hidden, topk])]

    mod = model.eagle_module
    n_layers = len(mod.layers)
    kv, hd = mod.num_kv_heads, mod.head_dim
    draft = graph_module(model, "draft")
    vocab = base_spec.output(C.LOGITS).dims[-1]
    eagle3 = mod.eagle3
    aux = base_out[2] if eagle3 else None
    p = 5

    def run(hid, aux_h, ids, pos, mask, past):
        args = [hid] + ([aux_h] if eagle3 else []) + [ids, pos, mask, *flatten_kv(past), topk]
        return args, draft(*args)

    h = hidden.shape[-1]
    empty_h = hidden[:, :0]
    # context: the first p positions with base features and the next tokens
    ids_ctx = torch.randint(0, vocab, (2, p), generator=g)
    causal = tree_mask(list(range(-1, p - 1))).expand(2, 1, p, p)
    pos = torch.arange(p).expand(2, p)
    if eagle3:
        args_ctx, out = run(empty_h, aux[:, :p], ids_ctx, pos, causal, _empty_past(n_layers, 2, kv, hd))
    else:
        args_ctx, out = run(hidden[:, :p], None, ids_ctx, pos, causal, _empty_past(n_layers, 2, kv, hd))
    cases = [("context_b2", args_ctx)]
    new = out[4:]
    past = [(new[2 * i], new[2 * i + 1]) for i in range(n_layers)]
    # a drafted tree level: the drafter's own hidden states, non-causal tree mask over its past
    parents = [-1, 0, 0, 1]
    t = len(parents)
    mask = torch.cat([torch.ones(t, p, dtype=torch.bool), tree_mask(parents)], dim=1).expand(2, 1, t, p + t)
    own = torch.randn(2, t, h, generator=g) * float(out[0].detach().std())
    ids_tree = torch.randint(0, vocab, (2, t), generator=g)
    args_tree, _ = run(own, aux[:, :0] if eagle3 else None, ids_tree, (p + _depths(parents)).expand(2, t),
                       mask.contiguous(), past)
    cases.append(("tree_b2_past5", args_tree))
    return cases


# ----------------------------------------------------------------------------- driver


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def run_case(session, spec: C.GraphSpec, inputs: list[torch.Tensor]) -> list[np.ndarray]:
    feed = {}
    for t, x in zip(spec.inputs, inputs):
        arr = x.detach().cpu().numpy()
        feed[t.name] = arr.astype(_np_dtype(t.dtype)) if arr.dtype.kind == "f" else arr
    return session.run(spec.output_names, feed)


def compare_model(model, out_dir, provider: str = "cpu", manifest: Manifest | None = None, *,
                  text: str | None = None, distance: bool = False, text_tokens: int = 128) -> CompareReport:
    """Compare every exported graph in ``out_dir`` with ``model`` (float32 PyTorch).

    ``text``: held-out text for the distance rows (default: a built-in paragraph); they are computed
    for quantized base graphs, and for float ones too when ``distance`` is set.
    """
    from graphs.sessions import make_session

    out_dir = Path(out_dir)
    manifest = manifest or Manifest.read(out_dir)
    specs = manifest.graphs
    dtype = specs["base"].output(C.LOGITS).dtype
    _check_same_model(model, specs, dtype, out_dir)
    device = "cuda" if provider == "cuda" else "cpu"
    opt = optimization_entry(out_dir, manifest)
    tols = {role: TOLERANCES[(_role_dtype(opt.get(role), spec), device)] for role, spec in specs.items()}
    quant = graph_quantization(out_dir, manifest)
    report = CompareReport(dtype=dtype, device=device, tolerance=asdict(tols["base"]),
                           tolerances={role: asdict(t) for role, t in tols.items()}, quantization=quant)
    for role in specs:
        spec, tol = specs[role], tols[role]
        session = _session(make_session, out_dir / spec.file, provider, dtype)
        if role not in ("base", "draft"):  # built graphs (K/V update): checked against numpy
            report.rows += kv_update_rows(role, session, spec, tol)
            del session
            continue
        try:
            cases = base_cases(model, specs["base"]) if role == "base" else draft_cases(model, specs)
        except Exception as e:  # the reference itself failed: a failure, never a skip
            report.rows.append(error_row(role, "traced_reference", e))
            cases = []
        module = graph_module(model, role)
        for case, inputs in cases:
            try:
                with torch.no_grad():
                    ref = [t.numpy() for t in module(*inputs)]
                got = run_case(session, spec, inputs)
            except Exception as e:
                report.rows.append(error_row(role, case, e))
                continue
            report.rows += output_rows(role, case, spec, dict(zip(spec.output_names, ref)),
                                       dict(zip(spec.output_names, got)), tol, quant[role])
        if role == "base":
            report.rows += hf_rows(model, session, spec, tol, quant[role])
            if distance or quant[role] != "none":
                try:
                    report.distance.append(held_out_row(model, session, spec, out_dir, manifest, quant[role],
                                                        text, text_tokens))
                except Exception as e:
                    report.rows.append(error_row(role, "held_out_text", e))
        del session  # one graph's weights in memory at a time
    return report


def _role_dtype(entry, spec: C.GraphSpec) -> str:
    """The precision a graph computes in: the optimize stage's record (float16 inside float32 I/O is
    possible), else the dtype of its first floating-point output."""
    declared = entry.get("dtype") if isinstance(entry, dict) else None
    if declared in {d for d, _ in TOLERANCES}:
        return declared
    return next((t.dtype for t in spec.outputs if t.dtype.startswith(("float", "bfloat"))), "float32")


def output_rows(role: str, case: str, spec: C.GraphSpec, ref: dict[str, np.ndarray], got: dict[str, np.ndarray],
                tol: Tolerance, quantization: str = "none") -> list[Row]:
    """Rows for the outputs named in ``ref`` (in contract order): parity, or distance if quantized."""
    rows = []
    for name in [n for n in spec.output_names if n in ref]:
        if name not in got:
            rows.append(error_row(role, case, KeyError(f"the graph has no output {name}")))
            continue
        r, o = ref[name], got[name]
        fields = compare_arrays(r, o, tol, name)
        if quantization != "none" and fields["max_abs"] != float("inf"):
            finite = bool(np.isfinite(o.astype(np.float64)).all())
            if name in _LOGITS:
                q = quality_for(quantization)
                d = logits_distance(r, o, q.margin)
                fields.update(top1=d.top1, limit=q.kl, ok=finite and d.ok(q), check="distance", kl=d.kl,
                              top1_decided=d.top1_decided)
            else:
                fields.update(ok=finite, check="info")
        rows.append(Row(graph=role, case=case, output=name, shape=list(o.shape), **fields))
    return rows


def hf_rows(model, session, spec: C.GraphSpec, tol: Tolerance, quantization: str = "none") -> list[Row]:
    """The base graph against HF's own forward and cache (exporter.hf_reference): causal cases."""
    try:
        cases = hf_base_cases(model, spec)
    except Exception as e:
        return [error_row("base", "hf_reference", e)]
    rows = []
    for c in cases:
        try:
            got = dict(zip(spec.output_names, run_case(session, spec, c.inputs)))
        except Exception as e:
            rows.append(error_row("base", c.name, e))
            continue
        rows += output_rows("base", c.name, spec, c.ref, got, tol, quantization)
    return rows


def held_out_row(model, session, spec: C.GraphSpec, out_dir: Path, manifest: Manifest, quantization: str,
                 text: str | None, max_tokens: int) -> DistanceRow:
    """Held-out text teacher-forced through HF's own forward and the base graph (one prefill each)."""
    vocab = spec.output(C.LOGITS).dims[-1]
    ids, what = held_out_ids(out_dir, manifest, text, max_tokens, vocab)
    ids_t = torch.from_numpy(ids)[None]  # (1, S)
    s = ids_t.shape[1]
    with torch.no_grad():
        ref = model(ids_t).logits[0].float().numpy()  # (S, V)
    k0 = spec.input(C.past_key(0))
    n_layers = sum(1 for t in spec.inputs if t.name.endswith(".key"))
    empty = [torch.zeros(1, k0.dims[1], 0, k0.dims[3]) for _ in range(2 * n_layers)]
    got = run_case(session, spec, [ids_t, torch.arange(s)[None], causal_bool_mask(1, s, 0), *empty])[0][0]
    return distance_row("base", quantization, what, ids, ref, got.astype(np.float32))


def kv_update_rows(role: str, session, spec: C.GraphSpec, tol: Tolerance) -> list[Row]:
    """Run the K/V update graph on random buffers (batch 2, holes) against the numpy reference."""
    rng = np.random.default_rng(0)
    n = sum(1 for t in spec.inputs if t.name.startswith("cache."))
    kv, hd = spec.inputs[0].dims[1], spec.inputs[0].dims[3]
    dt = _np_dtype(spec.inputs[0].dtype)
    caches = [rng.standard_normal((2, kv, 12, hd)).astype(dt) for _ in range(n)]
    new = [rng.standard_normal((2, kv, 5, hd)).astype(dt) for _ in range(n)]
    idx, start = np.array([[0, 3, 4], [2, 0, 0]]), 6
    feed = {C.cache_in(j): caches[j] for j in range(n)} | {C.cache_new(j): new[j] for j in range(n)}
    got = session.run(spec.output_names, feed | {C.ACCEPT_INDEX: idx, C.WRITE_START: np.array([start])})
    rows = []
    for j in range(n):
        want = caches[j].copy()
        want[:, :, start : start + 3] = np.take_along_axis(new[j], idx[:, None, :, None], axis=2)
        rows.append(Row(graph=role, case="write_b2_holes", output=spec.output_names[j], shape=list(got[j].shape),
                        **compare_arrays(want.astype(np.float32), got[j].astype(np.float32), tol, "")))
    return rows


def _check_same_model(model, specs: dict[str, C.GraphSpec], dtype: str, out_dir: Path) -> None:
    """The graphs in ``out_dir`` must have the contract this model exports to (same sizes, same drafter)."""
    from exporter.trace import graph_specs

    want = graph_specs(model, dtype)
    if set(want) != set(specs):
        kind = getattr(model, "spec_mode", None) or "no drafter"
        raise UserError(
            f"{out_dir} holds graphs {sorted(specs)} but this model ({kind}) exports to {sorted(want)}: "
            f"compare it with the model_dir (and --drafter) it was exported from"
        )
    for role, spec in want.items():
        if spec.to_json() != specs[role].to_json():
            raise UserError(
                f"the {role} graph in {out_dir} does not have this model's inputs/outputs (other sizes or "
                f"drafter): compare it with the model_dir (and --drafter) it was exported from"
            )


def _session(make_session, path: Path, provider: str, dtype: str):
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as OrtNotImplemented

    try:
        return make_session(path, provider=provider)
    except OrtNotImplemented as e:
        detail = str(e).split(" : ")[-1].strip()
        raise UnsupportedProviderError(
            f"ONNX Runtime's {provider} provider cannot run the {dtype} graph {path.name} ({detail}); "
            f"compare it on a provider with {dtype} kernels (e.g. --provider cuda)"
        ) from None


def compare(model_dir, out_dir, provider: str = "cpu", drafter=None, text: str | None = None,
            distance: bool = False) -> CompareReport:
    """Load the PyTorch model from ``model_dir`` and compare it with the export in ``out_dir``."""
    from exporter.loading import load_model

    manifest = Manifest.read(out_dir)  # bad out_dir: one line before the model loads
    return compare_model(load_model(model_dir, drafter=drafter), out_dir, provider=provider, manifest=manifest,
                         text=text, distance=distance)


def _read_text(path: str | None) -> str | None:
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--text {p} is not a file; pass a UTF-8 text file of held-out text")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--text {p} is not UTF-8 text ({e.reason} at byte {e.start}); pass a UTF-8 file") from None
    if not text.strip():
        raise UserError(f"--text {p} is empty; pass a file with at least two tokens of held-out text")
    return text


def _main_e2e(args) -> int:
    import graphs
    from exporter import e2e
    from exporter.loading import load_model

    e2e.check_prompts(args.prompt)  # before anything loads
    model = load_model(args.model_dir, drafter=args.drafter)
    decoder = graphs.load(args.out_dir, provider=args.provider)
    prompts = args.prompt or e2e.default_prompts(decoder)
    quant = graph_quantization(Path(args.out_dir), decoder.manifest)
    rows = e2e.compare_tokens(model, decoder, prompts, max_new_tokens=args.max_new_tokens,
                              quantized=quant.get("base", "none") != "none")
    print(e2e.table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(e2e.to_json(rows), indent=2) + "\n")
    return 0 if all(r.ok for r in rows) else 1


def main(argv=None) -> int:
    from exporter.cli import ArgumentParser, run_cli

    ap = ArgumentParser(prog="python -m exporter.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="the model directory that was exported")
    ap.add_argument("out_dir", help="the export directory (holds manifest.json)")
    ap.add_argument("--drafter", help="the drafter file passed to export, if any")
    ap.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", help="also write the report as JSON to this file")
    ap.add_argument("--e2e", action="store_true",
                    help="end to end: greedy tokens of PyTorch vs the runtime (speculative and autoregressive)")
    ap.add_argument("--prompt", action="append", help="prompt for --e2e (repeatable; default: built-in prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per prompt for --e2e")
    ap.add_argument("--text", help="held-out text file for the distance rows (quantized graphs; default: built-in)")
    ap.add_argument("--distance", action="store_true",
                    help="also score held-out text for float graphs (top-1, mean KL, perplexity vs PyTorch)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_intermixed_args(argv)

    def body():
        if args.e2e:
            return _main_e2e(args)
        report = compare(args.model_dir, args.out_dir, provider=args.provider, drafter=args.drafter,
                         text=_read_text(args.text), distance=args.distance)
        print(report.table())
        if args.json:
            Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
        return 0 if report.ok else 1

    return run_cli(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
