"""PyTorch vs ONNX Runtime: where the exported graphs differ from the model, and by how much.

    python -m exporter.compare model_dir out_dir [--json report.json] [--provider cpu]

Runs the float32 PyTorch model and the exported graphs on the same inputs and reports, per graph,
case and output: max absolute error, max relative error, the index where the largest error
occurs (with both values there) and top-1 agreement of logits. Cases cover prefill with no past,
a one-token decode, tree verification with a non-causal tree mask at batch 2 with a past, a
batch with holes in the past (sequences of different lengths), and the draft graph's step. Exits
non-zero when an output exceeds the tolerance for its dtype and device (:data:`TOLERANCES`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

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


@dataclass
class CompareReport:
    dtype: str
    device: str
    tolerance: dict
    rows: list[Row] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "dtype": self.dtype,
            "device": self.device,
            "tolerance": self.tolerance,
            "rows": [asdict(r) for r in self.rows],
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
            if key not in worst or (r.max_abs > worst[key].max_abs) or not r.ok:
                worst[key] = Row(**{**asdict(r), "output": name})
        return list(worst.values())

    def table(self, full: bool = False) -> str:
        head = f"{'graph':6} {'case':22} {'output':18} {'max_abs':>9} {'max_rel':>9} {'top1':>6}  where"
        lines = [head, "-" * len(head)]
        for r in self.rows if full else self.summary_rows():
            top1 = "" if r.top1 is None else f"{r.top1:.3f}"
            mark = "" if r.ok else f"  FAIL (limit {r.limit:.2e})"
            lines.append(
                f"{r.graph:6} {r.case:22} {r.output:18} {r.max_abs:9.2e} {r.max_rel:9.2e} {top1:>6}  "
                f"{tuple(r.where)} torch={r.torch_value:.5g} onnx={r.onnx_value:.5g}{mark}"
            )
        verdict = "PASS" if self.ok else f"FAIL: {len(self.failures())} output(s) over tolerance"
        lines.append(f"{verdict} ({self.dtype} on {self.device}, atol={self.tolerance['atol']:g}, "
                     f"rtol={self.tolerance['rtol']:g}, top1>={self.tolerance['top1']:g})")
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


def compare_model(model, out_dir, provider: str = "cpu", manifest: Manifest | None = None) -> CompareReport:
    """Compare every exported graph in ``out_dir`` with ``model`` (float32 PyTorch)."""
    from graphs.sessions import make_session

    out_dir = Path(out_dir)
    manifest = manifest or Manifest.read(out_dir)
    specs = manifest.graphs
    dtype = specs["base"].output(C.LOGITS).dtype
    _check_same_model(model, specs, dtype, out_dir)
    device = "cuda" if provider == "cuda" else "cpu"
    tol = TOLERANCES[(dtype, device)]
    report = CompareReport(dtype=dtype, device=device, tolerance=asdict(tol))
    for role in specs:
        session = _session(make_session, out_dir / specs[role].file, provider, dtype)
        if role.startswith(C.TREE_ROLE_PREFIX):  # the one-call EAGLE tree (exporter.eagle_tree)
            from exporter.eagle_tree import tree_cases

            cases = tree_cases(model, specs[role])
        elif role not in ("base", "draft"):  # built graphs (K/V update): checked against numpy
            report.rows += kv_update_rows(role, session, specs[role], tol)
            del session
            continue
        else:
            cases = base_cases(model, specs["base"]) if role == "base" else draft_cases(model, specs)
        module = graph_module(model, role)
        for case, inputs in cases:
            with torch.no_grad():
                ref = [t.numpy() for t in module(*inputs)]
            got = run_case(session, specs[role], inputs)
            for spec_out, r, o in zip(specs[role].outputs, ref, got):
                report.rows.append(Row(graph=role, case=case, output=spec_out.name, shape=list(o.shape),
                                       **compare_arrays(r, o, tol, spec_out.name)))
        del session  # one graph's weights in memory at a time
    return report


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
    baked = [r for r in specs if r.startswith(C.TREE_ROLE_PREFIX)]  # one-call EAGLE trees, as exported
    if baked and getattr(model, "spec_mode", None) == "eagle":
        from exporter.eagle_tree import tree_graph_specs

        want |= tree_graph_specs(model, dtype, [tuple(map(int, r.split(".")[1].split("-"))) for r in baked])
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


def compare(model_dir, out_dir, provider: str = "cpu", drafter=None) -> CompareReport:
    """Load the PyTorch model from ``model_dir`` and compare it with the export in ``out_dir``."""
    from exporter.loading import load_model

    return compare_model(load_model(model_dir, drafter=drafter), out_dir, provider=provider)


def _main_e2e(args) -> int:
    import graphs
    from exporter import e2e
    from exporter.loading import load_model

    model = load_model(args.model_dir, drafter=args.drafter)
    decoder = graphs.load(args.out_dir, provider=args.provider)
    prompts = args.prompt or e2e.default_prompts(decoder)
    rows = e2e.compare_tokens(model, decoder, prompts, max_new_tokens=args.max_new_tokens)
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
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_intermixed_args(argv)

    def body():
        if args.e2e:
            return _main_e2e(args)
        report = compare(args.model_dir, args.out_dir, provider=args.provider, drafter=args.drafter)
        print(report.table())
        if args.json:
            Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
        return 0 if report.ok else 1

    return run_cli(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
