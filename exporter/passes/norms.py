"""RMSNorm -> ``SimplifiedLayerNormalization``; residual Add + RMSNorm -> ``SkipSimplifiedLayerNormalization``.

ONNX Runtime's own fusions (``onnxruntime.transformers``), applied offline::

    x ─ Pow(2) ─ ReduceMean ─ Add(eps) ─ Sqrt ─ Div(1, .) ─ Mul(x, .) ─ Mul(weight) ─▶ y
        => SimplifiedLayerNormalization(x, weight, epsilon)

    residual ─┐
    branch ───  Add ─▶ SimplifiedLayerNormalization ─▶ y        (and the sum flows on)
        => SkipSimplifiedLayerNormalization(branch, residual, weight) ─▶ y, sum

Both are per-position operations, so a tree mask cannot change their meaning. ORT's stock skip
fusion needs its symbolic shape inference, which does not know opset 23's ``Attention``; we run it
with ``shape_infer=False``: it then assumes the Add's inputs have the same shape (B, S, hidden),
true of every residual Add in these decoders, and the optimize stage's parity check (raw vs fused
on random tree/batch/past cases) is what proves it for each graph.
"""

from __future__ import annotations

import logging

import onnx


def fuse_norms(proto: onnx.ModelProto) -> dict[str, int]:
    """Fuse in place; returns {op type: count}. Run after onnxscript's optimizer has removed the
    trace's no-op float32 Casts around each norm."""
    from onnxruntime.transformers.fusion_simplified_layernorm import FusionSimplifiedLayerNormalization
    from onnxruntime.transformers.fusion_skiplayernorm import FusionSkipLayerNormalization
    from onnxruntime.transformers.onnx_model import OnnxModel

    for name in ("fusion_base", "onnx_model", "fusion_utils", "fusion_skiplayernorm"):
        logging.getLogger(name).setLevel(logging.WARNING)  # we print our own summary
    model = OnnxModel(proto)
    model.disable_shape_inference()  # ORT's symbolic shape inference does not know opset 23 Attention
    FusionSimplifiedLayerNormalization(model).apply()
    FusionSkipLayerNormalization(model, "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization",
                                 shape_infer=False).apply()
    model.prune_graph(allow_remove_graph_inputs=False)
    model.topological_sort()
    counts = {}
    for node in model.model.graph.node:
        if node.op_type in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts
