"""A PyTorch reference for drafting: what tree the runtime *should* build at a decode step.

Greedy equality cannot see drafting bugs (any draft gives the base's tokens), so the runtime's
trees are compared with trees computed here, independently of the runtime and of
``graphs.trees.DynamicTreeBuilder``:

EAGLE (1 and 3): the drafter is re-run from scratch for every tree node, over the whole context and
the node's ancestor chain, with a plain causal mask and no K/V cache::

    rows  = context rows (f_t, x_{t+1}) for t = 0..n       (x_{n+1} is the root, at position n+1)
          + one row per ancestor-or-self y_1..y_d         (hidden: the drafter's output one row up,
                                                           token y_j, position n + j)
    out(node) = last row's drafter output; its top-k gives the node's children

then EAGLE-2's selection, written out longhand: the root's top-k is layer 1; ``depth`` times, the
best ``topk`` nodes of the newest layer are expanded (each into its top-k children, score = the
parent's + log-prob); the root plus the best ``total_tokens - 1`` drafted nodes are kept, ordered by
(depth, score descending, drafting order). Ties go to the earlier-drafted node.

Medusa: the heads on the base hidden state of the last context token (the token before the root),
top-k per head, and the static tree's (head, rank) picks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from exporter.modeling import base_forward, causal_mask, eager_attention
from exporter.speculative.medusa import medusa_logits
from exporter.trace import aux_layer_ids


@dataclass
class RefTree:
    parents: list[int]  # -1 for the root
    tokens: list[int]  # target vocabulary; tokens[0] is the root token
    scores: list[float]  # cumulative draft log-probs; 0 for the root


@torch.no_grad()
def base_features(model, ids: list[int]):
    """(hidden (n, H), aux (n, n_aux*H) | None, logits (n, V)) of the base over ``ids``."""
    x = torch.tensor([ids])
    n = x.shape[1]
    with eager_attention(model.config):
        logits, hidden, aux, _ = base_forward(model, x, torch.arange(n)[None], causal_mask(1, n), None,
                                              aux_layer_ids(model))
    return hidden[0], None if aux is None else aux[0], logits[0]


class EagleReference:
    """Drafter outputs for any node of the tree at one decode step, each from scratch."""

    def __init__(self, model, seq: list[int]):
        """``seq``: the context tokens x_0..x_n followed by the root token x_{n+1}."""
        self.model, self.mod = model, model.eagle_module
        self.ctx_ids = seq[1:]  # x_1..x_{n+1}: the token each context row reads
        hidden, aux, _ = base_features(model, seq[:-1])
        self.ctx_feat = aux if self.mod.eagle3 else hidden  # (n+1, F)
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()
    def run(self, path: tuple[int, ...]):
        """(hidden_out (H,), logprobs over the target vocabulary (V,) or the draft one) at ``path``.

        ``path`` = the tokens y_1..y_d from the root down to the node (() = the root itself).
        """
        n1 = len(self.ctx_ids)
        chain = [self._out(path[:j]) for j in range(len(path))]  # hidden inputs of the chain rows
        ids = torch.tensor([self.ctx_ids + list(path)])  # (1, S)
        s = ids.shape[1]
        pos = torch.arange(s)[None]  # row t at position t: context 0..n, chain n+1..n+d
        mask = causal_mask(1, s)
        mod = self.model.eagle_module
        if mod.eagle3:
            h = self.model.config.hidden_size
            hid = torch.stack(chain)[None] if chain else self.ctx_feat.new_zeros(1, 0, h)  # (1, d, H)
            out, logits, _ = mod.step(self.model, hid, ids, pos, mask, None, aux_hidden=self.ctx_feat[None])
        else:
            hid = torch.cat([self.ctx_feat, *[h[None] for h in chain]])[None]  # (1, S, H)
            out, logits, _ = mod.step(self.model, hid, ids, pos, mask, None)
        assert out.shape[1] == n1 + len(path)
        return out[0, -1], torch.log_softmax(logits[0, -1].float(), dim=-1)

    def _out(self, path):
        if path not in self._memo:
            self._memo[path] = self.run(path)[0]
        return self._memo[path]

    def topk(self, path, k: int) -> tuple[list[int], list[float]]:
        """Top-k children of ``path``: target-vocabulary ids and log-probs, best first."""
        _, lp = self.run(path)
        scores, ids = torch.topk(lp, k)
        ids = self.mod.draft_to_target(ids)
        return ids.tolist(), scores.tolist()


def eagle_reference_tree(model, seq: list[int], topk: int, depth: int, total_tokens: int) -> RefTree:
    """The EAGLE-2 tree at the decode step whose context + root is ``seq`` (see the module doc)."""
    ref = EagleReference(model, seq)
    # drafted nodes in drafting order: (path, parent index into this list or -1 = root, score)
    nodes: list[tuple[tuple[int, ...], int, float]] = []

    def add_children(parent: int) -> list[int]:
        path, score = ((), 0.0) if parent < 0 else (nodes[parent][0], nodes[parent][2])
        ids, lps = ref.topk(path, topk)
        first = len(nodes)
        for t, lp in zip(ids, lps):
            nodes.append(((*path, t), parent, score + min(lp, 0.0)))
        return list(range(first, len(nodes)))

    def best(idx: list[int], n: int) -> list[int]:
        return sorted(idx, key=lambda i: (-nodes[i][2], i))[:n]

    layer = add_children(-1)
    for _ in range(depth):
        frontier = best(layer, topk)
        layer = [c for f in frontier for c in add_children(f)]
    keep = best(list(range(len(nodes))), total_tokens - 1)
    keep.sort(key=lambda i: (len(nodes[i][0]), -nodes[i][2], i))
    index = {i: j + 1 for j, i in enumerate(keep)}
    parents = [-1] + [0 if nodes[i][1] < 0 else index[nodes[i][1]] for i in keep]
    tokens = [seq[-1]] + [nodes[i][0][-1] for i in keep]
    return RefTree(parents, tokens, [0.0] + [nodes[i][2] for i in keep])


@torch.no_grad()
def medusa_reference_tokens(model, seq: list[int], tree) -> list[int]:
    """Candidate tokens of the static ``tree`` at the step whose context + root is ``seq``."""
    hidden, _, _ = base_features(model, seq[:-1])
    logits = medusa_logits(model.medusa_heads, hidden[-1][None, None])[0, 0]  # (heads, V)
    k = int(tree.rank.max()) + 1
    ids = torch.topk(torch.log_softmax(logits.float(), -1), k, dim=-1).indices.numpy()  # (heads, K)
    out = np.empty(tree.size, dtype=np.int64)
    out[0] = seq[-1]
    for n in range(1, tree.size):
        out[n] = ids[tree.head[n], tree.rank[n]]
    return out.tolist()


# --------------------------------------------------------------------------------------------
# Checking what the runtime drafted


@contextlib.contextmanager
def captured_steps(decoder):
    """Record every tree the decoder verifies (graphs.engine.VerifyRecord: request, tree, tokens, root
    position, accepted nodes), through the decoder's public watch_verify()."""
    with decoder.watch_verify() as records:
        yield records


