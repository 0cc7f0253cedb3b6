"""The seam between the engine and the graphs: the calls one step makes, and nothing else.

    engine.step():  schedule (admit, chunk, widths)  ->  executor calls  ->  update (accept, emit)

An executor belongs to one engine: it holds that engine's K/V (the base's and the EAGLE / DFlash drafter's,
one row per request) and runs the graphs on it. The engine and the proposers talk only to it::

    rows      add_row() -> b, remove_row(b) (the last row moves into b), shrink(), memory()
    prefill   prefill(first, ids, pos, mask) -> outputs: rows first.. cache a prompt chunk each
    verify    verify(trees, tokens) -> outputs: every occupied row, its tree after its length
    select    select(outputs, picks) -> per row (accepted nodes, bonus) or the row's own exception
    commit    commit(idx, counts, first): after either call, row b keeps its new ``idx[b, :counts[b]]``
    plain     plain_run(most) -> a bound run of one-token steps (or None: verify a root-only tree)
    draft     draft_heads (Medusa), draft_step / draft_tree (EAGLE), draft_block (DFlash) on the
              drafter's K/V ``draft_kv``

Implementations: :class:`graphs.host.HostExecutor` (numpy K/V, ONNX Runtime on host buffers) and the
tests' fake (scripted logits, no ONNX files). A device executor keeps the same calls over
``OrtValue`` buffers; only what ``select`` and the drafter's features need comes back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class ModelInfo:
    """What the engine and the proposers read about the model behind an executor."""

    kind: str | None  # the drafter: "medusa" | "eagle" | "dflash" | None
    pad: int  # token id fed to padding positions
    vocab: int
    max_positions: int  # the context limit (the sliding window's, where smaller)
    dtype: np.dtype  # of the graphs' floating inputs and outputs (features, K/V)
    feature: str = "hidden_states"  # the base output EAGLE's drafter reads (graphs.contract names)
    feature_dim: int = 0
    block_size: int = 0  # DFlash: the block's slots (root + block_size - 1 drafts)
    mask_token_id: int = 0  # DFlash: the token fed to the block's drafted slots


class PlainRun(Protocol):
    """Bound one-token steps of every occupied row (:meth:`Executor.plain_run`)."""

    steps: int  # how many this run may take (K/V room reserved)
    outputs: dict  # the last step's outputs (n, 1, ...) by name, refilled by each step

    def step(self, roots) -> dict: ...  # the first step: ``roots`` (n,) at each row's length
    def again(self) -> dict: ...  # the next step, fed the tokens greedy() chose
    def greedy(self) -> np.ndarray: ...  # (n,) each row's argmax, fed to again()
    def feed(self, tokens) -> None: ...  # the next step's tokens where greedy() did not choose them


class Executor(Protocol):
    info: ModelInfo
    rows: int  # occupied rows (0 .. rows - 1)
    draft_kv: object  # the EAGLE / DFlash drafter's K/V rows (graphs.slots.SlotCache's calls), else None

    def add_row(self) -> int: ...
    def remove_row(self, b: int) -> None: ...
    def shrink(self, keep_base: bool = False) -> None: ...
    def memory(self) -> dict: ...
    def prefill(self, first: int, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray) -> dict: ...
    def verify(self, trees: list, tokens: list) -> dict: ...
    def select(self, out: dict, picks: list) -> list: ...
    def commit(self, idx: np.ndarray, counts: np.ndarray, first: int = 0) -> None: ...
    def plain_run(self, most: int) -> PlainRun | None: ...
    def keep_new(self, counts: np.ndarray) -> None: ...
    def draft_heads(self, hidden: list, k: int) -> np.ndarray: ...
    def draft_step(self, feats, ids, pos, mask, topk: int, rows: slice | None = None, is_aux: bool = False,
                   starts: np.ndarray | None = None) -> dict: ...
    def draft_tree(self, role: str, feed: dict, starts: np.ndarray) -> dict: ...
    def draft_in_place(self, role: str) -> bool: ...
    def draft_block(self, feats, ctx_pos, ids, pos, past, new, topk: int, starts: np.ndarray) -> dict: ...
    # DFlash: every occupied row's A new context rows (feats (n, A, F) at ctx_pos (n, A); ``new`` (n, A)
    # which are real) join ``draft_kv`` at columns ``starts``, its block ids/pos (n, S) sees ``past``
    # (n, P) the cached columns, the real new rows and the whole block -> topk_ids / topk_logprobs
    # (n, S-1, topk), and ``present.*`` (n, kv, A, d) where the graph does not write them in place


class HostRows:
    """An executor's rows where the K/V are host :class:`graphs.slots.SlotCache` s: the base's ``kv`` and
    the drafter's ``draft_kv`` (or None), one row each per request, added, moved and shrunk together."""

    @property
    def rows(self) -> int:
        return self.kv.n

    def add_row(self) -> int:
        if self.draft_kv is not None:
            self.draft_kv.add_row()
        return self.kv.add_row()

    def remove_row(self, b: int) -> None:
        self.kv.remove_row(b)
        if self.draft_kv is not None:
            self.draft_kv.remove_row(b)

    def shrink(self, keep_base: bool = False) -> None:
        if not keep_base:
            self.kv.shrink()
        if self.draft_kv is not None:
            self.draft_kv.shrink()


def select_on_host(logits: np.ndarray, picks: list) -> list:
    """``select`` where the logits are host arrays (n, S, V): row b's sampler walks its tree over
    ``logits[b, :size]``. ``picks[b]``: (sampler, tree, tokens) or None (an idle row). A row's own
    failure (its sampling, non-finite logits in its row) comes back as that row's exception."""
    got = []
    for b, pick in enumerate(picks):
        if pick is None:
            got.append(None)
            continue
        sampler, tree, tokens = pick
        try:
            got.append(sampler.accept(tree, tokens, logits[b, : tree.size]))
        except Exception as e:  # this request's own: the engine ends it alone
            got.append(e)
    return got
