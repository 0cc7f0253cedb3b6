"""The whole EAGLE-2 draft tree in one graph call (``draft_tree.{topk}-{depth}-{total}.onnx``).

The step-wise runtime calls the drafter 1 + ``depth`` times per decode step and grows the tree in
numpy between calls (:class:`graphs.trees.DynamicTreeBuilder`). This module traces the same
computation as one graph, for a ``(topk, depth, total_tokens)`` fixed at export, with the loop
over depth unrolled::

    context rows --drafter--> K/V of the rows (out), root output = row root_index
      layer 1: top-k of the root's logits                    scores = log-probs (the head runs on
                                                             the root row alone: no other row's
                                                             logits are read)
      repeat depth times:
        frontier = best topk nodes of the newest layer        (all of layer 1 first)
        drafter(frontier: hidden = output at the parent, token, position root + depth,
                mask = the root's context row + fed ancestors + itself)   tree K/V stay inside
        children = top-k of each frontier row                 score = parent's + log-prob
      keep the best total_tokens - 1 drafted nodes; order (depth, score desc, drafting order)
      -> tokens, parents, depths, scores, ancestor mask of the T = total_tokens nodes (root first)

exactly as :class:`~graphs.trees.DynamicTreeBuilder` does it (the tests hold both to a PyTorch
reference). Every sequence of the batch runs in the same tensors: no per-sequence Python.
Ties go to the earlier-drafted node: ONNX ``TopK`` puts the lower index first among equals.

The trace is cleaned at export by onnxscript's optimizer (:func:`simplify_traced`: about 55% fewer
nodes, the same outputs bit for bit on the 19M model), and ``python -m exporter.optimize`` gives it
the draft graph's passes (fused attention/rotary/norms, int4/int8 weights, float16 for CUDA).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from exporter.modeling import BaseParts, flatten_kv, pairs
from exporter.plan import aux_layer_ids, check_tree, parse_tree, parse_tree_role
from graphs import contract as C

__all__ = ["EagleTreeGraph", "check_tree", "graph_for_role", "parse_tree", "simplify_traced", "tree_cases"]


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, N, ...) and idx (B, M) -> (B, M, ...): rows of x along dim 1."""
    shape = (*idx.shape, *x.shape[2:])
    flat = idx.reshape(idx.shape[0], idx.shape[1], *([1] * (x.dim() - 2)))
    return x.gather(1, flat.expand(shape))


