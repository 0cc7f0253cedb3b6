"""The optimize stage: tree-safe fusions, float16 for GPUs, int4/int8 weight-only graphs.

    specs, records = optimize_graphs(out_dir, tmp, manifest, options)   rewritten graphs into tmp
    check_parity(out_dir, tmp, manifest, specs, options)                 raw vs rewritten, a gate

The passes per graph live here; the gates in :mod:`exporter.optimize_gates`, the options in
:mod:`exporter.optimize_options` (both re-exported: this module stays the stage's API).

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
from pathlib import Path

from exporter.errors import UserError
from exporter.optimize_gates import (  # noqa: F401 (the stage's API, as before the split)
    LEVEL0_FIX,
    check_one_sequence,
    check_parity,
    check_rows,
    dflash_feeds,
    int8_activations,
    pads_one_row,
    parity_tolerance,
    row_seeds,
    row_sizes,
    rows_bound,
    rows_provider,
    set_contract,
    time_gain,
    within_bound,
)
from exporter.optimize_options import QUANTIZE, TARGETS, TUNE_BUDGET_S, OptimizeOptions  # noqa: F401
from exporter.plan import is_traced
from graphs import contract as C
from graphs.manifest import Manifest

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


def optimize_graphs(out_dir: Path, tmp: Path, manifest: Manifest, options: OptimizeOptions,
                    log=print) -> tuple[dict[str, C.GraphSpec], dict[str, dict]]:
    """Rewrite every graph of the export in ``out_dir`` that ``options`` changes into ``tmp``.

    Returns (the new specs of every role, the ``optimization`` record of each rewritten role). The
    one-call EAGLE tree graphs (draft_tree.*) get the draft graph's passes: their drafter forwards
    are the draft graph's, unrolled (fused, quantized, float16 with the drafter K/V in the cache dtype).
    """
    # the K/V update graphs of older exports are read by nothing (graphs.device moves K/V with its own
    # graphs): dropped here; the device path's graphs are built anew below
    roles = [r for r in manifest.graphs if is_traced(r)]
    specs = {role: optimized_spec(manifest.graphs[role], options.use_float16) for role in roles}
    records = {}
    for role in roles:
        records[role] = optimize_graph(out_dir / manifest.graphs[role].file, tmp / specs[role].file, role,
                                       options, log, source=manifest.source)
        layout = records[role]["fused"].get("kv_layout")
        if layout:
            specs[role] = C.inplace_base_spec(specs[role], layout)
    if C.kv_in_place(specs["base"]):  # the device path's small graphs (graphs.device), for this base
        from exporter.kvgraph import DEVICE_OPSET, build_device_graphs

        built = build_device_graphs(specs["base"], tmp, specs.get("draft"))
        log(f"  [device]  built {', '.join(s.file for s in built.values())} (graphs.device)", flush=True)
        for role, spec in built.items():
            specs[role] = spec
            records[role] = {"passes": ["device"], "target": options.target, "provider": TARGETS[options.target],
                             "dtype": specs["base"].output(C.LOGITS).dtype, "quantization": None,
                             "opset": DEVICE_OPSET}
    return specs, records


def rewritten_files(out_dir: Path, manifest: Manifest, options: OptimizeOptions) -> set[str]:
    """The export's files (relative paths) that :func:`optimize_graphs` writes anew."""
    return {p.relative_to(out_dir).as_posix() for role in manifest.graphs
            for p in graph_files(out_dir, manifest.graphs[role])}  # (K/V update graphs: dropped)
