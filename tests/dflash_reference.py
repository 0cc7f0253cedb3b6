"""A reference DFlash decode loop over the exported graphs (tests only; the engine's proposer is the product).

One sequence, greedy, plain numpy caches (concat contract), written to pin down what a proposer feeds:

    prefill:  base(prompt)                       -> K/V, target-layer features of every prompt position
    step:     draft(pending features at their positions, [anchor, mask x (b-1)] at anchor_pos + 0..b-1,
                    mask all visible, the drafter's own cache)   -> slots' top-k, the rows' drafter K/V
              tree = block_tree / block_chain (graphs.dflash_tree)
              base(tree tokens at anchor_pos + depth, mask [cache | tree.mask])  -> logits, features
              accept greedily along the tree; commit the accepted nodes' base K/V; their features
              become the pending context; the bonus token is the next anchor
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from graphs import contract as C
from graphs.dflash_tree import block_chain, block_tree
from graphs.manifest import Manifest


@dataclass
class LoopStats:
    steps: int = 0
    accepted: list[int] = field(default_factory=list)  # drafts accepted per step

    @property
    def tau(self) -> float:
        return 1 + sum(self.accepted) / max(len(self.accepted), 1)


class Graphs:
    def __init__(self, out_dir):
        self.m = Manifest.read(out_dir)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        self.base = ort.InferenceSession(str(out_dir / self.m.graphs["base"].file), opts,
                                         providers=["CPUExecutionProvider"])
        self.draft = ort.InferenceSession(str(out_dir / self.m.graphs["draft"].file), opts,
                                          providers=["CPUExecutionProvider"])

    def run_base(self, kv, ids, pos, mask):
        spec = self.m.graphs["base"]
        feed = {C.INPUT_IDS: ids[None], C.POSITION_IDS: pos[None], C.ATTENTION_MASK: mask[None, None]}
        feed |= dict(zip([t.name for t in spec.inputs if t.name.startswith("past_")], kv))
        return dict(zip(spec.output_names, self.base.run(spec.output_names, feed)))

    def run_draft(self, kv, aux, ctx_pos, block, pos, topk):
        spec = self.m.graphs["draft"]
        total = kv[0].shape[2] + aux.shape[0] + block.shape[0]
        feed = {C.AUX_HIDDEN: aux[None], C.CONTEXT_POSITION_IDS: ctx_pos[None], C.INPUT_IDS: block[None],
                C.POSITION_IDS: pos[None], C.ATTENTION_MASK: np.ones((1, 1, block.shape[0], total), bool),
                C.TOPK_IN: np.array([topk])}
        feed |= dict(zip([t.name for t in spec.inputs if t.name.startswith("past_")], kv))
        return dict(zip(spec.output_names, self.draft.run(spec.output_names, feed)))


def _presents(out: dict) -> list[np.ndarray]:
    return [v for k, v in out.items() if k.startswith("present.")]


def _empty(n_tensors: int, kv: int, hd: int) -> list[np.ndarray]:
    return [np.zeros((1, kv, 0, hd), np.float32) for _ in range(n_tensors)]


def autoregressive(g: Graphs, prompt: list[int], max_new: int) -> list[int]:
    src = g.m.source
    kv = _empty(2 * src["num_layers"], src["num_kv_heads"], src["head_dim"])
    ids, out_tokens = np.array(prompt), []
    pos = np.arange(len(prompt))
    mask = np.tril(np.ones((len(prompt), len(prompt)), bool))
    while len(out_tokens) < max_new:
        out = g.run_base(kv, ids, pos, mask)
        kv = [np.concatenate([a, b], 2) for a, b in zip(kv, _presents(out))]
        tok = int(out[C.LOGITS][0, -1].argmax())
        out_tokens.append(tok)
        p = kv[0].shape[2]
        ids, pos, mask = np.array([tok]), np.array([p]), np.ones((1, p + 1), bool)
    return out_tokens


def dflash_generate(g: Graphs, prompt: list[int], max_new: int, size: int, topk: int = 1):
    """Greedy speculative decoding with the DFlash drafter: a ``size``-node chain (topk 1) or tree per step."""
    src, d = g.m.source, g.m.drafter
    b, mask_id = d["block_size"], d["mask_token_id"]
    kv = _empty(2 * src["num_layers"], src["num_kv_heads"], src["head_dim"])
    dkv = _empty(2 * d["num_layers"], d["num_kv_heads"], d["head_dim"])
    n = len(prompt)
    out = g.run_base(kv, np.array(prompt), np.arange(n), np.tril(np.ones((n, n), bool)))
    kv = [np.concatenate([a, x], 2) for a, x in zip(kv, _presents(out))]
    pending, pending_pos = out[C.AUX_HIDDEN][0], np.arange(n)  # every position before the anchor
    anchor, anchor_pos = int(out[C.LOGITS][0, -1].argmax()), n
    tokens, stats = [anchor], LoopStats()
    while len(tokens) < max_new:
        block = np.array([anchor] + [mask_id] * (b - 1))
        dr = g.run_draft(dkv, pending, pending_pos, block, anchor_pos + np.arange(b), topk)
        dkv = [np.concatenate([a, x], 2) for a, x in zip(dkv, _presents(dr))]
        ids, lp = dr[C.TOPK_IDS][0], dr[C.TOPK_LOGPROBS][0]  # (b-1, K): slot k+1 of the block
        tree, cand = (block_chain(ids, lp, anchor, size) if topk == 1 else block_tree(ids, lp, anchor, size))
        p = kv[0].shape[2]
        mask = np.concatenate([np.ones((tree.size, p), bool), tree.mask], axis=1)
        ver = g.run_base(kv, cand, anchor_pos + tree.depth, mask)
        path, node = [0], 0
        while True:  # greedy: follow the child holding the base's choice
            want = int(ver[C.LOGITS][0, node].argmax())
            node = next((c for c in tree.child_lists[node] if int(cand[c]) == want), -1)
            if node < 0:
                break
            path.append(node)
        bonus = int(ver[C.LOGITS][0, path[-1]].argmax())
        kv = [np.concatenate([a, x[:, :, path]], 2) for a, x in zip(kv, _presents(ver))]
        pending, pending_pos = ver[C.AUX_HIDDEN][0, path], anchor_pos + np.arange(len(path))
        tokens += [int(cand[i]) for i in path[1:]] + [bonus]
        anchor, anchor_pos = bonus, anchor_pos + len(path)
        stats.steps += 1
        stats.accepted.append(len(path) - 1)
    return tokens[:max_new], stats
