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
    fill_types(proto)
    return convert_float_to_float16(proto, keep_io_types=keep, op_block_list=DEFAULT_OP_BLOCK_LIST + KEEP_FLOAT32,
                                    disable_shape_infer=True)


# outputs whose element type is not their first input's (the rule for every other op in these graphs)
_BOOL_OPS = {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN", "IsInf"}
_INT64_OPS = {"Shape", "Size", "NonZero", "ArgMax", "ArgMin"}


def fill_types(proto: onnx.ModelProto) -> int:
    """Give every untyped node output of ``proto`` a value_info with its element type; returns how many.

    The converter places its Casts around the float32 islands (the norms, softmax) by the tensors'
    element types, so every tensor needs one. Hand-written because neither inference gives them
    here: ONNX's stops at ORT's contrib ops (the fused norms), ORT's symbolic shape inference
    mistakes the ONNX ``Attention`` op for its contrib ``Attention`` (and fails on ``value_ints``
    constants), and the K/V-in-place pass writes its nodes untyped. Types only, no shapes: a walk in
    node order (the graphs are sorted) with the rules above, ``Cast``'s ``to``, ``Constant``'s value,
    ``Where``'s second input, ``TopK``'s int64 indices, and the first input's type for the rest."""
    g = proto.graph
    types = {t.name: t.type.tensor_type.elem_type for t in [*g.input, *g.value_info, *g.output]
             if t.type.tensor_type.elem_type}
    types.update({t.name: t.data_type for t in g.initializer})
    added, before = 0, -1
    while added != before:  # a second walk where a node came before its inputs' producers
        before = added
        for node in g.node:
            added += _type_outputs(node, types, g)
    return added


def _type_outputs(node, types: dict, g) -> int:
    attrs = {a.name: a for a in node.attribute}
    first = next((types[x] for x in node.input if x and x in types), 0)
    n = 0
    for i, out in enumerate(node.output):
        if not out or out in types:
            continue
        if node.op_type == "Cast":
            t = attrs["to"].i
        elif node.op_type == "Constant":
            a = node.attribute[0]
            t = (a.t.data_type if a.name == "value" else TensorProto.INT64 if a.name.startswith("value_int")
                 else TensorProto.FLOAT if a.name.startswith("value_float") else 0)
        elif node.op_type == "ConstantOfShape":
            t = attrs["value"].t.data_type if "value" in attrs else TensorProto.FLOAT
        elif node.op_type in _BOOL_OPS:
            t = TensorProto.BOOL
        elif node.op_type in _INT64_OPS or (node.op_type == "TopK" and i == 1):
            t = TensorProto.INT64
        elif node.op_type == "Where":
            t = types.get(node.input[1], 0)
        else:
            t = first
        if t:
            types[out] = t
            g.value_info.append(helper.make_tensor_value_info(out, t, None))
            n += 1
    return n
