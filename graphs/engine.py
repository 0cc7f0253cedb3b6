"""A serving engine: requests join and leave at every step, each with its own settings.

    engine = decoder.engine(EngineConfig(max_batch=8))
    a = engine.add_request("def main(", max_new_tokens=64)                  # greedy, adaptive
    b = engine.add_request([5, 9, 3], temperature=0.8, seed=1, speculation="off")
    while engine.has_pending_requests():
        for event in engine.step():          # tokens each live request gained this step
            print(event.request_id, event.text, event.finish_reason)
    engine.remove_request(a)                 # cancel (from any thread): its K/V row is freed

The engine talks to the graphs only through its executor (:mod:`graphs.executor`: the host one,
:class:`graphs.host.HostExecutor`, or a test's fake); a step is data (:mod:`graphs.step`). One step
(the one loop, for every drafting strategy of :mod:`graphs.proposers`), phase by phase::

    commands  requests added / removed since the last step (from any thread) are applied
    plan      one width for the batch from measured costs and each request's gains (graphs.adaptive)
    propose   the proposer drafts a tree per drafting row (plain rows verify their root only)
    verify    one base forward over every occupied row: its tree, padded to the batch's width
    select    each row's own sampler walks its tree (greedy, lossless rejection sampling, typical)
    commit    each row's accepted K/V is kept at its own length (the executor's K/V rows)
    advance   the proposer updates each row's drafter state
    account   the step's record folds into the policy's costs and gains and the statistics
    emit      tokens, text, stop strings, finish reasons; finished rows leave at once
    prefill   waiting requests take free rows; prompt chunks of ``prefill_chunk`` tokens run within
              the step's token budget, so a long prompt never stalls the others for its whole length

Plain steps in a row: where no row drafts and nothing can happen between steps, one ``step()`` runs
plain steps back to back (``EngineConfig.plain_run_s``; :meth:`Engine._plain_step`), each the call
it would be alone; the run ends at an end token, a stop string, an arrival, a cancel, a deadline,
:meth:`Engine.interrupt`, and its tokens come in one event per request.

Errors: what one request's own work raises inside a step (its sampling, stop strings, text) ends
that request alone, with ``finish_reason="error"`` and the exception on its event (``RequestEvent.
error``); the step goes on for the others. Only a failure of what the batch shares (a graph call,
the K/V) leaves :meth:`Engine.step`.

Per-request state lives in the :class:`Request`: tokens, K/V row, drafter state, sampler (its own
seed), parameters, speculation switch, gains and statistics. What the engine shares between requests
is what the machine measured (the costs of its calls and the mean gains per setting).

Threads: one thread drives :meth:`Engine.step`. :meth:`add_request`, :meth:`remove_request`,
:meth:`has_pending_requests` and :meth:`request` may be called from any thread and never wait for a
running step (a short lock guards the incoming queue): an added request joins at the next step; a
removed one has its row freed at once, or, while a step runs, by that step before it returns. A
caller that keeps its own queue for the engine's thread calls :meth:`interrupt` as it queues.
Sessions are shared by every engine of a decoder (ONNX Runtime sessions may be run from several
threads); each engine has its own executor and K/V.

Memory: the base's K/V (and the EAGLE or DFlash drafter's) is one row per request slot of at most ``max_len``
positions (plus one tree), allocated as rows fill up and never past that budget
(:meth:`Engine.memory`); a request that cannot fit is refused at :meth:`add_request` with the limit
named, one that finds no free row waits (``max_waiting`` bounds the queue: CapacityError beyond it).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from graphs import contract as C
from graphs import emit
from graphs.adaptive import IDLE, SPEC_ADAPTIVE, SPEC_OFF, SPEC_ON, AdaptiveConfig, Planner, root_only
from graphs.errors import CapacityError, InputError, NonFiniteLogitsError
from graphs.params import GenerationParams, Resolved
from graphs.proposers import DFlash, Eagle, Medusa, Plain
from graphs.requests import DECODING, DONE, PREFILL, WAITING, Request
from graphs.results import RequestEvent, Stats
from graphs.step import CallTime, Drafts, PlainRecord, Proposal, RowResult, StepPlan, StepRecord
from graphs.trees import Tree

# Plain steps one run may take at most: the K/V room a run reserves ahead (its rows grow as they
# fill, not to their whole length at once); a tiny model's 0.1 ms steps fill plain_run_s with fewer.
PLAIN_RUN_MAX = 64
PROPOSERS = {"medusa": Medusa, "eagle": Eagle, "dflash": DFlash}  # the drafter kind's proposer
_MODES = {"off": SPEC_OFF, "on": SPEC_ON, "adaptive": SPEC_ADAPTIVE}
# Per-step accepted lengths an engine's totals keep (Stats.accepted): a server's engine lives for
# days; the histogram (Stats.accepted_counts) and so the mean stay exact over every step.
ACCEPTED_WINDOW = 4096


@dataclass
class EngineConfig:
    max_batch: int = 8
    """Requests decoding at once (K/V rows); more wait in the queue."""
    max_len: int | None = None
    """Positions per request, prompt + new tokens (default: the model's context, at most 2048)."""
    prefill_chunk: int = 64
    """Prompt tokens per prefill call: a long prompt is cached in chunks of this size."""
    step_tokens: int = 256
    """Token budget of one step: prefill chunks run while the decode rows leave room (one at least)."""
    max_waiting: int | None = None
    """Requests that may wait for a row (None: unbounded); beyond, add_request raises CapacityError."""
    max_tree: int = 64
    """Nodes of the largest tree a request may verify (K/V headroom past a full row)."""
    plain_run_s: float = 0.01
    """Seconds of plain (autoregressive) steps one ``step()`` may run in a row while nothing else can
    happen (no request arrives, finishes or waits for a row): the same calls as one at a time, the
    Python around them paid once (events then carry the run's tokens). 0: one step per call."""

    def __post_init__(self):
        for name in ("max_batch", "prefill_chunk", "step_tokens", "max_tree"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"EngineConfig.{name} must be an int >= 1, got {v!r}")
        if self.max_len is not None and (not isinstance(self.max_len, int) or self.max_len < 2):
            raise InputError(f"EngineConfig.max_len must be an int >= 2, got {self.max_len!r}")
        if (isinstance(self.plain_run_s, bool) or not isinstance(self.plain_run_s, (int, float))
                or not 0 <= self.plain_run_s <= 60):
            raise InputError(f"EngineConfig.plain_run_s must be a number of seconds in [0, 60], "
                             f"got {self.plain_run_s!r}")
        if self.max_waiting is not None and (not isinstance(self.max_waiting, int) or self.max_waiting < 0):
            raise InputError(f"EngineConfig.max_waiting must be an int >= 0 or None, got {self.max_waiting!r}")


@dataclass
class VerifyRecord:
    """One row of one verify step (what :meth:`graphs.runtime.Decoder.watch_verify` records)."""

    request_id: int
    tree: Tree  # verified
    tokens: np.ndarray  # (tree.size,) its tokens, root first
    position: int  # the root's position
    accepted: list[int]  # accepted node indices, root first
    bonus: int
    step: int = 0  # the engine's step count (Engine.totals.steps) when verified


class Engine:
    """Continuous batching over one executor (see the module doc).

    Its collaborators are injected (a composition seam, as onnxruntime-genai's ``EngineDependencies``):
    ``make_executor(slots, max_len, headroom)`` the graph calls and K/V (graphs.executor), ``requests``
    what makes and names requests (graphs.requests.RequestMaker: resolve, new_request, tokenizer,
    decode), ``planner`` the adaptive policy, ``watchers`` the shared lists that record each verify."""

    def __init__(self, make_executor, requests, config: EngineConfig | None = None, planner: Planner | None = None,
                 watchers: list | None = None, keep_kv: bool = False, full_stats: bool = False, first_id: int = 0):
        """``keep_kv``: keep the K/V memory when no request is left (for a caller that lends it on); by
        default an engine gives it back then (a server's engine between bursts). ``full_stats``:
        ``totals.accepted`` keeps every step's entry (a generate batch: bounded by its requests), else the
        last ACCEPTED_WINDOW. ``first_id``: the first request id (an engine rebuilt after a failure
        starts past its predecessor's, so a late cancel of an old id never ends a new request)."""
        self.requests = requests
        self.config = cfg = config or EngineConfig()
        limit = requests.max_positions
        self.max_len = min(cfg.max_len or 2048, limit)
        if cfg.max_len is not None and cfg.max_len > limit:
            raise InputError(f"EngineConfig.max_len {cfg.max_len} exceeds the model's context of {limit} positions")
        self.ex = make_executor(cfg.max_batch, self.max_len, cfg.max_tree)
        self.keep_kv = keep_kv
        self.plain = Plain(self.ex)
        proposer = PROPOSERS.get(self.ex.info.kind)
        self.proposer = proposer(self.ex) if proposer else self.plain
        self.planner = planner or Planner()
        self.watchers = watchers if watchers is not None else []
        # what the last call was ("prefill", "plain" or "drafted"): a decode step of the other kind
        # runs cold, its costs not folded into the planner's (graphs.adaptive.Costs)
        self._last_call = "prefill"
        self.totals = Stats()  # every step of this engine (a batch's stats for generate)
        self.full_stats = full_stats
        self._rows: list[Request] = []  # occupied rows, index = slot
        self._waiting: deque[Request] = deque()
        self._by_id: dict[int, Request] = {}
        self._removed: list[RequestEvent] = []  # finish events of requests removed between steps
        self._incoming: deque[Request] = deque()  # added since the last step (any thread)
        self._cancels: list[int] = []  # removed while a step ran: applied before it returns
        self._ids = itertools.count(first_id)
        self._lock = threading.RLock()  # held by a step (and by changes to the rows)
        self._in_lock = threading.Lock()  # the incoming queue, cancels and the id table: never held long
        self._stepping = False
        self._finished = False  # a request finished since the last _retire (its row, if any, to free)
        self._deadlines = False  # a request with a deadline was added (_expire has something to check)
        self._interrupt = False  # interrupt(): end the plain run in progress

    @property
    def kv(self):
        """The base's K/V rows of a host executor (graphs.slots.SlotCache: tests, the decoder's spare)."""
        return self.ex.kv

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt, params: GenerationParams | Resolved | None = None, *,
                    deadline_s: float | None = None, **overrides) -> int:
        """Queue one request (a string or a list of token ids); returns its id. Any thread.

        ``params``/``overrides`` as :meth:`graphs.runtime.Decoder.generate`; ``deadline_s``: seconds
        from now after which it finishes with ``finish_reason="deadline"``."""
        r = params if isinstance(params, Resolved) else self.requests.resolve(params, **overrides)
        return self.add(self.requests.new_request(prompt, r, self.max_len), deadline_s=deadline_s)

    def add(self, req: Request, deadline_s: float | None = None) -> int:
        """Queue a request made by :meth:`graphs.requests.RequestMaker.new_request`; returns its id. Any thread."""
        if isinstance(req.tree, dict) and "depth" in req.tree and req.tree_role is None:  # step-wise EAGLE
            need = max(req.tree_size, req.tree["topk"] * req.tree["depth"])
        else:
            need = req.tree_size
        if need > self.config.max_tree:
            raise InputError(f"a tree of {need} nodes exceeds this engine's max_tree of "
                             f"{self.config.max_tree}; use a smaller tree or a larger EngineConfig.max_tree")
        if deadline_s is not None:
            if not isinstance(deadline_s, (int, float)) or not deadline_s > 0:
                raise InputError(f"deadline_s must be a number > 0, got {deadline_s!r}")
            req.deadline = time.perf_counter() + float(deadline_s)
            self._deadlines = True
        with self._in_lock:
            # requests that will find a free row at the next step's admission do not wait
            waiting = len(self._waiting) + len(self._incoming) - max(self.config.max_batch - len(self._rows), 0)
            if self.config.max_waiting is not None and waiting >= self.config.max_waiting:
                raise CapacityError(f"{waiting} requests already wait for a row (max_waiting "
                                    f"{self.config.max_waiting}); retry later")
            req.id = next(self._ids)
            req.t_added = time.perf_counter()
            self._incoming.append(req)
            self._by_id[req.id] = req
        return req.id

    def remove_request(self, request_id: int) -> bool:
        """Cancel a request (any thread, never blocking on a running step): its row is freed now, or
        by the running step before it returns. False if it is unknown or already finished."""
        with self._in_lock:
            req = self._by_id.get(request_id)
            if req is None or req.done:
                return False
            if not self._lock.acquire(blocking=False):  # a step is running: it frees the row
                self._cancels.append(request_id)
                return True
        try:
            self._cancel(request_id)
        finally:
            self._lock.release()
        return True

    def _cancel(self, request_id: int) -> None:
        """Finish a request as cancelled and free its row (under the step lock)."""
        with self._in_lock:
            req = self._by_id.get(request_id)
            if req is None or req.done:
                return
            with contextlib.suppress(ValueError):
                self._incoming.remove(req)
        self._finish(req, "cancelled")
        self._removed.append(emit.event(req, []))
        self._retire()

    def interrupt(self) -> None:
        """End the run of plain steps in progress after its current step (or the next run's after its
        first, when none is running). Any thread: a caller that keeps its own queue of requests and
        cancellations for the engine's thread (the server's worker) calls it when it queues one, as
        :meth:`add_request` and :meth:`remove_request` end a run themselves."""
        self._interrupt = True

    def has_pending_requests(self) -> bool:
        """Whether a step has anything to do (any thread)."""
        with self._in_lock:
            return bool(self._rows or self._waiting or self._removed or self._incoming or self._cancels)

    def request(self, request_id: int) -> Request | None:
        """A live request (its stats, tokens so far); None once finished."""
        with self._in_lock:
            return self._by_id.get(request_id)

    def memory(self) -> dict:
        """K/V memory: what the budget can ever take and what is allocated now (bytes)."""
        mem = self.ex.memory()
        return {"slots": self.config.max_batch, "max_len": self.max_len, "kv_budget_bytes": mem.pop("kv_budget_bytes"),
                "kv_allocated_bytes": mem.pop("kv_allocated_bytes"), "rows_used": self.ex.rows,
                "waiting": len(self._waiting) + len(self._incoming), **mem}

    # ------------------------------------------------------------------ the loop

    def step(self) -> list:
        """One decode step over every live request, then admission and prefill. The engine's thread."""
        with self._lock:
            if self._stepping:
                raise RuntimeError("Engine.step is not reentrant: drive it from one thread")
            self._stepping = True
            try:
                self._take_commands()
                events, self._removed = self._removed, []
                self._expire(events)
                if any(r.state == DECODING for r in self._rows):
                    events += self._decode(one=bool(events))  # events to say: no run before them
                self._retire()
                self._take_commands()  # requests that came during the decode are admitted now
                self._admit()
                events += self._prefill()
                self._retire()
                self._take_commands()  # removals that came during the step land before it returns
                events += self._removed
                self._removed = []
                return events
            finally:
                self._stepping = False

    def _take_commands(self) -> None:
        with self._in_lock:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
            cancels, self._cancels = self._cancels, []
        for rid in cancels:
            self._cancel(rid)

    def _expire(self, events: list) -> None:
        if not self._deadlines:
            return
        now = time.perf_counter()
        for req in [*self._rows, *self._waiting]:
            if req.deadline is not None and now >= req.deadline and not req.done:
                self._finish(req, "deadline")
                events.append(emit.event(req, []))
        self._retire()

    def _admit(self) -> None:
        while self._waiting and len(self._rows) < self.config.max_batch:
            req = self._waiting.popleft()
            if req.done:
                continue
            req.slot = self.ex.add_row()
            self._rows.append(req)
            req.state = PREFILL
            req.draft = self._proposer(req).new_state(req)

    def _proposer(self, req: Request):
        return self.plain if req.speculation == "off" else self.proposer

    def _prefill(self) -> list:
        """Prompt chunks within the step's token budget, one base call per contiguous run of rows."""
        if all(r.state != PREFILL for r in self._rows):
            return []
        self._last_call = "prefill"  # the decode step after it runs cold
        cfg = self.config
        decoding = sum(r.state == DECODING for r in self._rows)
        budget = max(cfg.step_tokens - decoding * self.planner.last_width, cfg.prefill_chunk)
        chosen = []
        for req in self._rows:
            if req.state != PREFILL:
                continue
            c = min(cfg.prefill_chunk, len(req.prompt) - req.prefilled)
            if chosen and c > budget:
                break
            chosen.append((req, c))
            budget -= c
        events = []
        runs: list[list] = []
        for req, c in chosen:  # contiguous slots share one call
            if runs and runs[-1][-1][0].slot == req.slot - 1:
                runs[-1].append((req, c))
            else:
                runs.append([(req, c)])
        for run in runs:
            events += self._prefill_run(run)
        return events

    def _prefill_run(self, run: list) -> list:
        lo, bsz = run[0][0].slot, len(run)
        s = max(c for _, c in run)
        ids = np.full((bsz, s), self.ex.info.pad, dtype=np.int64)
        pos = np.zeros((bsz, s), dtype=np.int64)
        counts = np.array([c for _, c in run], dtype=np.int64)
        for j, (req, c) in enumerate(run):
            ids[j, :c] = req.prompt[req.prefilled : req.prefilled + c]
            pos[j] = req.prefilled + np.arange(s)
        causal = np.tril(np.ones((s, s), dtype=bool))[None] & (np.arange(s)[None, None, :] < counts[:, None, None])
        causal |= np.eye(s, dtype=bool)[None]  # pad rows see themselves: no empty softmax
        t0 = time.perf_counter()
        out = self.ex.prefill(lo, ids, pos, causal)
        t = time.perf_counter() - t0
        self.planner.costs.add_verify(bsz * s, t)
        self.totals.time_prefill += t
        self.ex.commit(np.broadcast_to(np.arange(s), (bsz, s)), counts, first=lo)
        events = []
        for j, (req, c) in enumerate(run):
            req.stats.time_prefill += t
            start, end = req.prefilled, req.prefilled + c
            req.prefilled = end
            row_out = {k: v[j : j + 1] for k, v in out.items() if not k.startswith("present.")}
            root = None
            if end == len(req.prompt):
                try:
                    root = req.sampler.token(out[C.LOGITS][j, c - 1])
                except Exception as e:  # this request's own (non-finite logits in its row, ...)
                    self._request_failed(req, e)
                    continue
                req.root, req.position, req.state = root, end, DECODING
                req.stats.time_to_first_token = time.perf_counter() - req.t_added
            t_draft = self._proposer(req).prefilled(req, req.slot, row_out, start, end, root)
            req.stats.time_prefill += t_draft
            self.totals.time_prefill += t_draft
            if root is not None:
                ev = self._emit(req, [root])
                if ev is not None:
                    events.append(ev)
        return events

    # ------------------------------------------------------------------ a decode step, in phases

    def _decode(self, one: bool = False) -> list:
        """One decode step of every decoding row (``one`` False: a run of plain steps where one may run):
        plan -> (a plain run, or) propose -> verify -> select -> commit -> advance -> account -> emit."""
        t_start = time.perf_counter()
        plan = self._plan()
        if not plan.drafted:
            events = self._plain_step(plan.live, t_start, 1 if one else self._plain_run(plan.live))
            if events is not None:
                return events
        rec = self._speculate(plan)
        cold = self._switched("drafted" if plan.drafted else "plain")
        for c in rec.calls:  # what each call cost, for the policy (a call after one of another kind: cold)
            if c.kind == "draft":
                self.planner.costs.add_draft(c.rows, c.seconds, cold)
            else:
                self.planner.costs.add_verify(c.rows * c.width, c.seconds, cold)
        self._count_step(plan.drafted, rec.seconds("verify"), rec.drafts.seconds, rec.drafts.calls)
        events = self._emit_step(rec)
        rec.host = time.perf_counter() - t_start - rec.seconds("verify") - rec.drafts.seconds
        self.planner.costs.add_host(plan.drafted, rec.host, len(plan.live), cold)
        return events

    def _plan(self) -> StepPlan:
        """Each row's tree size for this step (the policy's, where a row may speculate)."""
        live = [r if r.state == DECODING else None for r in self._rows]
        adaptive = any(r is not None and r.speculation == "adaptive" for r in live)
        if not any(r is not None and r.speculation != "off" for r in live):  # nobody may: nothing to decide
            return StepPlan(live, np.array([0 if r is None else 1 for r in live], dtype=np.int64), False, adaptive)
        modes = np.array([IDLE if r is None else _MODES[r.speculation] for r in live])
        full = np.array([1 if r is None else r.tree_size for r in live], dtype=np.int64)
        sizes = self.planner.plan(modes, full,
                                  lambda: [None if r is None or r.gains is None else r.gains.predicted() for r in live],
                                  lambda: [None if r is None or r.gains is None else r.gains.ceiling for r in live])
        return StepPlan(live, sizes, max(sizes.tolist()) > 1, adaptive)

    def _speculate(self, plan: StepPlan) -> StepRecord:
        """Propose, verify every occupied row (its tree padded to the batch's width), select each row's
        accepted nodes, commit their K/V, advance the drafter. A row whose own selection fails ends
        alone and keeps nothing of this step."""
        live = plan.live
        drafts = (self.proposer if plan.drafted else self.plain).propose(live, plan.sizes)
        t0 = time.perf_counter()
        out = self.ex.verify([p.tree for p in drafts.rows], [p.tokens for p in drafts.rows])
        t_verify = time.perf_counter() - t0
        picks = [None if r is None else (r.sampler, drafts.rows[b].tree, drafts.rows[b].tokens)
                 for b, r in enumerate(live)]
        results: list[RowResult | None] = [None] * len(live)
        for b, got in enumerate(self.ex.select(out, picks)):
            if isinstance(got, BaseException):  # this request's own: it ends, its row keeps nothing
                self._request_failed(live[b], got)
                live[b] = None
            elif got is not None:
                a, bonus = got
                cand = drafts.rows[b].tokens
                toks = [*cand[a[1:]].tolist(), int(bonus)] if len(a) > 1 else [int(bonus)]
                results[b] = RowResult(a, int(bonus), toks)
        counts = [0 if r is None else len(r.accepted) for r in results]
        m = max(max(counts), 1)
        idx = np.array([[0] * m if r is None else r.accepted + [0] * (m - len(r.accepted)) for r in results],
                       dtype=np.int64)  # (n, m)
        self.ex.commit(idx, np.array(counts, dtype=np.int64))
        self.proposer.advance(live, out, results, drafts, plan.sizes)
        n = len(live)
        calls = [CallTime("verify", n, drafts.width, t_verify)]
        if plan.drafted:  # (its drafter calls, timed by the proposer as one)
            calls.append(CallTime("draft", n, drafts.calls, drafts.seconds))
        return StepRecord(plan, drafts, results, calls)

    def _emit_step(self, rec: StepRecord) -> list:
        """Each row's statistics, gains (the policy's) and watchers, then its tokens emitted."""
        plan, tot = rec.plan, self.totals
        t_verify = rec.seconds("verify")
        events = []
        for b, req in enumerate(plan.live):
            res = rec.results[b]
            if req is None or res is None:
                continue
            prop = rec.drafts.rows[b]
            if plan.sizes[b] > 1:
                req.stats.time_draft += rec.drafts.seconds
                req.stats.draft_calls += rec.drafts.calls
                for st in (req.stats, tot):
                    _count_drafts(st, prop.tree.size - 1, len(res.accepted) - 1)
                if self.planner.fast and len(res.accepted) == 1:  # a reused full-tree window, wholly rejected
                    self.planner.end_fast()
                if req.gains is not None and plan.adaptive and not self.planner.fast:  # (where a width is chosen)
                    # the setting's mean learns from every drafted step (new requests start from it
                    # at once, not after the first ones finish: a cold setting costs fewer probes)
                    self.planner.learn(req.prior_key, req.gains.observe(prop.tree, res.accepted))
            else:
                req.stats.plain_steps += 1
            if self.watchers:
                self._watched(req, prop.tree, prop.tokens, res.accepted, res.bonus, self.watchers)
            ev = self._moved(req, [len(res.accepted)], res.tokens, t_verify)
            if ev is not None:
                events.append(ev)
        return events

    # ------------------------------------------------------------------ plain steps in a row

    def _plain_step(self, live: list, t_start: float, most: int = 1) -> list | None:
        """Plain steps, in which no row drafts: every row verifies its root (the autoregressive step), on
        the executor's bound call (:meth:`graphs.executor.Executor.plain_run`). It is the general path
        with a one-node tree per row, whose tree arrays, acceptance walk and K/V moves are the
        identity: the root's token is the row's sampled token, each row keeps its one new column.

        Up to ``most`` such steps run in a row (:meth:`_plain_run`) while nothing could happen between
        them: each computes what it computes alone (the same call, inputs and sampler draws), and the
        Python around a step (admission, statistics, events) is paid once for the run; its tokens come
        in one event per row, as a speculative step's do. Returns None (nothing done) where the
        executor has no bound step: the general path runs then."""
        run = self.ex.plain_run(most)
        if run is None:
            return None
        rec = PlainRecord(live, list(self.watchers))
        said = self._plain_loop(run, rec, t_start)
        # right after a drafted step or a prefill the first plain call is cold (graphs.adaptive.Costs):
        # measured by the run's other steps, or not folded in where it ran alone
        cold = self._switched("plain")
        counts = np.array([0 if r is None else 1 for r in live], dtype=np.int64)
        self.ex.keep_new(counts * rec.steps)  # each decoding row keeps the column each step wrote
        if cold and rec.steps > 1:
            self.planner.costs.add_verify(len(live), (rec.verify - rec.first) / (rec.steps - 1))
        else:
            self.planner.costs.add_verify(len(live), rec.verify / rec.steps, cold)
        self._count_step(False, rec.verify, 0.0, 0, rec.steps)
        events = self._emit_plain(rec, said)
        rec.host = (time.perf_counter() - t_start - rec.verify) / rec.steps
        self.planner.costs.add_host(False, rec.host, len(live), cold and rec.steps == 1)
        return events

    def _plain_loop(self, run, rec: PlainRecord, t_start: float) -> list:
        """The run's steps until one ends it; fills ``rec``. Returns the events of rows
        with stop strings, said token by token (their text is matched each step)."""
        live = rec.live
        roots = [0 if r is None else r.root for r in live]  # a prefilling row computes a column it never keeps
        drafts = any(r is not None and r.draft is not None for r in live)  # drafter state to keep up to date
        each = drafts and self.proposer.every_plain_step  # (EAGLE's context rows; Medusa: a run's last state)
        adaptive = any(r is not None and r.speculation != "off" for r in live)
        by_token = [r is not None and bool(r.params.stop_strings) for r in live]
        said = [[] for _ in live]  # their events, merged into one at the end
        # greedy rows without stop strings or drafter state to follow each step (the common case): each
        # step's argmax goes straight into the next call's inputs, the tokens are read once a step
        greedy = not each and not any(by_token) and all(r is not None and r.sampler.temperature == 0 for r in live)
        eos = set().union(*(r.eos for r in live if r is not None))  # any row's: a step's one set lookup
        deadline = min((r.deadline for r in (*live, *self._waiting) if r is not None and r.deadline is not None),
                       default=None)
        end, most, got = t_start + self.config.plain_run_s, run.steps, rec.tokens
        t_verify = 0.0  # (locals in the loop: a step of a tiny model is ~0.1 ms, its Python counts)
        while True:
            t0 = time.perf_counter()
            out = run.step(roots) if not got else run.again()  # the next ones moved on in place
            t1 = time.perf_counter()
            t_verify += t1 - t0
            if not got:
                rec.first = t1 - t0
            row = None
            if greedy:
                with contextlib.suppress(NonFiniteLogitsError):  # (a row's: found by its sampler below)
                    row = run.greedy().tolist()
                    ends = not eos.isdisjoint(row) and any(t in r.eos for t, r in zip(row, live))
            if row is None:  # a row whose sampling fails ends alone (_request_failed), and the run with it
                row, ends = self._plain_tokens(live, out, roots, by_token, said)
                run.feed(row)
            got.append(row)
            # a row that ends, the run's steps or time, a request that arrives or is cancelled (here or in
            # a caller's queue: interrupt), a deadline, a watcher that started: the run ends after this step
            stop = (ends or len(got) >= most or t1 >= end or self._incoming or self._cancels or self._interrupt
                    or (deadline is not None and t1 >= deadline) or (not rec.watchers and self.watchers))
            if each or (drafts and stop):
                # the drafter state follows the step (Medusa's only a run's last, whose outputs these are;
                # a run ended by an error keeps the state before it: a worse draft, never a wrong token)
                results = [None if r is None else RowResult([0], t, [t]) for r, t in zip(live, row)]
                self.proposer.advance(live, out, results, Drafts(roots_of(roots)), [int(r is not None) for r in live])
            roots = row
            if stop:
                self._interrupt = False
                rec.steps, rec.verify = len(got), t_verify
                return said
            if adaptive:
                self.planner.planned_plain()  # the next step is one the policy already decided

    def _plain_tokens(self, live: list, out: dict, roots: list, by_token: list, said: list):
        """One plain step's tokens, each row's sampler choosing as the general path's one-node
        acceptance does (greedy: the argmax; sampled: the same random stream); rows with stop strings
        grow their text (``said[b]``: their events). Returns (tokens, a row ended)."""
        row, ends = [0] * len(live), False
        tree = root_only()
        picks = [None if r is None else (r.sampler, tree, roots[b : b + 1]) for b, r in enumerate(live)]
        for b, got in enumerate(self.ex.select(out, picks)):  # every row's token first
            if isinstance(got, BaseException):  # this request's own: it ends alone, its row feeds a 0
                self._request_failed(live[b], got)
                ends = True
            elif got is not None:
                row[b] = got[1]
        for b, req in enumerate(live):
            if req is None or req.error is not None:
                continue
            if by_token[b]:
                ev = self._emit(req, [row[b]])
                if ev is not None:
                    said[b].append(ev)
                ends = ends or req.done is not None
            else:
                ends = ends or row[b] in req.eos
        return row, ends

    def _emit_plain(self, rec: PlainRecord, said: list) -> list:
        """A plain run's statistics and watchers, its tokens in one event per row."""
        events = []
        for b, req in enumerate(rec.live):
            if req is None or req.error is not None:  # (a failed row: its run's tokens are dropped)
                continue
            req.stats.plain_steps += rec.steps
            toks = rec.row_tokens(b)
            if rec.watchers:
                self._watched(req, root_only(), np.array([req.root], dtype=np.int64), [0], toks[0], rec.watchers)
            ev = self._moved(req, [1] * rec.steps, toks, rec.verify, emit=not req.params.stop_strings)
            if said[b]:
                ev = RequestEvent(req.id, [x for e in said[b] for x in e.token_ids], "".join(e.text for e in said[b]),
                                  said[b][-1].finish_reason, said[b][-1].stats)
            if ev is not None:
                events.append(ev)
        return events

    def _switched(self, kind: str) -> bool:
        """A decode step of ``kind`` ("plain" / "drafted") ran: whether the call before it was of another
        kind (or a prefill), which makes this one cold (graphs.adaptive.Costs)."""
        cold, self._last_call = kind != self._last_call, kind
        return cold

    def _plain_run(self, live: list) -> int:
        """Plain steps one call of :meth:`_plain_step` may run: 1 where anything may happen between
        two steps that the engine's loop must see (a prefilling row, a request that could take a
        free row, a watcher of each verify); where rows may speculate, the plain steps the adaptive
        policy has already decided (:meth:`graphs.adaptive.Planner.plain_ahead`); else as many as
        every row has room for, at most PLAIN_RUN_MAX. The run also ends at an end token, an arriving
        or cancelled request, a deadline, after ``plain_run_s``."""
        if self.config.plain_run_s <= 0 or None in live or self.watchers:
            return 1
        if self._waiting and len(self._rows) < self.config.max_batch:
            return 1
        room = max(1, min(PLAIN_RUN_MAX, *(self._limit(r) - len(r.tokens) for r in live)))
        if any(r.speculation != "off" for r in live):  # the policy chooses the widths: the steps it already has
            return min(room, 1 + self.planner.plain_ahead())
        return room

    def _count_step(self, drafted: bool, t_verify: float, t_draft: float, calls: int, steps: int = 1) -> Stats:
        """The engine's totals after one decode step (or a run of ``steps`` plain ones); returns them."""
        tot = self.totals
        tot.steps += steps
        tot.plain_steps += 0 if drafted else steps
        tot.time_verify += t_verify
        tot.time_draft += t_draft
        tot.draft_calls += calls
        return tot

    def _watched(self, req: Request, tree, cand, a: list, bonus: int, watchers: list) -> None:
        rec = VerifyRecord(req.id, tree, cand, req.position, list(a), bonus, self.totals.steps)
        for w in list(watchers):
            w.append(rec)

    def _moved(self, req: Request, accepted: list[int], toks: list[int], t_verify: float, emit: bool = True):
        """Row ``req``'s steps (one, or a run of plain ones) accepted ``accepted[i]`` tokens each, ``toks``
        in all, the last the row's new root: its statistics and position move on, the tokens are emitted
        (``emit`` False: they were, one by one)."""
        st = req.stats
        st.steps += len(accepted)
        st.time_verify += t_verify
        st.add_accepted(accepted)
        self.totals.add_accepted(accepted, None if self.full_stats else ACCEPTED_WINDOW)
        req.position += sum(accepted)
        req.root = toks[-1]
        return self._emit(req, toks) if emit else None

    # ------------------------------------------------------------------ emit and retire

    def _limit(self, req: Request) -> int:
        """The new tokens ``req`` may have: its max_new_tokens, within the engine's positions."""
        return min(req.max_new, self.max_len - len(req.prompt))

    def _emit(self, req: Request, toks: list[int]):
        """Append accepted tokens: eos, stop strings, length; the event (None if nothing to say). A
        failure of the request's own text or stop strings ends it alone (:meth:`_request_failed`)."""
        try:
            return self._emit_tokens(req, toks)
        except Exception as e:
            self._request_failed(req, e)
            return None

    def _emit_tokens(self, req: Request, toks: list[int]):
        if req.done:
            return None
        toks = emit.append_tokens(req, toks, self._limit(req), self.requests)
        if req.done:
            self._finish(req, req.done)
        return emit.event(req, toks)

    def _request_failed(self, req: Request, error: BaseException) -> None:
        """Its own sampling, stop strings or text raised: this request alone ends, with finish_reason
        "error" and ``error`` on its event; its row is freed by the step's :meth:`_retire`. Only a
        failure of a call the batch shares (a graph, the K/V) leaves :meth:`step` and fails them all."""
        if req.state == DONE:
            return
        req.error = error
        self._finish(req, "error")
        self._removed.append(RequestEvent(req.id, [], "", "error", req.stats, error=error))

    def _finish(self, req: Request, reason: str) -> None:
        req.done = reason
        self._finished = True
        st = req.stats
        st.new_tokens = len(req.tokens)
        st.time_total = time.perf_counter() - req.t_added
        if req.state == WAITING:
            with contextlib.suppress(ValueError):
                self._waiting.remove(req)
        req.state = DONE
        with self._in_lock:
            self._by_id.pop(req.id, None)

    def _retire(self) -> None:
        """Free the rows of finished requests (the last row moves into each freed one)."""
        if not self._finished:  # nothing finished since the last call: every row is live
            return
        self._finished = False
        for req in [r for r in self._rows if r.done]:
            b = req.slot
            self.ex.remove_row(b)
            last = self._rows.pop()
            if last is not req:
                self._rows[b] = last
                last.slot = b
            req.slot = None
        if not self._rows:
            self.ex.shrink(keep_base=self.keep_kv)


def roots_of(tokens: list[int]) -> list[Proposal]:
    """A plain step's proposals: each row's token alone."""
    return [Proposal(root_only(), np.array([x], dtype=np.int64)) for x in tokens]


def _count_drafts(st: Stats, drafted: int, accepted: int) -> None:
    """vLLM's spec-decode counters of one drafted row: draft tokens, accepted drafts, accepted by position."""
    st.draft_tokens += drafted
    st.accepted_drafts += accepted
    if len(st.accepted_per_pos) < accepted:
        st.accepted_per_pos += [0] * (accepted - len(st.accepted_per_pos))
    for k in range(accepted):
        st.accepted_per_pos[k] += 1


__all__ = ["AdaptiveConfig", "Engine", "EngineConfig", "Request", "VerifyRecord"]
