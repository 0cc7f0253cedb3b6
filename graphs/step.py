"""One decode step as data: what was planned, what each row drafted and accepted, what each call cost.

Written once by the engine's phases (:mod:`graphs.engine`), read by the policy (costs and gains:
:mod:`graphs.adaptive`), the statistics and the emit::

    StepPlan      the rows (slot order; None: not decoding), each row's tree size, drafted or plain
    Drafts        per row a Proposal (tree, tokens), the drafter's seconds and calls
    RowResult     per row: accepted node indices (root first), the bonus token, the tokens emitted
    CallTime      per graph call: kind, token rows x width, seconds, cold (after a call of another kind)
    StepRecord    all of the above for one step (a drafted or plain verify)
    PlainRecord   a run of plain steps on a bound call (the same, with one token per row per step)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphs.trees import Tree


@dataclass
class Proposal:
    """One row's draft: the tree it verifies and its tokens (tree.size,), root first."""

    tree: Tree
    tokens: np.ndarray


@dataclass
class Drafts:
    rows: list[Proposal]  # every occupied row (a root-only tree where a row does not draft)
    seconds: float = 0.0  # the drafter's graph calls
    calls: int = 0

    @property
    def width(self) -> int:
        return max(len(p.tokens) for p in self.rows)


@dataclass
class StepPlan:
    live: list  # graphs.requests.Request per occupied row, None where it is not decoding
    sizes: np.ndarray  # (n,) nodes each row verifies: 0 idle, 1 plain, > 1 a drafted tree
    drafted: bool  # some row drafts (the proposer runs)
    adaptive: bool  # some row lets the policy choose its width (its gains are observed)


@dataclass
class RowResult:
    accepted: list[int]  # node indices, root first
    bonus: int
    tokens: list[int]  # emitted: the accepted drafts' tokens, then the bonus


@dataclass
class CallTime:
    kind: str  # "verify" | "draft"
    rows: int  # batch rows
    width: int  # tokens per row (a draft: the drafter's calls)
    seconds: float
    cold: bool = False  # right after a call of another kind (graphs.adaptive.Costs leaves it out)


@dataclass
class StepRecord:
    plan: StepPlan
    drafts: Drafts
    results: list[RowResult | None]  # per row; None: idle, or its request failed this step
    calls: list[CallTime] = field(default_factory=list)
    host: float = 0.0  # seconds outside graph calls

    def seconds(self, kind: str) -> float:
        return sum(c.seconds for c in self.calls if c.kind == kind)


@dataclass
class PlainRecord:
    """A run of plain steps: every row one token per step on one bound call."""

    live: list
    watchers: list  # the verify watchers at the run's start (a run with any is one step)
    steps: int = 0
    tokens: list[list[int]] = field(default_factory=list)  # per step, (n,) one token per row
    first: float = 0.0  # the first step's seconds (cold after a call of another kind)
    verify: float = 0.0  # every step's graph seconds
    host: float = 0.0

    def row_tokens(self, b: int) -> list[int]:
        return [t[b] for t in self.tokens]