def _repeat(x: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """(B, k) -> (B, k*n): each entry n times in a row (k, n Python ints: no shape arithmetic in the graph)."""
    return x[:, :, None].expand(-1, -1, n).reshape(-1, k * n)


def _safe(lp: torch.Tensor) -> torch.Tensor:
    """Log-probs clipped to <= 0 and NaN -> -inf (as graphs.trees._safe_logprobs): scores never rise."""
    lp = torch.clamp(lp, max=0.0)
    return torch.where(torch.isnan(lp), torch.full_like(lp, float("-inf")), lp)


class EagleTreeGraph(nn.Module):
    """feature, input_ids, position_ids, attention_mask, root_index, *past ->
    tree_tokens, tree_parents, tree_depth, tree_scores, tree_mask, *present."""

    def __init__(self, model, topk: int, depth: int, total_tokens: int):
        super().__init__()
        check_tree(topk, depth, total_tokens)
        self.eagle_module = model.eagle_module
        self.base = BaseParts(model)
        self.eagle3 = model.eagle_module.eagle3
        self.topk, self.depth, self.total_tokens = topk, depth, total_tokens
        self.hidden_size = model.config.hidden_size

    def _head(self, out):
        """Drafter outputs (B, R, H) -> (top-k ids (B, R, K) target vocab, log-probs (B, R, K))."""
        logits = self.eagle_module.logits(self.base, out)
        lp, idx = torch.topk(torch.log_softmax(logits.float(), dim=-1), self.topk, dim=-1)
        return self.eagle_module.draft_to_target(idx), _safe(lp)

    def _draft(self, hidden, ids, pos, mask, past, aux=None):
        """One drafter forward -> (out (B, S, H), top-k ids (B, S, K) target vocab, log-probs (B, S, K))."""
        out, new = self.eagle_module.hidden_step(self.base, hidden, ids, pos, mask, past, aux)
        return (out, *self._head(out), new)

    def forward(self, feats, input_ids, position_ids, attention_mask, root_index, *past):
        k, big_k = self.topk, self.topk  # frontier width, children per node (the drafter's top-k)
        bsz = input_ids.shape[0]
        past_kv = pairs(past) if past else None
        # 1) the context rows: their K/V go out, the root row's output drafts layer 1 (the head runs on
        #    that row alone: the other context rows' logits are never read)
        step = self.eagle_module.hidden_step
        if self.eagle3:
            out, ctx_new = step(self.base, feats[:, :0, : self.hidden_size], input_ids, position_ids,
                                attention_mask, past_kv, feats)
        else:
            out, ctx_new = step(self.base, feats, input_ids, position_ids, attention_mask, past_kv)
        root = root_index[:, None]  # (B, 1)
        root_out = _gather_rows(out, root)  # (B, 1, H)
        ids, lp = self._head(root_out)  # (B, 1, K)
        root_tok = input_ids.gather(1, root)  # (B, 1)
        root_pos = position_ids.gather(1, root)  # (B, 1) the last context row's position
        ctx_cols = _gather_rows(attention_mask[:, 0], root)  # (B, 1, P+S) what every tree row sees
        # drafted nodes in drafting order (index n = builder id n + 1; the root is -1)
        tok = ids[:, 0]  # (B, K)
        score = lp[:, 0]  # (B, K)
        par = torch.full_like(tok, -1)  # (B, K)
        dep = torch.ones_like(tok)  # (B, K)
        # frontier of layer 1: best k of it (TopK is stable), fed with the root's output; layer 1's
        # nodes are nodes 0..K-1, so the positions TopK returns are node indices
        front = torch.topk(score, k, dim=-1).indices  # (B, k) node indices
        hid = root_out.expand(-1, k, -1)  # (B, k, H)
        anc = torch.eye(k, dtype=torch.bool).expand(bsz, k, k)  # (B, k, F) fed ancestors-or-self
        tree_kv = ctx_new if not past_kv else [  # past + context rows, then each level's rows
            (torch.cat([pk, ck], 2), torch.cat([pv, cv], 2)) for (pk, pv), (ck, cv) in zip(past_kv, ctx_new)]
        for level in range(self.depth):
            f_tok = tok.gather(1, front)  # (B, k)
            f_pos = root_pos + dep.gather(1, front)  # (B, k): root position + depth - 1
            mask = torch.cat([ctx_cols.expand(-1, k, -1), anc], dim=2)[:, None]  # (B, 1, k, P+S+F)
            out, ids, lp, new = self._draft(hid, f_tok, f_pos, mask, tree_kv)
            tree_kv = [(torch.cat([pk, nk], 2), torch.cat([pv, nv], 2)) for (pk, pv), (nk, nv) in zip(tree_kv, new)]
            child_score = (score.gather(1, front)[:, :, None] + lp).reshape(-1, k * big_k)  # (B, k*K)
            n0 = big_k + level * k * big_k  # nodes drafted before this level (a Python int)
            tok = torch.cat([tok, ids.reshape(-1, k * big_k)], 1)
            score = torch.cat([score, child_score], 1)
            par = torch.cat([par, _repeat(front, k, big_k)], 1)
            dep = torch.cat([dep, _repeat(dep.gather(1, front) + 1, k, big_k)], 1)
            if level == self.depth - 1:
                break
            order = torch.topk(child_score, k, dim=-1).indices  # (B, k) into the k*K children
            front = order + n0
            parent_row = order // big_k  # (B, k) row of this call that fed the parent
            hid = _gather_rows(out, parent_row)  # (B, k, H)
            eye_k = torch.eye(k, dtype=torch.bool).expand(bsz, k, k)
            anc = torch.cat([_gather_rows(anc, parent_row), eye_k], 2)  # (B, k, fed so far + k)
        # 2) keep the best T - 1 drafted nodes, then order them by (depth, score desc, drafting order)
        n_keep = self.total_tokens - 1
        keep = torch.topk(score, n_keep, dim=-1).indices  # (B, T-1) score desc, ties: lower index
        rank = torch.arange(n_keep, dtype=torch.float32)
        key = _gather_rows(dep, keep).float() * n_keep + rank  # unique: a stable sort by depth
        keep = keep.gather(1, torch.topk(key, n_keep, dim=-1, largest=False).indices)  # (B, T-1)
        new_id = torch.full_like(tok, -1).scatter(1, keep, torch.arange(1, n_keep + 1).expand(bsz, n_keep))
        new_id = torch.cat([torch.zeros_like(root_tok), new_id], 1)  # (B, 1 + N): index by parent + 1
        parents = torch.cat([torch.full_like(root_tok, -1), new_id.gather(1, par.gather(1, keep) + 1)], 1)
        tokens = torch.cat([root_tok, tok.gather(1, keep)], 1)  # (B, T)
        depths = torch.cat([torch.zeros_like(root_tok), dep.gather(1, keep)], 1)
        scores = torch.cat([torch.zeros_like(score[:, :1]), score.gather(1, keep)], 1)
        # 3) ancestor mask: powers of the parent matrix, one per level
        t = self.total_tokens
        onehot = (parents[:, :, None] == torch.arange(t)[None, None, :]).float()  # (B, T, T) child -> parent
        eye = torch.eye(t).expand(bsz, t, t)
        mask, walk = eye, eye
        for _ in range(self.depth + 1):
            walk = walk @ onehot
            mask = mask + walk
        return (tokens, parents, depths, scores, mask > 0, *flatten_kv(ctx_new))


def simplify_traced(proto, base_dir: Path):
    """The traced tree graph, cleaned by onnxscript's optimizer (a ModelProto; weights stay where they are).

    The unrolled loop traces ``1 + depth`` drafter forwards and the tree bookkeeping with the
    tracer's dynamic-shape plumbing (Shape -> Gather -> Unsqueeze -> Concat for every reshape and
    expand), though every dim but batch, context rows and cache length is fixed at export. Constant
    folding with shape inference turns the fixed ones into constants, common-subexpression
    elimination merges what each level recomputes (the K/V concatenated inside attention and again
    for the next level, the same shapes read again). Exact: only constant subgraphs are evaluated
    (shape arithmetic; the tracer already folded the weights' constants), so the outputs are the
    raw trace's, bit for bit on the 19M model (samples/bench_draft_tree.py) and checked in
    tests/test_optimize_tree.py. The optimize stage runs the same optimizer on every graph.
    Measured on that model (2 threads): 1693 -> 753 nodes, the draft call 1.05-1.10x faster; with
    every input dim made static the folding reaches 590 nodes and only 6% more, so the remaining
    shape plumbing is not where the time goes (the drafter's MatMuls are).
    """
    import onnx_ir as ir
    from onnxscript.optimizer import optimize

    model = ir.from_proto(proto)
    ir.external_data.set_base_dir(model.graph, base_dir)
    optimize(model)
    return ir.to_proto(model)


def graph_for_role(model, role: str) -> EagleTreeGraph:
    return EagleTreeGraph(model, *parse_tree_role(role))


def tree_cases(model, spec: C.GraphSpec, seed: int = 0) -> list[tuple[str, list[torch.Tensor]]]:
    """Inputs to check a tree graph against PyTorch (exporter.compare): batch 2, a drafter cache with
    a hole, context rows of different lengths (padded rows see only themselves), real base features."""
    from exporter.modeling import base_forward, causal_mask, eager_attention

    g = torch.Generator().manual_seed(seed + 7)
    p, s = 3, 4
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, p + s + 1), generator=g)
    with torch.no_grad(), eager_attention(model.config):
        n = p + s
        _, hidden, aux, _ = base_forward(model, ids[:, :n], torch.arange(n).expand(2, n), causal_mask(2, n), None,
                                         aux_layer_ids(model))
    feats = (aux if model.eagle_module.eagle3 else hidden)[:, p:]  # (2, S, F) the context rows
    counts = torch.tensor([2, 4])  # real rows per sequence
    real = torch.arange(s)[None, :] < counts[:, None]  # (2, S)
    new = torch.tril(torch.ones(s, s, dtype=torch.bool)) & real[:, None, :]
    new = new | torch.eye(s, dtype=torch.bool)
    past_cols = torch.tensor([[True, True, True], [True, False, True]])  # sequence 1: a hole
    mask = torch.cat([past_cols[:, None, :].expand(2, s, p), new], 2)[:, None]  # (2, 1, S, P+S)
    kv = []
    mod = model.eagle_module
    for _ in range(len(mod.layers)):
        for _ in range(2):
            kv.append(torch.randn(2, mod.num_kv_heads, p, mod.head_dim, generator=g) * 0.5)
    inputs = [feats, ids[:, p + 1 :], torch.arange(p, p + s).expand(2, s), mask, counts - 1, *kv]
    return [("tree_b2_past3_holes", [x.contiguous() for x in inputs])]