_MODELS: dict[str, torch.nn.Module] = {}


def torch_model(model_dir) -> torch.nn.Module:
    """The converted PyTorch model saved in ``model_dir`` (loaded once)."""
    from transformers import AutoModelForCausalLM

    from exporter.speculative import enable_huggingface_checkpointing

    key = str(model_dir)
    if key not in _MODELS:
        enable_huggingface_checkpointing()
        _MODELS[key] = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return _MODELS[key]


def check_drafts(model, prompts, results, steps, *, eagle_cfg: dict | None = None, atol: float = 1e-4) -> int:
    """Assert every verified tree in ``steps`` (VerifyRecords) equals the reference's; returns how many were checked.

    ``results``: the generation results (their tokens give each step's context); ``eagle_cfg``
    (topk, depth, total_tokens) for EAGLE, None for Medusa.
    """
    checked = 0
    for i, rec in enumerate(steps):
        b, tree, p = rec.request_id, rec.tree, int(rec.position)
        full = list(prompts[b]) + list(results[b].token_ids)
        assert p < len(full), f"step {i} seq {b}: root position {p} beyond the output"
        seq = full[: p + 1]
        got = np.asarray(rec.tokens)[: tree.size].tolist()
        assert got[0] == seq[-1], f"step {i} seq {b}: root token {got[0]} is not the last emitted {seq[-1]}"
        where = f"step {i} seq {b} (context of {p} tokens)"
        if eagle_cfg is None:
            want = medusa_reference_tokens(model, seq, tree)
            assert got == want, f"{where}: Medusa candidates {got} != reference {want}"
        else:
            ref = eagle_reference_tree(model, seq, **eagle_cfg)
            parents = tree.parents.tolist()
            assert parents == ref.parents, f"{where}: parents {parents} != {ref.parents}"
            assert got == ref.tokens, f"{where}: tokens {got} != reference {ref.tokens}"
            np.testing.assert_allclose(tree.score, ref.scores, atol=atol, err_msg=f"{where}: scores")
        checked += 1
    return checked
