"""The draft-verify loop on ONNX Runtime, from an export directory alone (no torch, no transformers).

    decoder = graphs.load("out_dir", provider="auto")
    result = decoder.generate("def main(", max_new_tokens=64)
    result.text, result.token_ids, result.stats.mean_accepted_length

One decode step, speculative (``mode="speculative"``, the default when the export has a drafter)::

    draft   Medusa: heads on the last hidden state -> top-k per head -> static tree of candidates
            EAGLE:  drafter over the newly accepted tokens, then `depth` drafter calls growing an
                    EAGLE-2 dynamic tree (best `total_tokens` nodes by cumulative log-probability)
    verify  one base forward over the whole tree (tree mask, positions = cache length + depth)
    accept  walk the tree with the base's own choices: greedy, lossless rejection sampling, or
            Medusa's typical acceptance; emit the accepted tokens plus one bonus token
    commit  one gather moves the accepted nodes' K/V rows into the cache; nothing is recomputed

Every step emits ``len(accepted)`` >= 1 tokens, so greedy output equals plain greedy decoding of
the base token for token; ``mean_accepted_length`` (tau) is tokens per base forward.

:class:`Decoder` is a facade over three parts: the sessions (:class:`graphs.host.HostModel`), what
makes requests (:class:`graphs.requests.RequestMaker`) and the loop (:class:`graphs.engine.Engine`,
one per ``generate``/``stream`` call, on its own :class:`graphs.host.HostExecutor`). What it keeps
across runs is what the machine measured (call costs, mean gains per setting), which the adaptive
policy of every engine it makes reads and updates.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from graphs.adaptive import Costs, Planner
from graphs.engine import Engine, EngineConfig
from graphs.errors import InputError
from graphs.host import HostExecutor, HostModel, verify_with
from graphs.manifest import Manifest
from graphs.params import GenerationParams, Resolved, check_prompt
from graphs.requests import RequestMaker, is_batch
from graphs.results import GenerationResult, Stats, StreamEvent
from graphs.sessions import InPlaceRun, make_session, resolve_provider, warn_if_other_target, warn_if_tree_stale

__all__ = ["Decoder", "GenerationResult", "Stats", "load"]


class Decoder:
    """An export's sessions built once from ``manifest.json``; ``generate``/``stream`` run the engine.

    What the decoder does not hold itself is one of its parts', read and set through it: sessions and
    graph calls (``base``, ``draft``, ``min_rows``, ``base_forward``, ``plain_step`` ...: tune, benchmarks)
    are its model's; ``eos``, ``tokenizer``, ``resolve``, ``new_request``, ``decode`` its request maker's."""

    verify = verify_with  # (the tuner times a verify through it: on any object with verify_trees, base_forward)

    def __init__(self, out_dir, provider: str = "auto", threads: int | None = None, optimization: str = "all",
                 verify: bool = True, io_binding: bool | None = None, device_id: int = 0, session_options=None,
                 provider_options: dict | None = None, eagle_draft: str = "auto", adaptive: bool = True,
                 device_resident: bool = False):
        _no_io_binding(io_binding)
        self.out_dir = Path(out_dir)
        self.manifest = m = Manifest.read(self.out_dir, verify=verify)
        self.provider = resolve_provider(provider)
        self.device_id = device_id
        warn_if_other_target(m.optimization, self.provider, str(out_dir))
        warn_if_tree_stale(m.tree, m.optimization, m.source.get("dtype", "float32"), str(out_dir))
        # what this machine measured, shared by every engine of this decoder (graphs.adaptive): call
        # costs here, mean gains per setting in the request maker; races only lose one average's update
        self.costs = Costs()
        self._watch: list[list] = []  # watch_verify() record lists (every engine's)
        self._watch_lock = threading.Lock()
        self._kv_spare = None  # the K/V cache of the last one-prompt generate/stream call (_keep_kv)
        self._spare_lock = threading.Lock()
        self.model = HostModel(self.out_dir, m, self.provider, make_session, threads, optimization, device_id,
                               session_options, provider_options, eagle_draft, verify)
        self.requests = RequestMaker(self.out_dir, m, self.model.max_positions, adaptive, eagle_draft)
        self.device_model = None  # the device path's sessions (graphs.device), where asked for
        if device_resident:
            from graphs.device import DeviceModel

            self.device_model = DeviceModel(self.model, make_session, (self.provider, threads, optimization, device_id,
                                                                       session_options, provider_options), device_id)

    def __getattr__(self, name):
        for part in ("model", "requests"):
            holder = self.__dict__.get(part)
            if holder is not None and hasattr(holder, name):
                return getattr(holder, name)
        raise AttributeError(f"'Decoder' object has no attribute {name!r}")

    def __setattr__(self, name, value) -> None:
        if name not in self.__dict__ and not hasattr(type(self), name):
            for part in ("model", "requests"):
                holder = self.__dict__.get(part)
                if holder is not None and hasattr(holder, name):
                    setattr(holder, name, value)
                    return
        object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ public API

    def load_sessions(self) -> None:
        """Make every session now: the base's is otherwise made when a batch of trees first comes
        (exports with a one-sequence graph). The server calls it at start when it may batch."""
        self.model.load_sessions()

    def engine(self, config: EngineConfig | None = None, first_id: int = 0, planner: Planner | None = None,
               kv=None, keep_kv: bool = False, full_stats: bool = False) -> Engine:
        """A serving engine on this decoder's sessions (:mod:`graphs.engine`): requests join and leave
        at every step, each with its own parameters and speculation switch. ``first_id``: its first
        request id (a server's engine rebuilt after a failure continues its predecessor's ids); ``kv``:
        an idle K/V cache of an earlier engine to reuse where it fits (:meth:`_spare_kv`)."""
        def executor(slots: int, max_len: int, headroom: int):
            if self.device_model is not None:  # K/V and logits on the device (graphs.device)
                from graphs.device import DeviceExecutor

                return DeviceExecutor(self.device_model, slots, max_len, headroom)
            return HostExecutor(self.model, slots, max_len, headroom, kv)

        return Engine(executor, self.requests, config, planner or self.new_planner(), self._watch, keep_kv,
                      full_stats, first_id)

    def generate(self, prompt, params: GenerationParams | None = None, **overrides):
        """Decode ``prompt`` (a string, a list of token ids, or a list of either for a batch).

        ``params``: a :class:`graphs.params.GenerationParams`; keyword ``overrides`` (its field names,
        e.g. ``max_new_tokens=64, temperature=0.7, stop="\\n\\n"``) go on top. Unset fields take the
        export's ``generation_config.json`` values, else the defaults (greedy, 64 new tokens).
        Returns a :class:`GenerationResult` (a list of them for a batch); ``stats`` are the batch's.
        ``mode``: "auto" (speculative if the export has a drafter), "speculative", "autoregressive".
        ``speculation``: "on", "off", "adaptive" (default: adaptive unless loaded with adaptive=False).
        ``tree``: Medusa paths (list or JSON file) or EAGLE ``{"topk", "depth", "total_tokens"}``;
        default from the manifest. ``acceptance`` when sampling: "lossless" (rejection sampling, keeps
        the base distribution) or "typical" (Medusa's, faster, not lossless).
        """
        requests, stats = [], Stats()
        for _ in self._run(prompt, self.resolve(params, **overrides), requests, stats, stream=False):
            pass
        results = [GenerationResult(req.tokens, req.text if self.tokenizer else None, req.done or "length", stats)
                   for req in requests]
        return results if is_batch(prompt) else results[0]

    def stream(self, prompt, params: GenerationParams | None = None, **overrides) -> Iterator[StreamEvent]:
        """Yield :class:`StreamEvent` as tokens are accepted (same arguments as :meth:`generate`).

        A sequence's last event has its ``finish_reason``; the run's last event carries ``stats``."""
        yield from self._run(prompt, self.resolve(params, **overrides), [], Stats())

    @contextmanager
    def watch_verify(self):
        """Record every verified row of every engine of this decoder while inside: yields a list that
        fills with :class:`graphs.engine.VerifyRecord` (tree, tokens, root position, accepted nodes)."""
        records: list = []
        with self._watch_lock:
            self._watch.append(records)
        try:
            yield records
        finally:
            with self._watch_lock:
                self._watch.remove(records)

    def new_planner(self) -> Planner:
        """The adaptive policy of a new engine, sharing what this decoder's engines measured."""
        return Planner(self.adaptive_config, costs=self.costs, priors=self.priors)  # shared on purpose

    # ------------------------------------------------------------------ generate / stream

    def _run(self, prompt, p: Resolved, requests: list, stats: Stats, stream: bool = True):
        """A private engine over the batch; yields StreamEvents, fills ``requests`` and ``stats``.
        ``stream`` False (generate): a request without stop strings decodes its text once at the end."""
        prompts = [self.encode(x) if isinstance(x, str) else x for x in check_prompt(prompt)]
        if any(not x for x in prompts):
            raise InputError("empty prompt: pass at least one token of text")
        longest = max(len(x) for x in prompts)
        new = p.new_tokens_for(longest)  # HF's max_length counts the batch's longest prompt
        max_len = min(longest + new + 1, self.model.max_positions)
        cfg = batch_config(self.manifest.source, self.model.dtype, len(prompts), longest, max(max_len, 2))
        # (see _spare_kv; with min_rows > 1 a one-token prefill is padded into a call the base runs)
        spare = len(prompts) == 1 and self.model.lends_kv and self.device_model is None
        engine = self.engine(cfg, kv=self._spare_kv() if spare else None, keep_kv=spare, full_stats=True)
        try:
            r = Resolved(**{**p.__dict__, "max_new_tokens": new, "max_length": None})
            reqs = [self.new_request(x, r, engine.max_len, stream=b) for b, x in enumerate(prompts)]
            for req in reqs:
                req.text_per_token = stream or bool(r.stop_strings)
            ids = [engine.add(req) for req in reqs]
            requests += [engine.request(i) for i in ids]
            index = {rid: b for b, rid in enumerate(ids)}
            stats.prompt_tokens = sum(len(x) for x in prompts)
            yield from _steps(engine, requests, stats, index, time.perf_counter())
        finally:  # (a refused prompt too: the cache goes back untouched)
            self._keep_kv(engine)

    def _spare_kv(self):
        """The K/V cache a one-prompt generate/stream call may reuse (None: its engine makes one): the
        last such call's, with its buffers, capacity and bound calls. Only where every call of one
        sequence runs the one-sequence graph, whose attention reads each row's own length (a larger
        capacity left by an earlier request costs memory, not time; its columns are never read)."""
        with self._spare_lock:
            kv, self._kv_spare = self._kv_spare, None
        return kv

    def _keep_kv(self, engine: Engine) -> None:
        """Keep ``engine``'s cache for the next call where :meth:`_spare_kv` may lend it: idle, with its
        bound calls only, all of it at most SPARE_KV_BYTES (one spare: a later call's replaces it)."""
        kv = engine.kv
        if not (engine.keep_kv and kv.n == 0 and kv.temp == 0):
            return
        if kv.allocated_bytes + InPlaceRun.keep_bound_only(kv) <= SPARE_KV_BYTES:
            with self._spare_lock:
                self._kv_spare = kv


def _steps(engine: Engine, requests: list, stats: Stats, index: dict, t0: float):
    """The engine's steps until its requests finish, as StreamEvents (``index``: request id -> the
    prompt's place in the batch); the run's stats, timed from ``t0``, on the last event."""
    while engine.has_pending_requests():
        events = engine.step()
        for e in events:  # a request's own failure (non-finite logits in its row, ...): the call's
            if e.finish_reason == "error":
                raise e.error
        out = [StreamEvent(index=index[e.request_id], token_ids=e.token_ids, text=e.text,
                           finish_reason=e.finish_reason) for e in events]
        if not engine.has_pending_requests():  # the run's stats, once, after its last step
            stats.time_total = time.perf_counter() - t0
            tot = engine.totals
            for name in ("steps", "plain_steps", "accepted", "accepted_counts", "time_prefill", "time_draft",
                         "time_verify", "draft_calls", "draft_tokens", "accepted_drafts", "accepted_per_pos"):
                setattr(stats, name, getattr(tot, name))
            stats.new_tokens = sum(len(q.tokens) for q in requests)
            if out:
                out[-1].stats = stats  # the run's last event carries its final stats
        yield from out


def _no_io_binding(io_binding) -> None:
    """``io_binding`` is gone: K/V stays in host memory on the host executor (graphs.host); a device
    executor will keep it on the device by itself. True asked for what this runtime does not do."""
    if io_binding:
        raise InputError("io_binding was removed: the runtime keeps K/V in host memory (graphs.host."
                         "HostExecutor) and decodes correctly on CUDA too; drop the io_binding argument")
    if io_binding is not None:
        warnings.warn("io_binding is deprecated and ignored; drop the argument", DeprecationWarning, stacklevel=3)


# The K/V memory a decoder keeps between generate/stream calls of one prompt (Decoder._keep_kv): at most
# one request's buffers of this size (larger ones are freed with their call).
SPARE_KV_BYTES = 128 << 20

# A generate/stream batch runs in one private engine. Its rows' K/V and one call's tokens are bounded so
# that a batch of 2000 prompts x 500 tokens queues its prompts instead of asking for 2000 rows at once.
BATCH_KV_BYTES = 4 << 30  # the K/V the batch's rows may hold at once
BATCH_STEP_TOKENS = 8192  # tokens of one call (a prompt longer than this is still one prefill chunk)


def batch_config(source: dict, dtype, n_prompts: int, longest: int, max_len: int) -> EngineConfig:
    """The private engine of a batch: every prompt in one prefill call while that fits the bounds above;
    beyond them, as many rows as the K/V bound holds, the other prompts waiting for a free row."""
    per_row = (2 * source["num_layers"] * source["num_kv_heads"] * source["head_dim"] * np.dtype(dtype).itemsize
               * max_len)
    rows = max(1, min(n_prompts, BATCH_KV_BYTES // max(per_row, 1)))
    longest = max(longest, 1)
    # any tree fits (max_tree); nothing else shares this engine
    return EngineConfig(max_batch=rows, max_len=max_len, prefill_chunk=longest,
                        step_tokens=max(min(longest * rows, BATCH_STEP_TOKENS), longest), max_tree=4096)


def load(out_dir, provider: str = "auto", threads: int | None = None, optimization: str = "all",
         verify: bool = True, io_binding: bool | None = None, device_id: int = 0, session_options=None,
         provider_options: dict | None = None, eagle_draft: str = "auto", adaptive: bool = True,
         device_resident: bool = False) -> Decoder:
    """Build a :class:`Decoder` from an export directory (checks every file's sha256 first).

    ``provider``: "auto" (CUDA EP when onnxruntime-gpu sees a GPU, else CPU EP), "cuda", "cpu".
    ``io_binding``: removed (True is an error, False is ignored with a DeprecationWarning).
    ``device_id``: which GPU (CUDA EP). ``session_options``: an ``onnxruntime.SessionOptions`` used
    as given, or a dict of its attributes / session config entries applied on top of ours.
    ``provider_options``: options of the execution provider (e.g. CUDA's ``gpu_mem_limit``).
    ``eagle_draft``: "auto" (one drafter call per step when the export baked the requested EAGLE
    tree, else step-wise), "one_call" (require a baked tree), "stepwise" (1 + depth calls per step).
    ``adaptive``: shrink the tree or fall back to one-token steps when speculation stops paying
    (graphs.adaptive); greedy output is the same either way and sampling keeps the base distribution.
    The choices follow measured times, so the policy is off for seeded sampling runs (``seed=...``,
    temperature > 0): those stay reproducible.
    ``device_resident``: K/V and logits stay on the session's device (:mod:`graphs.device`; the CPU EP
    runs the same code with OrtValues on the CPU); needs an export optimized by this version.
    """
    return Decoder(out_dir, provider=provider, threads=threads, optimization=optimization, verify=verify,
                   io_binding=io_binding, device_id=device_id, session_options=session_options,
                   provider_options=provider_options, eagle_draft=eagle_draft, adaptive=adaptive,
                   device_resident=device_resident)
