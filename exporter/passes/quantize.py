"""Weight-only quantization of every MatMul with a constant weight: ORT's ``MatMulNBitsQuantizer``.

    MatMul(x, W float32 (K, N))  =>  MatMulNBits(x, W_q uint8 blocks, scales, bits=4|8, block_size)

Block-wise symmetric quantization along K; activations stay float. ``accuracy_level=4`` lets the
CPU kernel quantize activations to int8 on the fly for an int8 dot product (the fast path on x86
and ARM); on CUDA it is ignored. The base graph (lm_head included) and the drafter (an EAGLE
drafter's lm_head is most of its cost) are quantized; the K/V update graphs have no weights. The
token embedding is a Gather, not a MatMul, and stays float.
"""

from __future__ import annotations

import logging

import onnx


def quantize_weights(proto: onnx.ModelProto, bits: int, block_size: int = 32,
                     accuracy_level: int | None = 4) -> tuple[onnx.ModelProto, int]:
    """Returns (quantized model, number of MatMuls quantized). Weights must be in memory."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    before = sum(1 for n in proto.graph.node if n.op_type == "MatMul")
    q = MatMulNBitsQuantizer(proto, bits=bits, block_size=block_size, is_symmetric=True,
                             accuracy_level=accuracy_level)
    q.process()
    out = q.model.model
    _dedupe_initializers(out)
    after = sum(1 for n in out.graph.node if n.op_type == "MatMul")
    return out, before - after


def _dedupe_initializers(proto: onnx.ModelProto) -> None:
    """One copy of each quantized weight. The quantizer writes ``W_Q4``/``W_scales`` once per MatMul that
    reads ``W``; a one-call tree graph (exporter.eagle_tree) reads each drafter weight once per unrolled
    drafter forward, and ONNX wants initializer names unique. Same name, same source weight, same bytes."""
    seen: set[str] = set()
    keep = []
    for t in proto.graph.initializer:
        if t.name not in seen:
            seen.add(t.name)
            keep.append(t)
    if len(keep) != len(proto.graph.initializer):
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(keep)
