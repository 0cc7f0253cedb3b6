"""The validate stage: PyTorch vs ONNX Runtime, where the exported graphs differ and by how much.

    validate_export(model, tmp, manifest, plan)   export's gate: raises UserError when a graph disagrees
    compare_model(model, out_dir)                 the report (``python -m exporter.compare``)

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

A case that raises (in ONNX Runtime or in a reference) is a failed row, never a skipped one. The
tolerances are one table by dtype and device (:data:`exporter.compare_report.TOLERANCES`).

A quantized graph (the manifest's ``optimization`` entry, or quantized operators found in it) is a
different model: its logits are judged by top-1 agreement and mean KL against quality thresholds
(:data:`exporter.distance.QUALITY`), held-out text is scored by both models (top-1, KL,
perplexity), and the report says it is a distance, not bit-parity (``distance=True`` adds the
held-out rows for float graphs too).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from exporter.compare_report import (
    LOGITS_OUTPUTS,
    TOLERANCES,
    CompareReport,
    Row,
    Tolerance,
    compare_arrays,
    error_row,
)
from exporter.distance import (
    DistanceRow,
    distance_row,
    graph_quantization,
    held_out_ids,
    logits_distance,
    optimization_entry,
    quality_for,
    sane,
)
from exporter.errors import UserError
from exporter.hf_reference import causal_bool_mask, hf_base_cases
from exporter.passes.parity import as_inplace_dflash_feed, dflash_feeds
from exporter.plan import build_plan, is_traced, is_tree_role, parse_tree_role
from exporter.trace import flatten_kv, graph_module
from graphs import contract as C
from graphs.manifest import Manifest
from graphs.trees import Tree


class UnsupportedProviderError(UserError):
    """ONNX Runtime has no kernel for this graph on this provider (e.g. bfloat16 ops on the CPU EP)."""


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
    if model.spec_mode == "dflash":
        return dflash_cases(model, base_spec, g)

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


def dflash_cases(model, base_spec: C.GraphSpec, g: torch.Generator) -> list[tuple[str, list[torch.Tensor]]]:
    """The DFlash draft graph at batch 2: a first call (no cache; sequence 1 has 2 context rows fewer,
    masked) and a second over that cache (P = 5, sequence 1's last two cached columns holes), each with
    A new context rows (the base's own target-layer features) and a block [anchor, mask x (b-1)].
    The calls are :func:`exporter.passes.parity.dflash_feeds` (the optimize gate runs the same ones),
    fed here by the PyTorch base and drafter."""
    dm = model.dflash_module
    b, mask_id = dm.block_size, dm.mask_token_id
    vocab = base_spec.output(C.LOGITS).dims[-1]
    n = 7  # base positions whose features feed the two calls (5, then 2)
    ids = torch.randint(0, vocab, (2, n), generator=g)
    empty = flatten_kv(_empty_past(sum(1 for t in base_spec.inputs if t.name.endswith(".key")), 2,
                                   base_spec.input(C.past_key(0)).dims[1], base_spec.input(C.past_key(0)).dims[3]))
    with torch.no_grad():
        aux = graph_module(model, "base")(ids, torch.arange(n).expand(2, n), tree_mask(list(range(-1, n - 1)))
                                          .expand(2, 1, n, n), *empty)[2]  # (2, n, n_aux*H)
    draft = graph_module(model, "draft")

    def first_presents(feed):
        with torch.no_grad():
            return [t.numpy() for t in draft(*map(torch.from_numpy, feed.values()))[3:]]

    empty_draft = [x.numpy() for x in flatten_kv(_empty_past(len(dm.layers), 2, dm.num_kv_heads, dm.head_dim))]
    feeds = dflash_feeds(aux.numpy(), empty_draft, block_size=b, mask_token_id=mask_id, vocab=vocab,
                         first_presents=first_presents,
                         randint=lambda high, shape: torch.randint(0, high, shape, generator=g).numpy())
    return [(name, [torch.from_numpy(x) for x in feed.values()]) for name, feed in feeds]


# ----------------------------------------------------------------------------- driver


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def run_case(session, spec: C.GraphSpec, inputs: list[torch.Tensor]) -> list[np.ndarray]:
    """Run ``session`` on ``inputs`` given in the order of the concat contract's inputs; a base that
    writes K/V in place (optimized) gets them as its buffers (:func:`graphs.kv.as_inplace_feed`) and
    its ``present.*`` come back as the S new rows, so every case means the same for both layouts."""
    feed = {}
    for t, x in zip(spec.inputs, inputs):
        arr = x.detach().cpu().numpy()
        feed[t.name] = arr.astype(_np_dtype(t.dtype)) if arr.dtype.kind == "f" else arr
    if not C.kv_in_place(spec):
        return session.run(spec.output_names, feed)
    from graphs.kv import as_inplace_feed

    feed, cut = (as_inplace_dflash_feed if C.CONTEXT_POSITION_IDS in spec.input_names else as_inplace_feed)(feed, spec)
    out = cut(dict(zip(spec.output_names, session.run(spec.output_names, feed))))
    return [out[n] for n in spec.output_names]


def compare_model(model, out_dir, provider: str = "cpu", manifest: Manifest | None = None, *,
                  text: str | None = None, distance: bool = False, text_tokens: int = 128,
                  plan=None) -> CompareReport:
    """Compare every exported graph in ``out_dir`` with ``model`` (float32 PyTorch).

    ``text``: held-out text for the distance rows (default: a built-in paragraph); they are computed
    for quantized base graphs, and for float ones too when ``distance`` is set. ``plan``: the
    :class:`~exporter.plan.ExportPlan` the graphs were traced from (export's own check); without it
    the model's plan is built here and must match the manifest's graphs.
    """
    from graphs.sessions import make_session

    out_dir = Path(out_dir)
    manifest = manifest or Manifest.read(out_dir)
    specs = manifest.graphs
    dtype = specs["base"].output(C.LOGITS).dtype
    if plan is None:
        check_same_model(model, specs, dtype, out_dir)
    device = "cuda" if provider == "cuda" else "cpu"
    opt = optimization_entry(out_dir, manifest)
    tols = {role: TOLERANCES[(_role_dtype(opt.get(role), spec), device)] for role, spec in specs.items()}
    quant = graph_quantization(out_dir, manifest)
    report = CompareReport(dtype=dtype, device=device, tolerance=asdict(tols["base"]),
                           tolerances={role: asdict(t) for role, t in tols.items()}, quantization=quant)
    src = manifest.source
    # the cases are built for the traced contract; run_case adapts them to a base that writes K/V in place
    traced = {r: C.concat_base_spec(s, src["num_kv_heads"], src["head_dim"]) for r, s in specs.items()
              if is_traced(r)}
    for role in specs:
        spec, tol = specs[role], tols[role]
        session = _session(make_session, out_dir / spec.file, provider, dtype)
        if not is_traced(role):  # the device path's small graphs: vs numpy (a K/V update of old exports: unread)
            report.rows += device_rows(role, session, spec, tol) if C.is_device_role(role) else []
            del session
            continue
        try:
            if is_tree_role(role):  # the one-call EAGLE tree (exporter.eagle_tree)
                from exporter.eagle_tree import tree_cases

                cases = tree_cases(model, spec)
            else:
                cases = base_cases(model, traced["base"]) if role == "base" else draft_cases(model, traced)
        except Exception as e:  # the reference itself failed: a failure, never a skip
            report.rows.append(error_row(role, "traced_reference", e))
            cases = []
        module = graph_module(model, role)
        for case, ref_d, got_d, error in run_cases(module, session, spec, cases):
            if error is not None:
                report.rows.append(error_row(role, case, error))
                continue
            rows = output_rows(role, case, spec, ref_d, got_d, tol, quant[role])
            if is_tree_role(role) and _role_dtype(opt.get(role), spec) != "float32":
                rows = _tree_agreement_only(rows, ref_d, got_d)
            report.rows += rows
        if role == "base" and manifest.one_sequence_file:
            report.rows += one_sequence_rows(model, out_dir, manifest.one_sequence_file, spec, cases, module,
                                             provider, dtype, tol, quant[role])
        if role == "base":
            report.rows += hf_rows(model, session, spec, tol, quant[role], traced[role])
            if distance or quant[role] != "none":
                try:
                    report.distance.append(held_out_row(model, session, spec, out_dir, manifest, quant[role],
                                                        text, text_tokens, traced[role]))
                except Exception as e:
                    report.rows.append(error_row(role, "held_out_text", e))
        del session  # one graph's weights in memory at a time
    return report


def one_sequence_cases(cases: list) -> list:
    """The base's cases that its one-sequence graph takes (one sequence, or one token per row), each
    batched case also as its sequences one by one (the holes of ``batch2_holes`` included)."""
    out = []
    for name, inputs in cases:
        bsz, s = inputs[0].shape
        if bsz == 1 or s == 1:
            out.append((name, inputs))
        else:
            out += [(f"{name}[{b}]", [x[b : b + 1].contiguous() for x in inputs]) for b in range(bsz)]
    return out


def one_sequence_rows(model, out_dir: Path, file: str, spec: C.GraphSpec, cases: list, module, provider: str,
                      dtype: str, tol, quant: str) -> list:
    """The base's one-sequence graph (``exporter.optimize``; the runtime's graph for one-token steps
    and one sequence's trees) against PyTorch on :func:`one_sequence_cases`; rows named ``case (file)``."""
    from graphs.sessions import make_session

    session = _session(make_session, out_dir / file, provider, dtype)
    named = [(f"{case} ({file})", inputs) for case, inputs in one_sequence_cases(cases)]
    rows = []
    for case, ref, got, error in run_cases(module, session, spec, named):
        rows += [error_row("base", case, error)] if error is not None else output_rows("base", case, spec, ref, got,
                                                                                       tol, quant)
    return rows


def run_cases(module, session, spec: C.GraphSpec, cases: list):
    """Per case: (name, PyTorch's outputs, the graph's outputs, None), each a dict by output name, or
    (name, None, None, the exception) where either side raised."""
    for case, inputs in cases:
        try:
            with torch.no_grad():
                ref = [t.numpy() for t in module(*inputs)]
            got = run_case(session, spec, inputs)
        except Exception as e:
            yield case, None, None, e
            continue
        yield case, dict(zip(spec.output_names, ref)), dict(zip(spec.output_names, got)), None


_TREE_CHOICES = {C.TREE_TOKENS, C.TREE_PARENTS, C.TREE_DEPTH, C.TREE_MASK, C.TREE_SCORES}


def _tree_agreement_only(rows: list, ref: dict, got: dict) -> list:
    """A reduced-precision tree graph (a float16 drafter) may resolve near-tied log-probs otherwise than
    float32 PyTorch and draft another tree: its choices are reported (``top1``: the fraction of equal
    entries), failing only when non-finite or misshapen; the drafter K/V of the context rows, which
    no choice affects, stay gated. Drafts never change greedy output: the base verifies them."""
    for r in rows:
        if r.output in _TREE_CHOICES and r.check == "parity" and r.max_abs != float("inf"):
            a, b = ref[r.output], got[r.output]
            r.top1 = float((a == b).mean()) if r.output != C.TREE_SCORES else None
            r.check = "info"
            r.ok = not np.isnan(b.astype(np.float64)).any()
    return rows


def _role_dtype(entry, spec: C.GraphSpec) -> str:
    """The precision a graph computes in: the optimize stage's record (float16 inside float32 I/O is
    possible), else the dtype of its first floating-point output."""
    declared = entry.get("dtype") if isinstance(entry, dict) else None
    if declared in {d for d, _ in TOLERANCES}:
        return declared
    # the first floating-point input (K/V or hidden states): some outputs stay float32 (tree scores)
    return next((t.dtype for t in (*spec.inputs, *spec.outputs) if t.dtype.startswith(("float", "bfloat"))),
                "float32")


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
            finite = sane(r, o)  # (-inf where the reference has it: a DFlash draft vocabulary)
            if name in LOGITS_OUTPUTS:
                q = quality_for(quantization)
                d = logits_distance(r, o, q.margin)
                fields.update(top1=d.top1, limit=q.kl, ok=finite and d.ok(q), check="distance", kl=d.kl,
                              top1_decided=d.top1_decided)
            else:
                fields.update(ok=finite, check="info")
        rows.append(Row(graph=role, case=case, output=name, shape=list(o.shape), **fields))
    return rows


def hf_rows(model, session, spec: C.GraphSpec, tol: Tolerance, quantization: str = "none",
            traced: C.GraphSpec | None = None) -> list[Row]:
    """The base graph against HF's own forward and cache (exporter.hf_reference): causal cases."""
    try:
        cases = hf_base_cases(model, traced or spec)
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
                 text: str | None, max_tokens: int, traced: C.GraphSpec | None = None) -> DistanceRow:
    """Held-out text teacher-forced through HF's own forward and the base graph (one prefill each)."""
    vocab = spec.output(C.LOGITS).dims[-1]
    ids, what = held_out_ids(out_dir, manifest, text, max_tokens, vocab)
    ids_t = torch.from_numpy(ids)[None]  # (1, S)
    s = ids_t.shape[1]
    with torch.no_grad():
        ref = model(ids_t).logits[0].float().numpy()  # (S, V)
    k0 = (traced or spec).input(C.past_key(0))
    n_layers = sum(1 for t in spec.inputs if t.name.endswith(".key"))
    empty = [torch.zeros(1, k0.dims[1], 0, k0.dims[3]) for _ in range(2 * n_layers)]
    got = run_case(session, spec, [ids_t, torch.arange(s)[None], causal_bool_mask(1, s, 0), *empty])[0][0]
    return distance_row("base", quantization, what, ids, ref, got.astype(np.float32))


def device_rows(role: str, session, spec: C.GraphSpec, tol: Tolerance) -> list[Row]:
    """Run one of the device path's graphs (graphs.device) on random inputs against numpy."""
    rng = np.random.default_rng(0)
    x0 = spec.inputs[0]
    dt = _np_dtype(x0.dtype)
    if role == C.SELECT_ROLE:
        logits = rng.standard_normal((2, 3, 37)).astype(dt)
        logits[1, 2, 5] = np.inf
        got = session.run(spec.output_names, {C.LOGITS: logits})
        want = [logits.argmax(-1), np.isnan(logits).any(-1) | np.isposinf(logits).any(-1)]
        return [Row(graph=role, case="select_b2", output=name, shape=list(g.shape),
                    **compare_arrays(w.astype(np.float32), g.astype(np.float32), tol, ""))
                for name, w, g in zip(spec.output_names, want, got)]
    if role == C.ROWS_ROLE:
        x = rng.standard_normal((6, 5)).astype(dt)
        idx = np.array([4, 0, 4])
        got = session.run(spec.output_names, {C.ROWS_IN: x, C.ROW_INDEX: idx})[0]
        return [Row(graph=role, case="rows", output=C.ROWS_OUT, shape=list(got.shape),
                    **compare_arrays(x[idx].astype(np.float32), got.astype(np.float32), tol, ""))]
    if role == C.SAMPLE_ROLE:  # graphs.sampling.process_logits, then p_n(token_m) and inverse-CDF draws
        from graphs.sampling import process_logits

        logits = rng.standard_normal((2, 3, 37)).astype(dt)
        tokens = rng.integers(0, 37, (2, 3))
        temp, top_k, top_p = [0.7, 1.3], [5, 37], [0.9, 1.0]
        u = rng.random((2, 3, C.SAMPLE_DRAWS), dtype=np.float32)
        got = session.run(spec.output_names, {C.LOGITS: logits, C.NODE_TOKENS: tokens, C.TEMPERATURE: np.float32(temp),
                                              C.TOP_K: np.array(top_k), C.TOP_P: np.float32(top_p), C.UNIFORMS: u})
        p = np.stack([process_logits(logits[b].astype(np.float32), temp[b], top_p[b], top_k[b] % 37)
                      for b in range(2)])
        probs = np.take_along_axis(p, np.broadcast_to(tokens[:, None, :], (2, 3, 3)), axis=-1)
        cdf = np.cumsum(p, axis=-1)
        draws = (cdf[:, :, None, :] <= (u * cdf[..., -1:])[..., None]).sum(-1)
        return [Row(graph=role, case="sample_b2", output=name, shape=list(g.shape),
                    **compare_arrays(w.astype(np.float32), g.astype(np.float32), tol, ""))
                for name, w, g in zip(spec.output_names, [probs, draws], got)]
    n = sum(1 for t in spec.inputs if t.name.startswith("cache."))
    dims = [2 if d == C.BATCH else 12 if isinstance(d, str) else d for d in x0.dims]
    caches = [rng.standard_normal(dims).astype(dt) for _ in range(n)]
    axis = len(dims) - 2
    feed = {C.cache_in(j): caches[j] for j in range(n)}
    if role == C.COMPACT_ROLE:
        src, write = np.array([[6, 8, 9], [4, 4, 5]]), np.array([6, 3])
        feed |= {C.SRC_COLUMNS: src, C.KV_WRITE: write}
    else:
        pads = [0] * (2 * len(dims))
        pads[len(dims) + axis] = 4
        feed[C.PADS] = np.array(pads, dtype=np.int64)
    got = session.run(spec.output_names, feed)
    rows = []
    for j in range(n):
        c = caches[j]
        if role == C.COMPACT_ROLE:
            want = c.copy()
            for b in range(2):
                kept = np.take(c[b], src[b], axis=axis - 1)
                idx = [slice(None)] * (len(dims) - 1)
                idx[axis - 1] = slice(write[b], write[b] + src.shape[1])
                want[b][tuple(idx)] = kept
        else:
            widths = [(0, 0)] * len(dims)
            widths[axis] = (0, 4)
            want = np.pad(c, widths)
        rows.append(Row(graph=role, case="kv_b2", output=spec.output_names[j], shape=list(got[j].shape),
                        **compare_arrays(want.astype(np.float32), got[j].astype(np.float32), tol, "")))
    return rows


def check_same_model(model, specs: dict[str, C.GraphSpec], dtype: str, out_dir: Path) -> None:
    """The graphs in ``out_dir`` must have the contract this model's plan exports to (same sizes, same drafter)."""
    baked = [r for r in specs if is_tree_role(r)]  # one-call EAGLE trees, as exported
    eagle = getattr(model, "spec_mode", None) == "eagle"
    want = build_plan(model, dtype=dtype, eagle_trees=[parse_tree_role(r) for r in baked] if eagle else None).specs
    # the traced graphs; the device path's follow from the base (a K/V update of an older export: unread)
    if C.kv_in_place(specs["base"]) and any(C.is_device_role(r) for r in specs):
        want |= {r: s for r, s in C.device_graph_specs(specs["base"], specs.get("draft")).items()}
    if set(want) != {r for r in specs if is_traced(r) or C.is_device_role(r)}:
        kind = getattr(model, "spec_mode", None) or "no drafter"
        raise UserError(
            f"{out_dir} holds graphs {sorted(specs)} but this model ({kind}) exports to {sorted(want)}: "
            f"compare it with the model_dir (and --drafter) it was exported from"
        )
    for role, spec in want.items():
        if is_traced(role) and C.kv_in_place(specs[role]):  # optimized: the same contract with its K/V written in place
            spec = C.inplace_base_spec(spec, C.kv_layout(specs[role]))
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




# ----------------------------------------------------------------------------- export's gate


def validate_export(model, tmp: Path, manifest: Manifest, plan, log=print) -> dict:
    """Compare the graphs in ``tmp`` (the plan's, traced) with ``model``; return the manifest's
    ``validation`` record, or raise UserError if they disagree (nothing is written then).

    A reduced-precision graph that ONNX Runtime's CPU provider cannot run at all (bfloat16: no CPU
    kernels for several ops) is checked structurally with ``onnx.checker`` instead, and the record
    and the log say that the numerical check was skipped.
    """
    import onnx

    dtype = plan.dtype
    try:
        report = compare_model(model, tmp, manifest=manifest, plan=plan)
    except UnsupportedProviderError as e:
        if dtype == "float32":
            raise
        for spec in manifest.graphs.values():
            onnx.checker.check_model(str(tmp / spec.file))
        reason = str(e)
        log(f"note: numerical check skipped: {reason}; the graphs passed onnx.checker")
        if dtype == "bfloat16":
            log("note: bfloat16 graphs are for other ONNX runtimes; graphs.load runs float32 and float16 exports")
        return {"ok": None, "dtype": dtype, "device": "cpu", "skipped": reason}
    if not report.ok:
        log(report.table())
        bad = report.failures()[0]
        raise UserError(
            f"exported {bad.graph} graph disagrees with PyTorch: {bad.output} in case {bad.case} "
            f"max abs error {bad.max_abs:.3g} > {bad.limit:.3g}; nothing was written"
        )
    return {"ok": report.ok, "dtype": report.dtype, "device": report.device,
            "max_abs": {f"{r.graph}/{r.case}/{r.output}": r.max_abs for r in report.rows}}


def check_tree_graph(model, session, role: str, spec: C.GraphSpec, dtype: str) -> None:
    """A newly baked one-call tree graph against PyTorch (tune's baking); UserError when it disagrees."""
    from exporter.eagle_tree import graph_for_role, tree_cases

    module = graph_for_role(model, role)
    tol = TOLERANCES[(dtype, "cpu")]
    for case, inputs in tree_cases(model, spec):
        with torch.no_grad():
            ref = [t.numpy() for t in module(*inputs)]
        for o, r, g in zip(spec.outputs, ref, run_case(session, spec, inputs)):
            row = compare_arrays(r, g, tol, o.name)
            if not row["ok"]:
                raise UserError(f"the baked {role} graph disagrees with PyTorch ({o.name}, {case}): not written")
