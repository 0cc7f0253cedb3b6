"""The optimize stage: tree-safe fusions, float16 for GPUs, int4/int8 weight-only graphs.

    specs, records = optimize_graphs(out_dir, tmp, manifest, options)   rewritten graphs into tmp
    check_parity(out_dir, tmp, manifest, specs, options)                 raw vs rewritten, a gate

Per traced graph (base, draft, and the one-call EAGLE tree graphs ``draft_tree.*``, whose unrolled
drafter forwards get the draft graph's passes):

    fuse       eager attention -> ONNX ``Attention`` (opset 23: any mask, grouped K/V; never
               ``GroupQueryAttention``, which ignores tree masks), rotary -> ONNX ``RotaryEmbedding``,
               RMSNorm -> SimplifiedLayerNorm, residual Add + RMSNorm -> SkipSimplifiedLayerNorm
               (exporter.passes.*)
    quantize   MatMul weights -> ``MatMulNBits`` (4 or 8 bits, block 32; ORT's quantizer)
    float16    --target cuda: ORT's float16 converter, norms and softmax kept float32; the base in two
               attention forms (ONNX ``Attention`` and ``base.gqa.onnx``'s ``GroupQueryAttention``, each
               fed the tree mask as an additive bias), chosen between by timing on the GPU
               (exporter.attention_forms)

then every rewritten graph is checked against the raw one on random non-causal tree masks, batch 2
with holes in the past, a decode with a past and a prefill (exporter.passes.parity), within
compare's tolerance for its dtype (:data:`exporter.compare_report.TOLERANCES`). The pipeline
(:func:`exporter.pipeline.optimize_export`) runs these through the writer (:mod:`exporter.outdir`),
so a failure leaves the export as it was. A quantized base is a new base: speculative decoding stays
lossless relative to it, and its distance from the float model is what ``python -m exporter.compare``
reports.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exporter.compare_report import TOLERANCES
from exporter.errors import UserError
from exporter.plan import is_traced, is_tree_role
from graphs import contract as C
from graphs.manifest import Manifest

TARGETS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
QUANTIZE = {"none": 0, "int8": 8, "int4": 4}
TUNE_BUDGET_S = 60.0  # the re-tuning after optimize: its EAGLE sweep's time (Medusa needs less)


@dataclass(frozen=True)
class OptimizeOptions:
    """What to do to each traced graph. Defaults: measured on a 2-core x86 CPU (README, "Optimize")."""

    target: str = "cpu"  # the provider the graphs are tuned for: "cpu" | "cuda"
    quantize: str = "none"  # weight-only: "none" | "int8" | "int4" (MatMulNBits)
    # the drafter's graphs (draft, draft_tree.*) on their own; None: as ``quantize``. A quantized drafter
    # beside a float base keeps the output exactly the float model's (drafts are only proposals) and
    # makes drafting cheaper: what EAGLE, whose drafter is a decoder layer and an lm_head, needs most.
    quantize_draft: str | None = None
    fuse: bool = True  # attention + norms; exact under tree masks, 1.1-1.5x per step on CPU
    float16: bool | None = None  # None: float16 for cuda, float32 for cpu
    block_size: int = 32  # quantization block along K: 32 keeps int4 error small
    # MatMulNBits compute type of the base. None: 4 (int8 activations, MLAS's fast kernels), kept only
    # where the rows check below finds every row's logits the same whatever the call's row count; where
    # only a one-row call differs (MLAS's separate M == 1 kernel on VNNI CPUs: up to 1.2e-2 measured),
    # the manifest says so and the runtime calls one token as two rows (graphs.runtime); where calls of
    # several rows differ too, optimize refuses level 4. 0: float32 compute (row-consistent everywhere).
    accuracy_level: int | None = None
    # The drafter's graphs (draft, draft_tree.*) at level 4 by default: drafts are deterministic
    # tokens that the base verifies (graphs.sampling), so the drafter's rounding can change which
    # tokens are proposed, never what is emitted; measured on the 19M EAGLE drafter, level 0 made the
    # one-call draft 1.0x float32 (int4) and 7x slower (int8), level 4 1.8x faster.
    draft_accuracy_level: int = 4
    # the base writes its new K/V into the caller's buffers (exporter.passes.kv_inplace) instead of
    # concatenating the whole cache in every layer; None: on for both targets (ORT's CPU TensorScatter
    # writes in place; CUDA has the kernel since ONNX Runtime PR #27446, and the device path binds its
    # buffers as OrtValues on the GPU). The GroupQueryAttention form (one_sequence_graph) needs it.
    kv_in_place: bool | None = None
    # the base's K/V buffers where it writes them in place (its fused layers, exporter.passes.kv_inplace):
    # "bhsd" (B, kv_heads, P, head_dim), which ONNX Attention's CPU kernel reads per head contiguously,
    # or "bsh" (B, P, kv_heads * head_dim), genai's compact 3-D form, 4 nodes a layer fewer but a
    # strided read per head: measured on the 19M model, 2 threads, the step's slope against context
    # 1.5-2x genai's with "bsh", 1.0-1.3x with "bhsd" (docs/benchmarks.md)
    kv_layout: str = "bhsd"
    # beside the base, a graph of the same contract with each layer's attention as one
    # com.microsoft.GroupQueryAttention (rotary, cache write and attention in one kernel that reads
    # each row's own length; exporter.passes.kv_inplace.group_query_graph), which the runtime runs for
    # the calls that kernel takes (one token per row, or one sequence): on the 19M model 74 ORT nodes
    # to the base's 120 and a third less step time at 2048 tokens of context (docs/benchmarks.md).
    # Checked as the base is (parity with the raw trace, rows), and against the base row for row.
    one_sequence_graph: bool = True
    validate: bool = True  # raw-vs-optimized parity on tree/batch/past cases before the swap
    time_gain: bool = True  # time raw vs optimized base at 1 and 8 tokens for the summary

    def __post_init__(self):
        if self.target not in TARGETS:
            raise UserError(f"unknown --target {self.target!r}; accepted: {', '.join(TARGETS)}")
        for flag, q in (("--quantize", self.quantize), ("--quantize-draft", self.quantize_draft)):
            if q is not None and q not in QUANTIZE:
                raise UserError(f"unknown {flag} {q!r}; accepted: {', '.join(QUANTIZE)}")
        for flag, level in (("--accuracy-level", self.accuracy_level),
                            ("--draft-accuracy-level", self.draft_accuracy_level)):
            if level is not None and level not in (0, 1, 2, 3, 4):
                raise UserError(f"{flag} {level} must be 0-4 (0: float32 compute, 4: int8)")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise UserError(f"--block-size {self.block_size} must be a power of two >= 16 (32 advised)")
        if self.kv_layout not in C.KV_LAYOUTS:
            raise UserError(f"unknown --kv-layout {self.kv_layout!r}; accepted: {', '.join(C.KV_LAYOUTS)}")
        if not (self.fuse or self.quantize != "none" or self.quant_for("draft") != "none" or self.use_float16):
            raise UserError("nothing to do: --no-fuse without --quantize or float16; drop --no-fuse")

    @property
    def writes_kv_in_place(self) -> bool:
        return True if self.kv_in_place is None else bool(self.kv_in_place)

    @property
    def use_float16(self) -> bool:
        return self.target == "cuda" if self.float16 is None else bool(self.float16)

    def quant_for(self, role: str) -> str:
        """The weight quantization of ``role``'s graph: the base's is ``quantize``, the drafter's
        ``quantize_draft`` when given."""
        return self.quantize if role == "base" or self.quantize_draft is None else self.quantize_draft

    def level(self, role: str) -> int:
        """MatMulNBits accuracy level of ``role``'s graph: the base's decides what is emitted."""
        if role != "base":
            return self.draft_accuracy_level
        return 4 if self.accuracy_level is None else self.accuracy_level


# ----------------------------------------------------------------------------- one graph


def optimize_graph(src: Path, dst: Path, role: str, opts: OptimizeOptions, log=print, source: dict | None = None
                   ) -> dict:
    """Run the passes on the graph file ``src``; write ``dst`` (+ ``dst.data``). Returns its record."""
    import logging

    from exporter.passes import graphio

    for name in ("onnxscript", "onnx_ir"):  # their INFO lines drown the per-pass summary
        logging.getLogger(name).setLevel(logging.WARNING)
    proto = graphio.load_graph(src)
    external = graphio.has_external_data(proto)
    before = graphio.count_ops(proto)
    passes, fused = [], {}

    def step(name: str, detail: str, t0: float, ops_before: dict):
        ops = graphio.count_ops(proto)
        n0, n1 = sum(ops_before.values()), sum(ops.values())
        log(f"  [{role}] {name:10} {detail:52} nodes {n0:5d} -> {n1:5d}  ({time.perf_counter() - t0:.1f} s)",
            flush=True)
        passes.append(name)
        return ops

    ops = before
    candidates = _attention_candidates(proto) if opts.fuse else 0
    if candidates:
        t0 = time.perf_counter()
        proto, n_attn, n_rot = _rewire(proto, src.parent, attention=True)
        if n_attn != candidates:
            raise UserError(f"{role} graph {src.name}: {candidates - n_attn} of {candidates} attentions do not "
                            f"match the traced eager pattern (a graph from another exporter?); the export is "
                            f"untouched: optimize without fusion (--no-fuse)")
        fused["Attention"] = n_attn
        fused["RotaryEmbedding"] = n_rot
        ops = step("attention", f"{n_attn} eager attentions -> Attention, {n_rot} rotary -> RotaryEmbedding",
                   t0, ops)
        if n_rot:
            passes.append("rotary")
    else:  # constant folding and Identity removal only (the quantizer skips weights behind an Identity)
        proto, _, _ = _rewire(proto, src.parent, attention=False)
        ops = graphio.count_ops(proto)
    if opts.fuse:
        from exporter.passes.norms import fuse_norms

        t0 = time.perf_counter()
        norms = fuse_norms(proto)
        fused.update(norms)
        if norms:
            ops = step("norms", ", ".join(f"{v} {k}" for k, v in norms.items()), t0, ops)
    layers = sum(1 for t in proto.graph.input if t.name.startswith("past_key_values.")) // 2
    if layers and opts.writes_kv_in_place:  # the base, and the EAGLE drafter's graphs (their own K/V)
        from exporter.passes.kv_inplace import write_in_place

        t0 = time.perf_counter()
        src_dims = source or {}
        try:
            proto, layout = write_in_place(proto, layers, src_dims.get("num_attention_heads", 0),
                                           src_dims.get("num_kv_heads", 0), src_dims.get("head_dim", 0),
                                           base_dir=src.parent,
                                           max_positions=src_dims.get("max_position_embeddings"),
                                           compact=role == "base", layout=opts.kv_layout)
        except ValueError as e:
            raise UserError(f"{role} graph {src.name}: cannot write K/V in place ({e}); the export is untouched: "
                            f"optimize with --no-kv-in-place") from None
        fused["kv_layout"] = layout
        ops = step("kv", f"{2 * layers} past+new Concat -> TensorScatter, K/V in place ({layout})", t0, ops)
    quantize = opts.quant_for(role)
    if quantize != "none" or opts.use_float16:
        graphio.load_weights(proto, src.parent)
    quant = None
    if quantize != "none":
        from exporter.passes.quantize import quantize_weights

        t0 = time.perf_counter()
        bits = QUANTIZE[quantize]
        proto, n_q = quantize_weights(proto, bits, opts.block_size, opts.level(role))
        if n_q == 0:
            raise UserError(f"{role} graph {src.name}: no MatMul with a constant weight to quantize")
        quant = {"method": "MatMulNBits", "bits": bits, "block_size": opts.block_size, "symmetric": True,
                 "accuracy_level": opts.level(role), "matmuls": n_q}
        ops = step(quantize, f"{n_q} MatMul -> MatMulNBits (bits={bits}, block={opts.block_size})", t0, ops)
    if opts.use_float16:
        from exporter.passes.fp16 import to_float16

        t0 = time.perf_counter()
        proto = to_float16(proto)
        ops = step("float16", "float16 weights/activations; norms, softmax float32", t0, ops)
    graphio.load_weights(proto, src.parent)  # weights left on disk by the rewiring passes
    written = graphio.save_graph(proto, dst, external=external)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    one = None
    if role == "base" and opts.one_sequence_graph and fused.get("kv_layout") == "bhsd":
        dims = source or {}
        # Written at every accuracy level. At level 4 (int8 activations) a last-bit difference between
        # two calls' attention now and then moves an activation across a quantization step: over 32
        # chains a tree's path is 3.1e-3 from the chain in the base's Attention, 2.6e-3 in this graph's
        # GroupQueryAttention, the two graphs 3.2e-3 apart (19M int4). The rows checks record all of
        # it (rows_max_abs), the margin of the measured contract; trees are not exact there either way.
        if dims.get("head_dim", 0) % 16:
            log(f"  [base] one-seq   not written: GroupQueryAttention's CPU kernel needs head_dim a multiple of 16 "
                f"(this model: {dims.get('head_dim')}); every call runs the base", flush=True)
        else:
            one = write_one_sequence_graph(dst, layers, dims.get("num_attention_heads", 0),
                                           dims.get("num_kv_heads", 0), log)
        if one:
            written.append(dst.with_name(one["file"]))
    return {
        "passes": passes,
        "target": opts.target,
        "provider": TARGETS[opts.target],
        "dtype": "float16" if opts.use_float16 else "float32",
        "quantization": quant,
        "fused": fused,
        "nodes_before": sum(before.values()),
        "nodes_after": sum(ops.values()),
        "opset": opset,
        "files": [p.name for p in written],
        **({"one_sequence": one} if one else {}),
    }


def write_one_sequence_graph(dst: Path, layers: int, q_heads: int, kv_heads: int, log) -> dict | None:
    """``dst``'s one-sequence graph (:func:`exporter.passes.kv_inplace.group_query_graph`) beside it;
    its record, or None where the base is not the compact form it rewrites. Its weights are ``dst``'s:
    the same external data file where ``dst`` has one (read with the weights left on disk), else a
    copy inside the file."""
    import onnx

    from exporter.passes import graphio
    from exporter.passes.kv_inplace import ONE_SEQUENCE_SUFFIX, group_query_graph

    t0 = time.perf_counter()
    proto = graphio.load_graph(dst)
    n0 = len(proto.graph.node)
    made = group_query_graph(proto, layers, q_heads, kv_heads)
    if made is None:
        log("  [base] one-seq   not written: the base's layers are not the compact fused form", flush=True)
        return None
    one, columns = made
    path = dst.with_name(dst.name[: -len(".onnx")] + ONE_SEQUENCE_SUFFIX)
    onnx.save_model(one, str(path))
    n1 = len(one.graph.node)
    log(f"  [base] one-seq   {layers} attention blocks -> GroupQueryAttention ({path.name}){'':14} nodes {n0:5d} -> "
        f"{n1:5d}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return {"file": path.name, "op": "GroupQueryAttention", "nodes": n1,
            "calls": "one token per row, or one sequence (batch 1)",
            "max_columns": columns}  # a wider call (write column + new rows) runs the base


def _attention_candidates(proto) -> int:
    """Softmax nodes whose output feeds a MatMul (or a Slice: the DFlash drafter splits its softmax between
    two value sets): the eager attentions a graph should have fused."""
    consumers: dict[str, list[str]] = {}
    for node in proto.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node.op_type)
    return sum(1 for n in proto.graph.node if n.op_type == "Softmax"
               and any(c in ("MatMul", "Cast", "Slice") for c in consumers.get(n.output[0], [])))


def _rewire(proto, base_dir: Path, attention: bool):
    """onnxscript's optimizer (constant folding, no-op Cast/Identity removal); with ``attention``,
    first opset 17 -> 23 (onnx's version converter), then eager attention -> ``Attention`` and
    rotary -> ``RotaryEmbedding``. Weights stay on disk. Returns (model, attentions, rotaries)."""
    import onnx_ir as ir
    from onnx import version_converter
    from onnxscript.optimizer import optimize

    from exporter.passes.attention import ATTENTION_OPSET, fuse_attention

    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    if attention and opset < ATTENTION_OPSET:
        proto = version_converter.convert_version(proto, ATTENTION_OPSET)
    model = ir.from_proto(proto)
    ir.external_data.set_base_dir(model.graph, base_dir)
    optimize(model)  # the pattern is matched on a clean graph
    n = rotary = 0
    if attention:
        from exporter.passes.rotary import fuse_rotary

        n = fuse_attention(model)
        rotary = fuse_rotary(model)
        optimize(model)
    return ir.to_proto(model), n, rotary


# ----------------------------------------------------------------------------- the export


FLOAT32_OUTPUTS = (C.TOPK_LOGPROBS, C.TREE_SCORES)  # float32 in every export (graphs.contract)


def optimized_spec(spec: C.GraphSpec, float16: bool) -> C.GraphSpec:
    """The contract of the rewritten graph: float tensors become float16, except the draft scores
    (topk_logprobs, tree_scores), which the contract keeps float32 whatever the cache dtype."""
    if not float16:
        return spec

    def conv(t: C.TensorSpec) -> C.TensorSpec:
        if t.dtype == "float32" and t.name not in FLOAT32_OUTPUTS:
            return dataclasses.replace(t, dtype="float16")
        return t

    return C.GraphSpec(file=spec.file, inputs=tuple(map(conv, spec.inputs)), outputs=tuple(map(conv, spec.outputs)))


def graph_files(out_dir: Path, spec: C.GraphSpec) -> list[Path]:
    p = out_dir / spec.file
    return [p] + ([p.with_name(p.name + ".data")] if p.with_name(p.name + ".data").exists() else [])


def check_space(out_dir: Path, manifest: Manifest) -> None:
    need = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    free = shutil.disk_usage(out_dir.parent).free
    if free < need * 1.2:
        raise UserError(f"not enough disk space beside {out_dir}: optimizing needs about {need * 1.2 / 1e9:.2f} GB "
                        f"free for the rewritten copy, {free / 1e9:.2f} GB are; free some space and retry")


def parity_tolerance(opts: OptimizeOptions) -> tuple[float, float]:
    """(atol, rtol) of raw vs rewritten graphs: compare's CPU tolerance for the rewritten dtype."""
    tol = TOLERANCES[("float16" if opts.use_float16 else "float32", "cpu")]
    return tol.atol, tol.rtol


def check_parity(out_dir: Path, tmp: Path, manifest: Manifest, specs: dict, opts: OptimizeOptions, log) -> dict:
    """Raw vs rewritten graphs (CPU EP) on the parity cases; raises UserError on a mismatch."""
    from exporter.passes.parity import graph_parity

    atol, rtol = parity_tolerance(opts)
    report = {"strict": opts.quantize == "none" and opts.quant_for("draft") == "none", "atol": atol, "rtol": rtol,
              "graphs": {}}
    for role in [r for r in specs if is_traced(r)]:
        strict = opts.quant_for(role) == "none"
        if is_tree_role(role):
            report["graphs"][role] = _validate_tree(out_dir, tmp, manifest, specs, role, opts, log)
            continue
        try:
            rows = graph_parity(out_dir / manifest.graphs[role].file, tmp / specs[role].file, manifest.graphs[role],
                                specs[role], atol, rtol, vocab=manifest.source["vocab_size"], strict=strict,
                                **dflash_feeds(out_dir, manifest, role))
        except Exception as e:
            report["graphs"][role] = _not_on_cpu(e, role, opts, log)
            continue
        bad = [r for r in rows if not r.ok]
        if role == "base":  # a row's logits whatever its call's row count: greedy speculative == autoregressive
            report["rows"] = check_rows(tmp / specs[role].file, specs[role], manifest.source, opts, atol, log,
                                        provider=rows_provider(opts))
        worst = max((r for r in rows if r.output in (C.LOGITS,)), key=lambda r: r.max_abs)
        top1 = min((r.top1 for r in rows if r.top1 is not None), default=None)
        report["graphs"][role] = {"max_abs_logits": worst.max_abs, "min_top1": top1, "ok": not bad,
                                  "rows": [dataclasses.asdict(r) for r in rows]}
        what = "vs raw" if strict else "vs raw float32 (quantized: reported, not gated)"
        log(f"  [{role}] parity    {what}: max |logits diff| {worst.max_abs:.2e}, top-1 agreement "
            f"{top1 if top1 is None else f'{top1:.3f}'}, {len(rows)} outputs x cases: {'ok' if not bad else 'FAIL'}")
        if bad:
            r = bad[0]
            raise UserError(f"optimized {role} graph disagrees with the raw one: {r.output} in case {r.case} max abs "
                            f"error {r.max_abs:.3g} > {r.limit:.3g}; the export is untouched")
    return report


def dflash_feeds(out_dir: Path, manifest: Manifest, role: str) -> dict:
    """``graph_parity``'s keywords for ``role``: for a DFlash draft graph, its own calls
    (:func:`exporter.passes.parity.dflash_parity_feeds`: the export check's, at batch 2 with a cache,
    holes and the block mask; random base-graph feeds do not fit its contract), else none."""
    spec = manifest.graphs[role]
    if C.CONTEXT_POSITION_IDS not in spec.input_names:
        return {}
    from exporter.passes.parity import dflash_parity_feeds
    from graphs.sessions import make_session

    raw = make_session(out_dir / spec.file, "cpu", 1)
    feeds = dflash_parity_feeds(out_dir / manifest.graphs["base"].file, manifest.graphs["base"], raw, spec,
                                manifest.drafter, manifest.source["vocab_size"])
    return {"feeds": feeds, "raw_session": raw}


def rows_provider(opts: OptimizeOptions) -> str:
    """The provider the rows gates call the optimized base on: the target's where this machine has it
    (the rows must be measured on the kernels that will compute them), else the CPU EP (its record
    says which, and the gate says so)."""
    import onnxruntime as ort

    if opts.target != "cpu" and TARGETS[opts.target] in ort.get_available_providers():
        return opts.target
    return "cpu"


def row_seeds(opts: OptimizeOptions) -> int:
    """Chains the rows checks call: more where the base has int8 activations (parity.ROW_SEEDS_INT8)."""
    from exporter.passes.parity import ROW_SEEDS, ROW_SEEDS_INT8

    return ROW_SEEDS_INT8 if int8_activations(opts) else ROW_SEEDS


def int8_activations(opts: OptimizeOptions) -> bool:
    """The base's MatMulNBits quantize their activations to int8 (accuracy level 4)."""
    return opts.quantize != "none" and opts.level("base") == 4


def row_sizes(seed: int) -> tuple:
    """The calls of chain ``seed``: every size for the first ROW_SEEDS, the whole chain (and its
    tree) for the int8 samples after them."""
    from exporter.passes.parity import ROW_SEEDS, ROW_SIZES

    return ROW_SIZES if seed < ROW_SEEDS else (max(ROW_SIZES),)


def check_rows(path: Path, spec: C.GraphSpec, source: dict, opts: OptimizeOptions, limit: float, log,
               provider: str = "cpu") -> dict:
    """The rows gate of the base (:func:`exporter.passes.parity.row_consistency` over
    :func:`row_seeds` chains): calls of 2+ rows must agree within ``limit`` (else refused); a one-row
    call that does not makes the runtime pad one token to two rows (``min_rows`` 2, recorded) where
    trees agree too (:func:`pads_one_row`). Returns the record (the measured bounds, the limit,
    min_rows, the provider that ran it) written to the manifest.

    ``provider``: where the calls run (:func:`rows_provider`: the target's EP where this machine has
    it). On a device, calls of 2+ rows that differ are recorded (the recorded-bound contract), not
    refused: CUDA kernels pick tiles by row count by design (MatMulNBits has an M = 1 and an M = 2..16
    kernel, ONNX Runtime PR #29451), so bit-equal rows across call shapes are not to be expected."""
    from exporter.passes.parity import ROW_SIZES, row_consistency
    from graphs.sessions import make_session

    session = make_session(path, provider, 1)
    dims = (source.get("num_kv_heads"), source.get("head_dim"))
    runs = [row_consistency(path, spec, source["vocab_size"], seed=seed, kv_dims=dims, session=session,
                            sizes=row_sizes(seed), provider=provider) for seed in range(row_seeds(opts))]
    single, multi = max(r["single"] for r in runs), max(r["multi"] for r in runs)
    tree = max(r.get("tree", 0.0) for r in runs)
    quantized = opts.quantize != "none"
    # tree: recorded, not gated -- a tree's ancestors sit at other columns than a chain's past, which
    # moves the attention's rounding; with int8 activations that can be a quantization step
    rec = {"single_max_abs": single, "multi_max_abs": multi, "tree_max_abs": tree, "limit": limit,
           "sizes": list(ROW_SIZES), "chains": len(runs), "min_rows": 1, "provider": provider}
    sizes = "/".join(map(str, rec["sizes"][1:]))
    log(f"  [base] rows      a row alone vs in calls of {sizes} rows: max |logits diff| {single:.1e}; "
        f"between calls of 2+ rows: {multi:.1e} (limit {limit:g}); a chain as a tree's path: {tree:.1e} "
        f"(recorded; {len(runs)} chains, calls of every size on the first 8; {provider} EP)")
    if opts.target != "cpu" and provider == "cpu":
        log(f"  [base] rows      measured on the CPU EP: this machine has no {TARGETS[opts.target]}; optimizing "
            f"on the {opts.target} machine runs this gate on its kernels")
    if multi > limit and provider == "cpu":
        fix = ("quantize with --accuracy-level 0 (float32 compute)" if quantized and opts.level("base") != 0
               else "optimize with --no-fuse")
        if quantized and opts.level("base") == 4 and opts.block_size != 32:
            # MLAS's int8 kernels at block 64/128 round a row by the call's row count; at block 32 they do
            # not (SmolLM2-135M, AVX512-VNNI: 2+ row calls 1.4 logits apart at block 128, 0.0 at 32)
            fix = f"quantize with --block-size 32 (or {fix.removeprefix('quantize with ')})"
        raise UserError(f"optimized base graph gives a token different logits in calls of different sizes "
                        f"({multi:.3g} > {limit:g}), so speculative output could differ from autoregressive; "
                        f"the export is untouched: {fix}")
    if pads_one_row(single, tree, limit):
        rec["min_rows"] = 2
        log("  [base] rows      one-token calls will run as two rows (a padding row): every call then uses the "
            "same kernels")
    elif single > limit:
        log(f"  [base] rows      one-token calls stay one row: a tree's path differs by {tree:.1e} anyway, so two "
            f"rows would not make every call agree (the bound counts both; --accuracy-level 0 is exact)")
    set_contract(rec, rows_bound(single, [multi, tree], rec["min_rows"]), log, "the base graph's calls",
                 fix=LEVEL0_FIX if quantized and opts.level("base") != 0 else "")
    return rec


# what the NOT EXACT line offers a quantized base at another accuracy level (SmolLM2-135M int4: level 4's
# bound 4.08 logits, level 0's 3.7e-4: float32 rounding through 30 layers, just past the 1e-4 limit)
LEVEL0_FIX = "--accuracy-level 0 (float32 compute) leaves float32 rounding only"


def set_contract(rec: dict, bound: float, log, what: str, fix: str = "") -> None:
    """Record in the rows record ``rec`` which contract the runtime's calls keep, and say it when it is
    not the exact one. ``bound``: :func:`rows_bound`, the most a token's logits move between the calls
    the runtime makes. Within ``rec["limit"]`` the contract is ``"exact"`` (greedy speculative ==
    greedy autoregressive, token for token); over it, ``"recorded bound"``: the two may part where the
    base's top-2 margin is within twice the bound (a near-tie the calls' rounding resolves either way:
    :func:`within_bound`), and ``exporter.bench`` prints that margin at each divergence. Over the
    limit is never silent: ``over_limit`` names the figures past it, and a line says so (issue 36: a
    0.83-logit one-row figure over a 1e-4 limit had passed with min_rows 1 and no word)."""
    limit = rec["limit"]
    figures = {"single_max_abs": rec["single_max_abs"] if rec.get("min_rows", 1) == 1 else 0.0,
               "multi_max_abs": rec["multi_max_abs"], "tree_max_abs": rec["tree_max_abs"]}
    for name in ("vs_base_max_abs", "vs_base_tree_max_abs", "one_sequence_single_max_abs",
                 "one_sequence_tree_max_abs"):
        if name in rec:
            figures[name] = rec[name]
    rec["bound"] = bound
    rec["over_limit"] = sorted(k for k, v in figures.items() if v > limit)
    rec["contract"] = "exact" if bound <= limit else "recorded bound"
    if rec["contract"] == "exact":
        return
    if rec["over_limit"]:
        worst = ", ".join(f"{k.removesuffix('_max_abs')} {figures[k]:.2g}" for k in rec["over_limit"]) + " >"
    else:  # each within the limit, their sum along the worst path not
        worst = " + ".join(f"{k.removesuffix('_max_abs')} {v:.2g}" for k, v in figures.items() if v) + " add past"
    log(f"  [base] rows      NOT EXACT ({what}): {worst} limit {limit:g}: the contract is the recorded bound "
        f"({bound:.3g} logits, rows_max_abs): greedy speculative output equals autoregressive except where "
        f"the base's top-2 margin is within {2 * bound:.3g} (twice the bound; exporter.bench prints the margin "
        f"at each divergence){'; ' + fix if fix else ''}")


def within_bound(margin: float, bound: float) -> bool:
    """Whether two calls whose logits differ by at most ``bound`` each (``rows_max_abs``) may pick
    different top-1 tokens where one of them has top-2 ``margin``: a flip moves the difference of two
    logits, each by at most ``bound``, so it needs ``margin <= 2 * bound``."""
    return margin <= 2 * bound


def pads_one_row(single: float, trees: float, limit: float) -> bool:
    """Whether one-token calls run as two rows (``min_rows`` 2): where the one-row call alone rounds
    otherwise (``single`` over ``limit``) and a tree's path agrees with the chain (``trees``, every
    tree figure measured, within it). A padding row buys exactness only where trees are exact too;
    with int8 activations a tree's path differs anyway, so the step stays one row (two rows cost
    1.3-1.5x a one-token step at 1.1B int4) and the bound counts both (rows_bound)."""
    return single > limit and trees <= limit


def rows_bound(single: float, others: list[float], min_rows: int, across: float = 0.0) -> float:
    """The recorded bound on a token's logits across the calls the runtime makes (``rows_max_abs``),
    the sum along the worst path from an autoregressive step to a verify: the one-row figure where
    one-token steps run alone (``min_rows`` 1: a step within ``single`` of its graph's chain call),
    ``across`` (the two graphs' chain calls apart, where there are two), and the worst of the other
    several-row figures (calls of 2+ rows, a tree's path). Measured maxima over the sampled chains,
    not a proof: a rarer quantization step can exceed them."""
    return max(others, default=0.0) + across + (single if min_rows == 1 else 0.0)


def check_one_sequence(out_dir: Path, tmp: Path, manifest: Manifest, specs: dict, records: dict,
                       opts: OptimizeOptions, log, rows_record: dict | None = None) -> dict | None:
    """The one-sequence graph (``records["base"]["one_sequence"]``) through the base's gates: parity
    with the raw trace on the calls it takes (a tree after a past with holes, one token per row of a
    batch, a causal prefill), its own rows check, and the same logits as the base for every call
    size the runtime makes (so it does not matter which of the two a token is computed with). A
    graph that fails is removed (our own file, not yet the export's) with a line saying why: the base
    alone is complete. Updates the base's ``min_rows`` and ``rows_max_abs``; returns the record."""
    from exporter.passes.parity import ONE_SEQUENCE_CASES, consistency, graph_parity, row_logits
    from graphs.sessions import make_session

    base = records.get("base") or {}
    one = base.get("one_sequence")
    if not one:
        return None
    path = tmp / one["file"]
    atol, rtol = parity_tolerance(opts)
    strict = opts.quantize == "none"
    source = manifest.source
    dims = (source.get("num_kv_heads"), source.get("head_dim"))
    raw = out_dir / manifest.graphs["base"].file
    try:
        s_raw = make_session(raw, "cpu", 1)  # both parity runs below: the raw trace loaded once
        rows = graph_parity(raw, path, manifest.graphs["base"], specs["base"], atol, rtol, vocab=source["vocab_size"],
                            strict=strict, cases=ONE_SEQUENCE_CASES, raw_session=s_raw)
        # quantized: the base on the same cases, the distance from the float trace this graph may not exceed
        theirs_raw = (None if strict else
                      graph_parity(raw, tmp / specs["base"].file, manifest.graphs["base"], specs["base"], atol, rtol,
                                   vocab=source["vocab_size"], strict=False, cases=ONE_SEQUENCE_CASES,
                                   raw_session=s_raw))
        # the rows check's calls (chains after a past, their first M tokens, as a tree's path) on both graphs
        device = rows_provider(opts)  # the rows checks on the target's kernels where this machine has them
        s_mine, s_theirs = make_session(path, device, 1), make_session(tmp / specs["base"].file, device, 1)
        pairs = [(row_logits(path, specs["base"], source["vocab_size"], kv_dims=dims, seed=seed, session=s_mine,
                             sizes=row_sizes(seed)),
                  row_logits(tmp / specs["base"].file, specs["base"], source["vocab_size"], kv_dims=dims, seed=seed,
                             session=s_theirs, sizes=row_sizes(seed))) for seed in range(row_seeds(opts))]
    except Exception as e:  # a kernel this onnxruntime lacks, or one that refuses this model's shapes
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return _drop_one_sequence(path, base, f"ONNX Runtime cannot run it here: {detail}", log)
    worst = max(r.max_abs for r in rows if r.output == C.LOGITS)
    bad = [r for r in rows if not r.ok]
    if bad:
        r = bad[0]
        return _drop_one_sequence(path, base, f"{r.output} in case {r.case} differs from the raw trace by "
                                              f"{r.max_abs:.3g} > {r.limit:.3g}", log)
    ceiling = None
    if theirs_raw is not None:
        # int8 activations gate nothing below on the two graphs' distance (another kernel is another
        # last bit, now and then a quantization step), so a graph that computes something else is
        # caught here: no further from the float trace than the quantized base is, on the same calls
        ceiling = 2 * max(r.max_abs for r in theirs_raw if r.output == C.LOGITS) + atol
        if worst > ceiling:
            return _drop_one_sequence(path, base, f"its logits are {worst:.3g} from the raw float32 trace, more than "
                                                  f"twice the quantized base's distance ({ceiling:.3g})", log)
    min_rows = base.get("min_rows", 1)
    owns = [consistency(mine) for mine, _ in pairs]
    single, multi = max(o["single"] for o in owns), max(o["multi"] for o in owns)
    own_tree = max(o["tree"] for o in owns)
    if multi > atol and device == "cpu":  # a device's kernels pick tiles by row count: recorded (check_rows)
        return _drop_one_sequence(path, base, f"a token's logits differ by {multi:.3g} between its calls of 2+ rows",
                                  log)
    theirs_rec = rows_record or {}
    cross_tree = max(float(np.abs(mine["tree"] - theirs["tree"]).max()) for mine, theirs in pairs)
    trees = max(own_tree, cross_tree, theirs_rec.get("tree_max_abs", 0.0))
    if min_rows == 1 and pads_one_row(single, trees, atol):
        min_rows = 2
    # the two graphs on the same calls (chains from min_rows rows, and the tree), gated as the rows
    # check gates chains; with int8 activations recorded (parity.ROW_SEEDS_INT8), the ceiling above
    # standing for the gate
    cross = max(float(np.abs(mine[m] - theirs[m]).max()) for mine, theirs in pairs for m in mine
                if m != "tree" and m >= min_rows)
    if max(cross, cross_tree) > atol and not int8_activations(opts) and device == "cpu":
        return _drop_one_sequence(path, base, f"a token's logits differ from the base's by "
                                              f"{max(cross, cross_tree):.3g} > {atol:g}", log)
    top1 = min((r.top1 for r in rows if r.top1 is not None), default=None)
    one.update({"parity_max_abs_logits": worst, "min_top1": top1, "single_max_abs": single, "multi_max_abs": multi,
                "tree_max_abs": own_tree, "vs_base_max_abs": cross, "vs_base_tree_max_abs": cross_tree,
                "chains": len(pairs), "rows_provider": device,
                **({} if ceiling is None else {"vs_raw_ceiling": ceiling})})
    base["min_rows"] = min_rows
    # the bound a token's logits obey whichever call computes them (calls alternate between the graphs):
    # a one-row step on either graph, across to the other graph's chain, to a tree there
    # (``rows_record``: the base's rows check, whose one-row figure is the same kind as this graph's)
    base["rows_max_abs"] = rows_bound(max(single, theirs_rec.get("single_max_abs", 0.0)),
                                      [theirs_rec.get("multi_max_abs", 0.0), theirs_rec.get("tree_max_abs", 0.0),
                                       multi, own_tree, cross_tree], min_rows, across=cross)
    if rows_record is not None:  # the contract now covers both graphs' calls
        rows_record.update({"one_sequence_single_max_abs": single if min_rows == 1 else 0.0,
                            "one_sequence_tree_max_abs": own_tree, "vs_base_max_abs": cross,
                            "vs_base_tree_max_abs": cross_tree, "min_rows": min_rows})
        set_contract(rows_record, base["rows_max_abs"], log, "both graphs' calls",
                     fix=LEVEL0_FIX if int8_activations(opts) else "")
    log(f"  [base] one-seq   vs raw{'' if strict else ' float32 (quantized: reported)'}: max |logits diff| "
        f"{worst:.2e}; rows: alone {single:.1e}, 2+ rows {multi:.1e}, a tree's path {own_tree:.1e}; vs the base "
        f"{cross:.1e}, a tree's path {cross_tree:.1e} ({'recorded' if int8_activations(opts) else f'limit {atol:g}'}; "
        f"{len(pairs)} chains, calls of every size on the first 8): ok")
    return one


def _drop_one_sequence(path: Path, base: dict, why: str, log) -> dict:
    path.unlink(missing_ok=True)
    del base["one_sequence"]
    base["files"] = [f for f in base.get("files", []) if f != path.name]
    log(f"  [base] one-seq   dropped: {why}; every call runs the base graph")
    return {"dropped": why}


def _not_on_cpu(e: Exception, role: str, opts: OptimizeOptions, log) -> dict:
    """A parity run that raised: a float16 graph the CPU EP has no kernels for is left to the GPU check
    (the returned record says so); anything else is an error and the export stays untouched."""
    if not opts.use_float16 or "NOT_IMPLEMENTED" not in str(e):
        raise UserError(f"optimized {role} graph does not run on ONNX Runtime's CPU EP "
                        f"({str(e).splitlines()[0][:200]}); the export is untouched") from None
    log(f"  [{role}] parity    skipped: the CPU EP has no float16 kernels for it (check on the GPU)")
    return {"skipped": "no float16 CPU kernels; check on the GPU with python -m exporter.compare --provider cuda"}


def _validate_tree(out_dir: Path, tmp: Path, manifest: Manifest, specs: dict, role: str, opts: OptimizeOptions,
                   log) -> dict:
    """Raw vs rewritten one-call tree graph. float32: the same tree (tokens, parents, depths, mask
    identical), scores and drafter K/V within 1e-4. float16: the context rows' drafter K/V within
    2e-2, the tree reported (float16 log-probs may order near-ties otherwise). Quantized: reported,
    not gated (another drafter). Drafts never change greedy output: the base verifies them."""
    from exporter.passes.parity import tree_parity

    quantized = opts.quant_for(role) != "none"
    strict = not quantized and not opts.use_float16
    atol, rtol = parity_tolerance(opts)
    try:
        rows = tree_parity(out_dir / manifest.graphs[role].file, tmp / specs[role].file, manifest.graphs[role],
                           specs[role], atol, rtol, vocab=manifest.source["vocab_size"], strict=strict,
                           strict_kv=not quantized)
    except Exception as e:
        return _not_on_cpu(e, role, opts, log)
    bad = [r for r in rows if not r.ok]
    tokens = min(r.top1 for r in rows if r.output == C.TREE_TOKENS)
    scores = max(r.max_abs for r in rows if r.output == C.TREE_SCORES)
    what = ("vs raw" if strict else "vs raw float32 (K/V gated, tree reported)" if not quantized
            else "vs raw float32 (quantized: reported, not gated)")
    log(f"  [{role}] parity    {what}: tree tokens equal {tokens:.3f}, max |scores diff| {scores:.2e}, "
        f"{len(rows)} outputs x cases: {'ok' if not bad else 'FAIL'}")
    if bad:
        r = bad[0]
        raise UserError(f"optimized {role} graph drafts another tree than the raw one: {r.output} in case {r.case} "
                        f"(max abs error {r.max_abs:.3g} > {r.limit:.3g}); the export is untouched")
    return {"tree_tokens_equal": tokens, "max_abs_scores": scores, "ok": not bad,
            "rows": [dataclasses.asdict(r) for r in rows]}


def time_gain(out_dir: Path, tmp: Path, manifest: Manifest, specs: dict, log) -> dict:
    """Median latency of the raw and the rewritten base graph at 1 and 8 tokens over a 64-token past."""
    from exporter.passes.parity import Case, random_feed, rewritten_feed
    from graphs.sessions import make_session

    gains = {}
    try:
        raw, new = (make_session(out_dir / manifest.graphs["base"].file, "cpu"),
                    make_session(tmp / specs["base"].file, "cpu"))
    except Exception:
        return {"skipped": "the rewritten base does not run on the CPU EP"}
    from graphs.sessions import InPlaceRun

    calls = (InPlaceRun.caller(raw, manifest.graphs["base"]), InPlaceRun.caller(new, specs["base"]))
    for t in (1, 8):
        feed = random_feed(manifest.graphs["base"], Case("t", 1, t, 64), vocab=manifest.source["vocab_size"])
        new_feed, _ = rewritten_feed(feed, specs["base"])
        ms = []
        for run, f in zip(calls, (feed, new_feed)):
            run(f)
            ts = []
            for _ in range(7):
                t0 = time.perf_counter()
                run(f)
                ts.append(time.perf_counter() - t0)
            ms.append(float(np.median(ts)) * 1e3)
        gains[f"{t}_tokens"] = {"raw_ms": ms[0], "optimized_ms": ms[1], "speedup": ms[0] / ms[1]}
    log("  [base] gain      " + ", ".join(f"{k.replace('_', ' ')}: {v['raw_ms']:.2f} -> {v['optimized_ms']:.2f} ms "
                                           f"({v['speedup']:.2f}x)" for k, v in gains.items())
        + " (CPU EP, one rough timing)")
    return gains


def optimize_graphs(out_dir: Path, tmp: Path, manifest: Manifest, options: OptimizeOptions,
                    log=print) -> tuple[dict[str, C.GraphSpec], dict[str, dict]]:
    """Rewrite every graph of the export in ``out_dir`` that ``options`` changes into ``tmp``.

    Returns (the new specs of every role, the ``optimization`` record of each rewritten role). The
    one-call EAGLE tree graphs (draft_tree.*) get the draft graph's passes: their drafter forwards
    are the draft graph's, unrolled (fused, quantized, float16 with the drafter K/V in the cache dtype).
    """
    specs = {role: optimized_spec(spec, options.use_float16) for role, spec in manifest.graphs.items()}
    records = {}
    for role in manifest.graphs:
        if is_traced(role):
            records[role] = optimize_graph(out_dir / manifest.graphs[role].file, tmp / specs[role].file, role,
                                           options, log, source=manifest.source)
            layout = records[role]["fused"].get("kv_layout")
            if layout:
                specs[role] = C.inplace_base_spec(specs[role], layout)
        elif options.use_float16:  # K/V updates: the cache dtype
            from exporter.kvgraph import build_kv_update

            build_kv_update(specs[role], tmp / specs[role].file, opset=manifest.opset)
            records[role] = {"passes": ["float16"], "target": options.target,
                             "provider": TARGETS[options.target], "dtype": "float16", "quantization": None}
    return specs, records


def rewritten_files(out_dir: Path, manifest: Manifest, options: OptimizeOptions) -> set[str]:
    """The export's files (relative paths) that :func:`optimize_graphs` writes anew."""
    return {p.relative_to(out_dir).as_posix() for role in manifest.graphs
            for p in graph_files(out_dir, manifest.graphs[role]) if is_traced(role) or options.use_float16}
