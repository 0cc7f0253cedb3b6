"""A fake executor (pure numpy, scripted logits, no ONNX files) that drives the engine in tests.

The "model" is a table: the logits after token ``tok`` whose predecessor is ``prev`` are
``TABLE[prev, tok]`` (V,), so the greedy continuation of a prompt is known without any graph
(:func:`reference`). The predecessor of a tree node is its parent's token, of a root the token the
K/V cache holds in the column before it: the cache stores each position's token (one layer, one
head, head_dim 1, written in place at each row's length and compacted by the engine's commit like
the real one), so a wrong K/V commit, row move or position changes the tokens::

    verify row b:  node j at position lens[b] + depth[j], its token written at column lens[b] + j
                   prev(j) = token of parent(j), or cache[b, lens[b] - 1] for the root
                   logits[b, j] = TABLE[prev(j), token(j)]

Medusa heads (``kind="medusa"``): head h proposes the greedy token h + 2 positions past the hidden
state's (the hidden state of a node is (prev, token)); rank 0 is right where ``good(h, ...)`` says
(a hash of the context and ``hit_rate``), else rank 1 is, else neither.

DFlash (``kind="dflash"``, block DFLASH_BLOCK): a position's feature (``aux_hidden_states``) is (prev,
token); the drafter's K/V holds each context position's token, written in place at each row's length
like the base's. A draft call checks the proposer's invariant (its cached + new context rows are
exactly the row's tokens before the root, at their positions) and drafts slot k as the greedy token k
past the root, rank 0 right where ``good`` says, else rank 1, else neither.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from graphs import contract as C
from graphs.adaptive import Costs, Planner
from graphs.engine import Engine, EngineConfig
from graphs.executor import HostRows, ModelInfo, select_on_host
from graphs.requests import RequestMaker
from graphs.slots import SlotCache

VOCAB = 48
EOS = 2
TABLE = np.random.default_rng(1234).standard_normal((VOCAB, VOCAB, VOCAB)).astype(np.float32) * 3.0
TABLE[:, :, EOS] -= 12.0  # the end token is rare: requests run to their length
DFLASH_BLOCK, DFLASH_MASK = 4, VOCAB - 1


def next_token(prev: int, tok: int) -> int:
    return int(np.argmax(TABLE[prev, tok]))


def reference(prompt: list[int], n: int) -> list[int]:
    """The greedy continuation of ``prompt``: ``n`` tokens (fewer where the end token comes)."""
    seq = [0, *prompt]  # (position 0 has predecessor 0)
    out = []
    while len(out) < n:
        t = next_token(seq[-2], seq[-1])
        out.append(t)
        seq.append(t)
        if t == EOS:
            break
    return out


class FakeExecutor(HostRows):
    """:class:`graphs.executor.Executor` over the table above; counts its calls (``calls``)."""

    def __init__(self, slots: int, max_len: int, headroom: int, kind: str | None = "medusa", heads: int = 3,
                 hit_rate: float = 0.7, max_positions: int = 4096):
        dflash = kind == "dflash"
        self.info = ModelInfo(kind, 0, VOCAB, max_positions, np.dtype(np.float32), C.AUX_HIDDEN, 2 if dflash else 0,
                              DFLASH_BLOCK if dflash else 0, DFLASH_MASK if dflash else 0)
        self.kv = SlotCache(1, slots, 1, 1, np.float32, max_len, headroom=headroom, bucket=16)
        self.kv.limit = max_len + headroom
        self.draft_kv = SlotCache(1, slots, 1, 1, np.float32, max_len, headroom=headroom, bucket=16) if dflash else None
        self.heads, self.hit_rate = heads, hit_rate
        self.calls: list[tuple[str, int, int]] = []  # (kind, rows, width)

    # ---------------------------------------------------------------- rows
    def memory(self) -> dict:
        return {"kv_budget_bytes": self.kv.budget_bytes, "kv_allocated_bytes": self.kv.allocated_bytes}

    def room(self) -> int:  # (the fake's own: how many plain steps a run may take)
        return self.kv.limit - self.kv.top()

    # ---------------------------------------------------------------- base
    def _cached(self, b: int, col: int) -> int:
        return int(self.kv.keys[0][b, 0, col, 0]) if col >= 0 else 0

    def _write(self, b: int, col: int, tok: int) -> None:
        self.kv.keys[0][b, 0, col, 0] = tok
        self.kv.values[0][b, 0, col, 0] = tok

    def _run(self, rows: range, tokens: list, parents: list) -> dict:
        """Row b's nodes ``tokens[i]`` (their parents ``parents[i]``, -1: the root after the cache),
        written at columns lens[b] + j: logits and hidden states (n, S, ...)."""
        s = max(len(t) for t in tokens)
        self.kv.reserve(self.kv.top() + s)
        logits = np.zeros((len(tokens), s, VOCAB), np.float32)
        hidden = np.zeros((len(tokens), s, 2), np.float32)
        for i, b in enumerate(rows):
            w = int(self.kv.lens[b])
            for j, (tok, par) in enumerate(zip(tokens[i], parents[i])):
                prev = int(tokens[i][par]) if par >= 0 else self._cached(b, w - 1)
                logits[i, j], hidden[i, j] = TABLE[prev, int(tok)], (prev, int(tok))
                self._write(b, w + j, int(tok))
        return {C.LOGITS: logits, C.HIDDEN: hidden, C.AUX_HIDDEN: hidden}

    def prefill(self, first: int, ids, pos, mask) -> dict:
        bsz, s = ids.shape
        self.calls.append(("prefill", bsz, s))
        chain = list(range(-1, s - 1))
        return self._run(range(first, first + bsz), [list(r) for r in ids], [chain] * bsz)

    def verify(self, trees: list, tokens: list) -> dict:
        self.calls.append(("verify", len(tokens), max(len(t) for t in tokens)))
        return self._run(range(len(tokens)), [list(t) for t in tokens], [t.parents.tolist() for t in trees])

    def select(self, out: dict, picks: list) -> list:
        return select_on_host(out[C.LOGITS], picks)

    def commit(self, idx: np.ndarray, counts: np.ndarray, first: int = 0) -> None:
        self.kv.commit(None, idx, counts, first=first)  # written in place: the kept nodes move down

    def plain_run(self, most: int):
        self.kv.reserve(self.kv.top() + max(1, min(most, self.room())))
        return _FakeRun(self, max(1, min(most, self.room())))

    def keep_new(self, counts) -> None:
        self.kv.keep_new(counts)

    # ---------------------------------------------------------------- drafter
    def draft_heads(self, hidden: list, k: int) -> np.ndarray:
        self.calls.append(("draft", len(hidden), k))
        ids = np.zeros((len(hidden), 1, self.heads, k), np.int64)
        for d, (prev, tok) in enumerate(hidden):
            chain = [int(prev), int(tok)]
            for _ in range(self.heads + 1):
                chain.append(next_token(chain[-2], chain[-1]))
            for h in range(self.heads):
                truth = chain[3 + h]  # [prev, tok, root, head 0's, ...]
                ranks = [(truth + 1 + r) % VOCAB for r in range(k)]
                hit = _hash(prev, tok, h) % 100
                if hit < 100 * self.hit_rate:
                    ranks[0] = truth
                elif k > 1 and self.hit_rate > 0 and hit < 100 * (self.hit_rate + (1 - self.hit_rate) / 2):
                    ranks[1] = truth
                ids[d, 0, h] = ranks
        return ids

    def draft_in_place(self, role: str) -> bool:
        return True

    def draft_step(self, *a, **k) -> dict:
        raise NotImplementedError("the fake executor drafts Medusa and DFlash only")

    def draft_tree(self, role: str, feed: dict, starts) -> dict:
        raise NotImplementedError("the fake executor drafts Medusa and DFlash only")

    def draft_block(self, feats, ctx_pos, ids, pos, past, new, topk: int, starts) -> dict:
        n, s = ids.shape
        a = feats.shape[1]
        self.calls.append(("draft", n, topk))
        dkv = self.draft_kv
        top_ids = np.zeros((n, s - 1, topk), np.int64)
        top_lp = np.full((n, s - 1, topk), -30.0, np.float32)
        probs = np.log(np.array([0.6, 0.25, 0.1, 0.04] + [0.01] * max(0, topk - 4))[:topk]).astype(np.float32)
        for b in range(n):
            for j in range(a):  # in place, at the row's length (the engine's commit keeps the real ones)
                dkv.keys[0][b, 0, int(starts[b]) + j, 0] = feats[b, j, 1]
            count = int(new[b].sum())
            if count == 0:  # a row along for the ride: nothing to check, nothing drafted
                continue
            root, root_pos = int(ids[b, 0]), int(pos[b, 0])
            ctx = int(starts[b]) + count
            # the proposer's invariant: cached + new context = the row's tokens before the root, in place
            assert ctx == root_pos == int(self.kv.lens[b]), (b, ctx, root_pos, int(self.kv.lens[b]))
            assert past[b, : int(starts[b])].all() and not past[b, int(starts[b]) :].any()
            assert np.array_equal(ctx_pos[b, :count], int(starts[b]) + np.arange(count))
            assert np.array_equal(dkv.keys[0][b, 0, :ctx, 0], self.kv.keys[0][b, 0, :ctx, 0]), b
            assert np.array_equal(pos[b], root_pos + np.arange(s)) and (ids[b, 1:] == DFLASH_MASK).all()
            prev = self._cached(b, root_pos - 1)
            chain = [prev, root]
            for _ in range(s - 1):
                chain.append(next_token(chain[-2], chain[-1]))
            for k in range(s - 1):
                truth = chain[2 + k]
                ranks = [(truth + 1 + r) % (VOCAB - 1) for r in range(topk)]
                hit = _hash(prev, root, k) % 100
                if hit < 100 * self.hit_rate:
                    ranks[0] = truth
                elif topk > 1 and self.hit_rate > 0 and hit < 100 * (self.hit_rate + (1 - self.hit_rate) / 2):
                    ranks[1] = truth
                top_ids[b, k], top_lp[b, k] = ranks, probs
        return {C.TOPK_IDS: top_ids, C.TOPK_LOGPROBS: top_lp}


class _FakeRun:
    """Plain steps: step i of row b writes its token at column lens[b] + i (the engine keeps them)."""

    def __init__(self, ex: FakeExecutor, steps: int):
        self.ex, self.steps, self.i = ex, steps, -1
        self.tokens = None
        self.outputs: dict = {}

    def step(self, roots) -> dict:
        self.i, self.tokens = 0, np.array(roots, dtype=np.int64)
        return self._call()

    def again(self) -> dict:
        self.i += 1
        return self._call()

    def _call(self) -> dict:
        ex, n = self.ex, self.ex.kv.n
        ex.calls.append(("plain", n, 1))
        logits = np.zeros((n, 1, VOCAB), np.float32)
        hidden = np.zeros((n, 1, 2), np.float32)
        for b in range(n):
            col = int(ex.kv.lens[b]) + self.i
            prev, tok = ex._cached(b, col - 1), int(self.tokens[b])
            logits[b, 0], hidden[b, 0] = TABLE[prev, tok], (prev, tok)
            ex._write(b, col, tok)
        self.outputs = {C.LOGITS: logits, C.HIDDEN: hidden, C.AUX_HIDDEN: hidden}
        return self.outputs

    def greedy(self) -> np.ndarray:
        self.tokens = self.outputs[C.LOGITS][:, 0].argmax(axis=1)
        return self.tokens

    def feed(self, tokens) -> None:
        self.tokens = np.array(tokens, dtype=np.int64)


def _hash(*xs: int) -> int:
    h = 17
    for x in xs:
        h = (h * 1000003 + int(x)) & 0x7FFFFFFF
    return h


def requests(kind: str | None = "medusa", heads: int = 3, tree: list | None = None, adaptive: bool = True,
             max_positions: int = 4096) -> RequestMaker:
    """A request maker for the fake model (no tokenizer, no files)."""
    paths = tree or [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]][: 2 + 2 * heads]
    drafter = {"kind": kind, "num_heads": heads, "block_size": DFLASH_BLOCK, "mask_token_id": DFLASH_MASK}
    manifest = SimpleNamespace(drafter=drafter if kind else None, generation={"eos_token_ids": [EOS]},
                               tree={"medusa_paths": paths, "dflash": {"topk": 1, "total_tokens": DFLASH_BLOCK}},
                               tokenizer=None, source={"vocab_size": VOCAB}, graphs={})
    return RequestMaker(Path("/nonexistent-fake-export"), manifest, max_positions, adaptive)


def fake_engine(config: EngineConfig | None = None, planner: Planner | None = None, kind: str | None = "medusa",
                hit_rate: float = 0.7, heads: int = 3, tree: list | None = None, adaptive: bool = True,
                watchers: list | None = None, costs: Costs | None = None):
    """(engine, its FakeExecutor, its RequestMaker)."""
    made = []

    def make(slots: int, max_len: int, headroom: int) -> FakeExecutor:
        made.append(FakeExecutor(slots, max_len, headroom, kind, heads, hit_rate))
        return made[-1]

    maker = requests(kind, heads, tree, adaptive)
    engine = Engine(make, maker, config or EngineConfig(max_batch=4), planner or Planner(costs=costs),
                    watchers)
    return engine, made[0], maker


def drive(engine: Engine, max_steps: int = 10_000) -> dict:
    """Step until nothing is pending: {request id: (tokens, finish_reason)} from the events."""
    got: dict = {}
    for _ in range(max_steps):
        if not engine.has_pending_requests():
            return got
        for ev in engine.step():
            toks, _ = got.get(ev.request_id, ([], None))
            got[ev.request_id] = (toks + list(ev.token_ids), ev.finish_reason)
    raise AssertionError("the engine did not finish")
