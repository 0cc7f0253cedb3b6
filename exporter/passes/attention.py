"""Eager attention -> the standard ONNX ``Attention`` op (opset 23), which honours any mask.

The traced graphs compute attention the way HF's eager kernel does, with grouped K/V repeated to
the query heads first (``repeat_kv``)::

    key ─ Unsqueeze(2) ─ Expand ─ Reshape ─ Transpose(0,1,3,2) ─┐
    query ─────────────────────────────────────────────────────  MatMul ─ Mul(scale) ─ Add(mask) ─ Softmax ─┐
    value ─ Unsqueeze(2) ─ Expand ─ Reshape ─────────────────────────────────────────────────────────────  MatMul ─▶ out

(``repeat_kv`` is absent when K/V have as many heads as the query.) It becomes one node::

    Attention(query, key, value, attn_mask=mask, scale=scale) ─▶ out      # (B, q_heads, S, head_dim)

The ONNX op groups query heads onto K/V heads exactly as ``repeat_kv`` does (query head h reads K/V
head h // (q_heads / kv_heads)) and adds the float mask to the scaled scores before the softmax, so
a non-causal tree mask, holes in a batch's cache and a past all mean what they meant before.
Measured exact on ORT's CPU EP (tests/test_optimize.py). What this pass never emits:
``GroupQueryAttention`` (com.microsoft), which ignores a non-causal mask (logits off by 0.1-0.4
under a tree), the kernel onnxscript's stock ``optimize_for_ort`` fuses Llama attention into.

Hand-written because no library rule targets the ONNX ``Attention`` op from this pattern:
onnxscript's ``SDPA`` rule needs K/V already repeated and maps to MHA/GQA.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

ATTENTION_OPSET = 23  # the first ONNX opset with Attention


def _const_ints(value: ir.Value | None) -> list[int] | None:
    if value is None or value.const_value is None:
        return None
    return [int(x) for x in np.asarray(value.const_value.numpy()).reshape(-1)]


class EagerToAttention(pattern.RewriteRuleClassBase):
    def pattern(self, op, query, key, value, mask, scale, k_axes, v_axes):
        k = pattern.OrValue([op.Reshape(op.Expand(op.Unsqueeze(key, k_axes), pattern.ANY_VALUE), pattern.ANY_VALUE),
                             key], tag_var="k_repeated", tag_values=[True, False])
        v = pattern.OrValue([op.Reshape(op.Expand(op.Unsqueeze(value, v_axes), pattern.ANY_VALUE), pattern.ANY_VALUE),
                             value], tag_var="v_repeated", tag_values=[True, False])
        scores = op.MatMul(query, op.Transpose(k, perm=[0, 1, 3, 2]))  # (B, H, S, T)
        weights = op.Softmax(op.Add(op.Mul(scores, scale), mask), axis=-1)
        return op.MatMul(weights, v)  # (B, H, S, head_dim)

    def check(self, context, query, key, value, mask, scale, k_axes=None, v_axes=None,
              k_repeated=False, v_repeated=False, **_):
        result = pattern.MatchResult()
        if k_repeated != v_repeated:
            return result.fail("K repeated for GQA but V not (or the reverse)")
        if k_repeated and (_const_ints(k_axes) != [2] or _const_ints(v_axes) != [2]):
            return result.fail("K/V repeat is not HF's repeat_kv (Unsqueeze at axis 2)")
        s = scale.const_value
        if s is None or s.numpy().size != 1:
            return result.fail("attention scale is not a constant scalar")
        for v in (query, key, value):
            if v.shape is not None and len(v.shape) != 4:
                return result.fail("query/key/value are not 4-D (B, heads, S, head_dim)")
        return result

    def rewrite(self, op, query, key, value, mask, scale, **_):
        return op.Attention(query, key, value, mask, scale=float(scale.const_value.numpy().reshape(-1)[0]),
                            _version=ATTENTION_OPSET)


def fuse_attention(model: ir.Model) -> int:
    """Rewrite every eager attention of ``model`` (opset >= 23) in place; returns how many."""
    rules = pattern.RewriteRuleSet([EagerToAttention.rule()])
    return rules.apply_to_model(model)
