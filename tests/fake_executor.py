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
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from graphs import contract as C
from graphs.adaptive import Costs, Planner
from graphs.engine import Engine, EngineConfig
from graphs.executor import ModelInfo, select_on_host
from graphs.requests import RequestMaker
from graphs.slots import SlotCache

VOCAB = 48
EOS = 2
TABLE = np.random.default_rng(1234).standard_normal((VOCAB, VOCAB, VOCAB)).astype(np.float32) * 3.0
TABLE[:, :, EOS] -= 12.0  # the end token is rare: requests run to their length


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


class FakeExecutor:
    """:class:`graphs.executor.Executor` over the table above; counts its calls (``calls``)."""

    def __init__(self, slots: int, max_len: int, headroom: int, kind: str | None = "medusa", heads: int = 3,
                 hit_rate: float = 0.7, max_positions: int = 4096):
        self.info = ModelInfo(kind, 0, VOCAB, max_positions, np.dtype(np.float32))
        self.kv = SlotCache(1, slots, 1, 1, np.float32, max_len, headroom=headroom, bucket=16)
        self.kv.limit = max_len + headroom
        self.draft_kv = None
        self.heads, self.hit_rate = heads, hit_rate
        self.calls: list[tuple[str, int, int]] = []  # (kind, rows, width)

    # ---------------------------------------------------------------- rows
    @property
    def rows(self) -> int:
        return self.kv.n

    def add_row(self) -> int:
        return self.kv.add_row()

    def remove_row(self, b: int) -> None:
        self.kv.remove_row(b)

    def shrink(self, keep_base: bool = False) -> None:
        if not keep_base:
            self.kv.shrink()

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
        return {C.LOGITS: logits, C.HIDDEN: hidden}

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
        raise NotImplementedError("the fake executor drafts Medusa only")

    def draft_tree(self, role: str, feed: dict, starts) -> dict:
        raise NotImplementedError("the fake executor drafts Medusa only")


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
        self.outputs = {C.LOGITS: logits, C.HIDDEN: hidden}
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
    manifest = SimpleNamespace(drafter={"kind": kind, "num_heads": heads} if kind else None,
                               generation={"eos_token_ids": [EOS]}, tree={"medusa_paths": paths}, tokenizer=None,
                               source={"vocab_size": VOCAB}, graphs={})
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
