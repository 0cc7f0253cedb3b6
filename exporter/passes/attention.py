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

The DFlash drafter's attention (exporter.speculative.dflash.block_attention) scores the block's
queries against two key sets, the context (cached + new rows) and the block's own, and takes one
softmax over both::

    query ─ MatMul(Transpose(repeat(k_ctx))) ─ Mul(scale) ─ Add(mask_ctx) ─┐
    query ─ MatMul(Transpose(repeat(k_blk))) ─ Mul(scale) ─ Add(mask_blk) ─ Concat(-1) ─ Softmax ─┐
        ┌─ Slice[0:c] ─ MatMul(repeat(v_ctx)) ─┐                                                   │
        └─ Slice[c:]  ─ MatMul(repeat(v_blk)) ─ Add ─▶ out      (both Slices read the Softmax) ◀──┘

which is one attention over the concatenated keys, values and masks (the softmax's columns are the
context's then the block's; the Slices split them where the Concat joined them: the first starts at
0, the second runs to the end, both at the context keys' length, which the trace reads from their
shape: ``Unsqueeze(Gather(Shape(repeat(k_ctx)), 2))``, part of the matched pattern)::

    Attention(query, Concat(k_ctx, k_blk, 2), Concat(v_ctx, v_blk, 2),
              attn_mask=Concat(mask_ctx, mask_blk, -1), scale=scale) ─▶ out

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


def _repeated(op, x, axes, tag: str):
    """``x`` or HF's ``repeat_kv(x)`` (Unsqueeze(2), Expand, Reshape); ``tag`` names which."""
    return pattern.OrValue([op.Reshape(op.Expand(op.Unsqueeze(x, axes), pattern.ANY_VALUE), pattern.ANY_VALUE), x],
                           tag_var=tag, tag_values=[True, False])


INT64_END = 1 << 31  # a Slice end at or past this runs to the end of the axis (the trace writes INT64_MAX)


class BlockAttentionToAttention(pattern.RewriteRuleClassBase):
    """DFlash's two-key-set attention (module docstring) -> one ``Attention`` over both."""

    def pattern(self, op, query, k_ctx, v_ctx, k_blk, v_blk, mask_ctx, mask_blk, scale_ctx, scale_blk,
                kc_axes, vc_axes, kb_axes, vb_axes, key_axis, split_axes, start_ctx, end_blk, axes_ctx, axes_blk,
                steps_ctx, steps_blk):
        def scores(k, scale, mask):  # (B, H, S, T)
            return op.Add(op.Mul(op.MatMul(query, op.Transpose(k, perm=[0, 1, 3, 2])), scale), mask)

        kc = _repeated(op, k_ctx, kc_axes, "kc_rep")  # (B, H, c, d)
        p = op.Softmax(op.Concat(scores(kc, scale_ctx, mask_ctx),
                                 scores(_repeated(op, k_blk, kb_axes, "kb_rep"), scale_blk, mask_blk), axis=-1),
                       axis=-1)
        # the split column: the context keys' length, read from their shape as the trace does
        c = op.Unsqueeze(op.Gather(op.Shape(kc, _allow_other_attributes=False), key_axis, axis=0), split_axes)
        p_ctx = op.Slice(p, start_ctx, c, axes_ctx, steps_ctx)  # (B, H, S, c)
        p_blk = op.Slice(p, c, end_blk, axes_blk, steps_blk)  # (B, H, S, b)
        return op.Add(op.MatMul(p_ctx, _repeated(op, v_ctx, vc_axes, "vc_rep")),
                      op.MatMul(p_blk, _repeated(op, v_blk, vb_axes, "vb_rep")))

    def check(self, context, query, k_ctx, v_ctx, k_blk, v_blk, mask_ctx, mask_blk, scale_ctx, scale_blk,
              key_axis, split_axes, start_ctx, end_blk, axes_ctx, axes_blk, steps_ctx, steps_blk,
              kc_rep=False, vc_rep=False, kb_rep=False, vb_rep=False, kc_axes=None, vc_axes=None, kb_axes=None,
              vb_axes=None, **_):
        result = pattern.MatchResult()
        if len({kc_rep, vc_rep, kb_rep, vb_rep}) != 1:
            return result.fail("some of the four K/V sets are repeated for GQA and some not")
        if kc_rep and any(_const_ints(a) != [2] for a in (kc_axes, vc_axes, kb_axes, vb_axes)):
            return result.fail("K/V repeat is not HF's repeat_kv (Unsqueeze at axis 2)")
        scales = [s.const_value for s in (scale_ctx, scale_blk)]
        if any(s is None or s.numpy().size != 1 for s in scales):
            return result.fail("attention scale is not a constant scalar")
        if float(scales[0].numpy().reshape(-1)[0]) != float(scales[1].numpy().reshape(-1)[0]):
            return result.fail("the two score blocks are scaled differently")
        # the Slices split the softmax where the Concat joined it: [0:c] and [c:end] on the last axis
        if _const_ints(steps_ctx) != [1] or _const_ints(steps_blk) != [1]:
            return result.fail("a softmax Slice has steps other than 1")
        if _const_ints(start_ctx) != [0]:
            return result.fail("the context Slice does not start at column 0")
        end = _const_ints(end_blk)
        if end is None or end[0] < INT64_END:
            return result.fail("the block Slice does not run to the last column")
        if _const_ints(key_axis) not in ([2], [-2]) or _const_ints(split_axes) != [0]:
            return result.fail("the softmax is not split at the context keys' length (their shape's axis 2)")
        if any(_const_ints(a) not in ([-1], [3]) for a in (axes_ctx, axes_blk)):
            return result.fail("the softmax Slices are not on the key axis")
        for v in (query, k_ctx, v_ctx, k_blk, v_blk, mask_ctx, mask_blk):
            if v.shape is not None and len(v.shape) != 4:
                return result.fail("query/key/value/mask are not 4-D")
        return result

    def rewrite(self, op, query, k_ctx, v_ctx, k_blk, v_blk, mask_ctx, mask_blk, scale_ctx, **_):
        key = op.Concat(k_ctx, k_blk, axis=2)  # (B, kv_heads, c + b, head_dim)
        value = op.Concat(v_ctx, v_blk, axis=2)
        mask = op.Concat(mask_ctx, mask_blk, axis=-1)  # (B, 1, S, c + b): the scores' own additive masks
        return op.Attention(query, key, value, mask, scale=float(scale_ctx.const_value.numpy().reshape(-1)[0]),
                            _version=ATTENTION_OPSET)


def fuse_attention(model: ir.Model) -> int:
    """Rewrite every eager attention of ``model`` (opset >= 23) in place, the DFlash drafter's two-key-set
    form included; returns how many."""
    rules = pattern.RewriteRuleSet([EagerToAttention.rule(), BlockAttentionToAttention.rule()])
    return rules.apply_to_model(model)
