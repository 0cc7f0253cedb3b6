"""HF's rotary embedding (``apply_rotary_pos_emb``) -> the ONNX ``RotaryEmbedding`` op (opset 23).

The trace applies rotary to the query and to the key of every layer with a dozen nodes::

    x (B, heads, S, hd) ─ Slice[0:hd/2] ──────────┐
      └─────────────── Slice[hd/2:] ─ Neg ─ Concat(-x2, x1) ─ Mul(sin ─ Unsqueeze(1)) ─┐
      └──────────────────────────── Mul(cos ─ Unsqueeze(1)) ───────────────────────── Add ─▶ y

with ``hd/2`` computed from ``Shape(x)``. It becomes one node, fed the first half of the per-position
cos/sin the graph already computes from ``position_ids`` (HF's ``cos = cat(freqs, freqs).cos()``,
so its two halves are equal and nothing is lost)::

    RotaryEmbedding(x, cos[..., :hd/2], sin[..., :hd/2])   # interleaved=0, no position_ids

Rotary is per position and reads the graph's own position ids, so a tree's positions (cache length
+ depth, repeated across siblings) mean what they meant before. Hand-written because onnxscript's
rotary rules need a static head size, which the trace's dynamic shapes do not carry, and target
ORT's contrib op, which wants a cos/sin cache indexed by position instead of per-position values.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern


def _ints(v: ir.Value | None) -> list[int] | None:
    if v is None or v.const_value is None:
        return None
    return [int(x) for x in np.asarray(v.const_value.numpy()).reshape(-1)]


def _is_half_last_dim(half: ir.Value, x: ir.Value) -> bool:
    """``half`` = Unsqueeze(Div(Gather(Shape(x), 3), 2), [0]): hd // 2 of ``x`` at run time, or that
    computation folded to a constant where ``x``'s head_dim is static (the one-call tree graphs are
    constant-folded at export, exporter.eagle_tree.simplify_traced)."""
    folded = _ints(half)
    if folded is not None:
        hd = x.shape[-1] if x.shape is not None and len(x.shape) == 4 else None
        return isinstance(hd, int) and folded == [hd // 2] and hd % 2 == 0
    chain = []
    v = half
    for op in ("Unsqueeze", "Div", "Gather", "Shape"):
        node = v.producer() if v is not None else None
        if node is None or node.op_type != op:
            return False
        chain.append(node)
        v = node.inputs[0]
    unsq, div, gather, shape = chain
    return (v is x and _ints(unsq.inputs[1]) == [0] and _ints(div.inputs[1]) == [2]
            and _ints(gather.inputs[1]) in ([3], [-1]) and not shape.attributes)


class RotaryHalfToRotaryEmbedding(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, cos_b, sin_b, zero, half, end, axes, steps):
        # cos_b, sin_b: (B, 1, S, hd), Unsqueeze(cos, 1) shared by the query and the key: not matched
        # as part of the pattern (a shared node cannot be removed), checked in ``check``
        x1 = op.Slice(x, zero, half, axes, steps)  # (B, H, S, hd/2)
        x2 = op.Slice(x, half, end, axes, steps)
        rotated = op.Concat(op.Neg(x2), x1, axis=-1)
        return op.Add(op.Mul(x, cos_b), op.Mul(rotated, sin_b))

    def check(self, context, x, cos_b, sin_b, zero, half, end, axes, steps, **_):
        result = pattern.MatchResult()
        if _ints(zero) != [0] or _ints(axes) not in ([3], [-1]) or _ints(steps) != [1]:
            return result.fail("not a split of the last axis at 0")
        if (_ints(end) or [0])[0] < (1 << 31):
            return result.fail("second half does not run to the end")
        if not _is_half_last_dim(half, x):
            return result.fail("split point is not head_dim // 2 of x")
        for v in (cos_b, sin_b):
            node = v.producer()
            if node is None or node.op_type != "Unsqueeze" or _ints(node.inputs[1]) != [1]:
                return result.fail("cos/sin are not (B, S, head_dim) broadcast over heads")
            if node.inputs[0].shape is not None and len(node.inputs[0].shape) != 3:
                return result.fail("cos/sin are not (B, S, head_dim)")
        return result

    def rewrite(self, op, x, cos_b, sin_b, zero, half, steps, **_):
        last = op.Constant(value_ints=[2])
        cos_h = op.Slice(cos_b.producer().inputs[0], zero, half, last, steps)  # (B, S, hd/2)
        sin_h = op.Slice(sin_b.producer().inputs[0], zero, half, last, steps)
        return op.RotaryEmbedding(x, cos_h, sin_h, _version=23)


def fuse_rotary(model: ir.Model) -> int:
    """Rewrite every rotary application of ``model`` (opset >= 23) in place; returns how many."""
    return pattern.RewriteRuleSet([RotaryHalfToRotaryEmbedding.rule()]).apply_to_model(model)
