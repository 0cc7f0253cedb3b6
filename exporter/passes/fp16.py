"""float16 for GPUs, by onnxruntime.transformers' converter, with the sensitive ops kept float32.

Kept in float32 (the converter puts Casts around them): the norms (``SimplifiedLayerNormalization``,
``SkipSimplifiedLayerNormalization`` and an unfused RMSNorm's ``ReduceMean``/``Pow``/``Sqrt``),
``Softmax`` and ``LogSoftmax`` (the drafter's top-k scores), and the converter's default list
(``TopK``, ``Range``, ...). The fused ``Attention`` op runs in float16 with its softmax in float32
(``softmax_precision=1``). Graph I/O follows the contract of a float16 export: float tensors
become float16 except ``topk_logprobs`` and ``tree_scores``, which the contract keeps float32.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from graphs import contract as C

KEEP_FLOAT32 = ["SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "ReduceMean", "Pow", "Sqrt",
                "Softmax", "LogSoftmax"]


def to_float16(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Convert in memory (weights loaded). Returns the float16 model."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    for node in proto.graph.node:
        if node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
            node.attribute.append(helper.make_attribute("softmax_precision", TensorProto.FLOAT))
    keep = [o.name for o in proto.graph.output if o.name in (C.TOPK_LOGPROBS, C.TREE_SCORES)]
    # The converter needs ONNX shape inference to place its Casts around float32 islands (an unfused
    # RMSNorm); ONNX's inference does not know ORT's contrib ops, present only once norms are fused,
    # and then every float32 island is one fused node with known I/O types.
    contrib = any(n.domain == "com.microsoft" for n in proto.graph.node)
    return convert_float_to_float16(proto, keep_io_types=keep, op_block_list=DEFAULT_OP_BLOCK_LIST + KEEP_FLOAT32,
                                    disable_shape_infer=contrib)
