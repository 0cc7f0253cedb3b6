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

The loop itself is :class:`graphs.engine.Engine` (continuous batching, per-request settings);
``generate`` and ``stream`` run a private engine per call, so nothing about a run is kept on the
decoder and several threads may call them at once. What the decoder keeps across runs is what the
machine measured (graph call costs, mean gains per tree and sampling setting), which the adaptive
policy of every engine it makes reads and updates.
"""

from __future__ import annotations

import contextlib
import json
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from graphs import contract as C
from graphs.adaptive import AdaptiveConfig, Costs, Planner, Priors, RowGains, chain_ceiling, tree_ceiling
from graphs.eagle_draft import DRAFT_MODES, baked_trees, choose_graph
from graphs.engine import Engine, EngineConfig, Request
from graphs.errors import ArtifactError, InputError, as_input_error
from graphs.integrity import recheck
from graphs.kv import inplace_mask
from graphs.limits import check_eagle_tree, check_medusa_tree
from graphs.manifest import Manifest
from graphs.params import GenerationParams, Resolved, check_prompt
from graphs.results import GenerationResult, Sampler, Stats, StreamEvent
from graphs.schema import check_session, load_graph
from graphs.sessions import (
    InPlaceRun,
    LazySession,
    make_session,
    resolve_provider,
    warn_if_other_target,
    warn_if_tree_stale,
)
from graphs.slots import attention_mask
from graphs.trees import DEFAULT_EAGLE_TREE, Tree, default_medusa_paths, load_tree_file, medusa_tree


class Decoder:
    """Sessions built once from ``manifest.json``; ``generate``/``stream`` run the decode loop."""

    def __init__(self, out_dir, provider: str = "auto", threads: int | None = None,
                 optimization: str = "all", verify: bool = True, io_binding: bool | None = None,
                 device_id: int = 0, session_options=None, provider_options: dict | None = None,
                 eagle_draft: str = "auto", adaptive: bool = True):
        self.out_dir = Path(out_dir)
        self.manifest = Manifest.read(self.out_dir, verify=verify)
        self.provider = resolve_provider(provider)
        self.device_id = device_id
        m = self.manifest
        warn_if_other_target(m.optimization, self.provider, str(out_dir))
        warn_if_tree_stale(m.tree, m.optimization, m.source.get("dtype", "float32"), str(out_dir))
        dtype = m.graphs["base"].output(C.LOGITS).dtype
        if dtype not in ("float32", "float16"):
            raise InputError(
                f"{out_dir} holds {dtype} graphs, which this runtime cannot feed (numpy and ONNX Runtime's "
                f"Python API have no {dtype} arrays); export with --dtype float16 or float32"
            )
        self.dtype = np.dtype(dtype)
        # The engine keeps K/V in host memory, one row per request (graphs.slots). IO binding (K/V on
        # the device, written in place by the kv_update graph) was built for the old fixed-batch loop's
        # shared write pointer; with per-row lengths it needs a per-row device write (the K/V-in-place
        # work of the speed issue). Until then CUDA runs with host K/V: correct, slower.
        self.io_binding = False
        if io_binding:
            warnings.warn("io_binding: the engine keeps K/V in host memory (device K/V per request row is not "
                          "built yet); decoding is correct, slower on CUDA", stacklevel=3)

        def session(role):
            spec = m.graphs.get(role)
            if spec is None:
                return None
            sess = load_graph(make_session, self.out_dir / spec.file, self.provider, threads, optimization,
                              device_id, session_options, provider_options)
            check_session(spec, sess, role)  # the file's own inputs/outputs are the manifest's
            return sess

        self.base_spec = m.graphs["base"]
        self.draft_spec = m.graphs.get("draft")
        # with a one-sequence graph (below) the base runs only batches of trees: made when one comes
        one_sequence = bool(m.one_sequence_file) and C.kv_in_place(self.base_spec) and self.provider == "cpu"
        def late_session(role):  # opened long after the check: the files must still be what it verified
            spec = m.graphs[role]
            rels = [r for r in m.files if r == spec.file or r.startswith(spec.file + ".")]  # (+ external data)
            recheck(self.out_dir, m.files, m.checked, rels, verify)
            sess = session(role)
            recheck(self.out_dir, m.files, m.checked, rels, verify)  # (and not swapped while it was read)
            return sess

        self.base = LazySession(lambda: late_session("base")) if one_sequence else session("base")
        self.draft = session("draft")
        # one-call EAGLE trees (graphs.eagle_draft): a session per baked (topk, depth, total_tokens)
        if eagle_draft not in DRAFT_MODES:
            raise InputError(f"unknown eagle_draft {eagle_draft!r}; accepted: {', '.join(DRAFT_MODES)}")
        self.eagle_draft = eagle_draft
        self.tree_sessions = {} if eagle_draft == "stepwise" else {r: session(r) for r in baked_trees(m).values()}
        if not isinstance(adaptive, (bool, np.bool_)):
            raise InputError(f"adaptive must be True or False, got {adaptive!r}")
        self.adaptive = bool(adaptive)
        self.adaptive_config: AdaptiveConfig | None = None  # the policy's settings (None: defaults)
        # what this machine measured, shared by every engine of this decoder (graphs.adaptive): call
        # costs and mean gains per setting; races between threads can only lose one average's update
        self.costs = Costs()
        self.priors = Priors()  # bounded: the PRIORS_MAX settings last used
        self._watch: list[list] = []  # watch_verify() record lists
        self._watch_lock = threading.Lock()
        self.drafter = m.drafter
        self.kind = m.drafter["kind"] if m.drafter else None
        self.eos = set(m.generation.get("eos_token_ids") or [])
        self.pad = m.generation.get("pad_token_id") or 0
        # the context limit; a sliding-window model is exact only within its window (graphs attend all)
        limits = [m.source.get("max_position_embeddings"), m.source.get("sliding_window")]
        self.max_positions = int(min([x for x in limits if x] or [1 << 30]))
        self.tokenizer = None
        if m.tokenizer:
            from tokenizers import Tokenizer

            try:
                self.tokenizer = Tokenizer.from_file(str(self.out_dir / m.tokenizer))
            except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
                raise ArtifactError(f"{self.out_dir / m.tokenizer} is not a tokenizer tokenizers can read "
                                    f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__}); "
                                    f"re-export the model") from None
        self.default_tree = m.tree
        # generation_config.json (copied at export): its sampling defaults are this decoder's defaults
        gen_file = self.out_dir / "generation_config.json"
        self.generation_defaults = (GenerationParams.from_generation_config(gen_file) if gen_file.is_file()
                                    else GenerationParams())
        # its eos list is already the manifest's (export reads it there): self.eos is the one default
        self.generation_defaults.eos_token_id = None
        self._base_outputs = [t.name for t in self.base_spec.outputs]
        # K/V written in place by the graph (exporter.optimize on the CPU): the manifest's spec says so
        self._in_place = InPlaceRun(self.base, self.base_spec) if C.kv_in_place(self.base_spec) else None
        self.kv_layout = C.kv_layout(self.base_spec)  # how the base's K/V buffers are laid out
        # the base's one-sequence graph (exporter.optimize, CPU): the same contract and buffers, each
        # layer's attention one GroupQueryAttention, which reads each row's own length; run for the
        # calls its CPU kernel takes (one token per row, or one sequence), the base for batched trees
        self._one_sequence = None
        if one_sequence:
            sess = load_graph(make_session, self.out_dir / m.one_sequence_file, self.provider, threads, optimization,
                              device_id, session_options, provider_options)
            check_session(self.base_spec, sess, "base")
            self._one_sequence = InPlaceRun(sess, self.base_spec)
            # its rotary tables' length: a call reaching past it (a tree at the very end of the
            # context) runs the base
            self._one_sequence_columns = int(m.one_sequence.get("max_columns", 0))
        # optimize's rows check: where a one-row call rounds otherwise than calls of more rows (MLAS's
        # M == 1 int8 kernel), every one-token call runs as two rows, so all calls share kernels
        self.min_rows = int((m.optimization.get("base") or {}).get("min_rows", 1))
        self._n_layers = m.source["num_layers"]
        self._kv_spare = None  # the K/V cache of the last one-prompt generate/stream call (_keep_kv)
        self._spare_lock = threading.Lock()


    # ------------------------------------------------------------------ public API

    def load_sessions(self) -> None:
        """Make every session now: the base's is otherwise made when a batch of trees first comes
        (exports with a one-sequence graph), a pause in the middle of serving and a load error late.
        The server calls it at start when it may batch."""
        if isinstance(self.base, LazySession):
            self.base.get()

    def engine(self, config: EngineConfig | None = None, first_id: int = 0) -> Engine:
        """A serving engine on this decoder's sessions (:mod:`graphs.engine`): requests join and leave
        at every step, each with its own parameters and speculation switch. ``first_id``: its first
        request id (a server's engine rebuilt after a failure continues its predecessor's ids)."""
        return Engine(self, config, first_id=first_id)

    def generate(self, prompt, params: GenerationParams | None = None, **overrides):
        """Decode ``prompt`` (a string, a list of token ids, or a list of either for a batch).

        ``params``: a :class:`graphs.params.GenerationParams`; keyword ``overrides`` (its field names,
        e.g. ``max_new_tokens=64, temperature=0.7, stop="\\n\\n"``) go on top. Unset fields take the
        export's ``generation_config.json`` values, else the defaults (greedy, 64 new tokens).
        Returns a :class:`GenerationResult` (a list of them for a batch); ``stats`` are the batch's.
        ``mode``: "auto" (speculative if the export has a drafter), "speculative",
        "autoregressive". ``speculation``: "on", "off", "adaptive" (default: adaptive unless loaded
        with adaptive=False). ``tree``: Medusa paths (list or JSON file) or EAGLE
        ``{"topk", "depth", "total_tokens"}``; default from the manifest. ``acceptance`` when
        sampling: "lossless" (rejection sampling, keeps the base distribution) or "typical"
        (Medusa's, faster, not lossless).
        """
        batched = _is_batch(prompt)
        run = _Run()
        for _ in self._run(prompt, self.resolve(params, **overrides), run, stream=False):
            pass
        results = [GenerationResult(req.tokens, req.text if self.tokenizer else None, req.done or "length",
                                    run.stats) for req in run.requests]
        return results if batched else results[0]

    def stream(self, prompt, params: GenerationParams | None = None, **overrides) -> Iterator[StreamEvent]:
        """Yield :class:`StreamEvent` as tokens are accepted (same arguments as :meth:`generate`).

        A sequence's last event has its ``finish_reason``; the run's last event carries ``stats``."""
        yield from self._run(prompt, self.resolve(params, **overrides), _Run())

    def resolve(self, params: GenerationParams | None = None, **overrides) -> Resolved:
        """The values a run with these arguments uses: explicit ones, else generation_config.json's,
        else the defaults (``.describe()`` says which came from where)."""
        r = GenerationParams.build(params, **overrides).resolve(self.generation_defaults)
        if r.eos_token_ids is None:  # the manifest's (from generation_config.json or config.json at export)
            r.eos_token_ids, r.sources["eos_token_id"] = sorted(self.eos), "manifest"
        return r

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InputError(f"{self.out_dir} has no tokenizer.json: pass token ids instead of text")
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    # ------------------------------------------------------------------ graph calls (public: tune, tests)

    def base_forward(self, kv, ids: np.ndarray, pos: np.ndarray, tree_mask: np.ndarray, rows: slice | None = None
                     ) -> dict:
        """One base forward over S new positions per row: ids, positions (B, S), tree_mask (B, S, S)
        bool, against the columns ``kv`` holds (a :class:`graphs.slots.SlotCache`, its ``rows``, or a
        :class:`graphs.kv.KVCache`). Returns every output by name (``present.*``: K/V of the S)."""
        if ids.shape[1] < self.min_rows:  # a padding row that sees only itself; its outputs are dropped
            return self._padded_forward(kv, ids, pos, tree_mask, rows)
        return self._forward(kv, ids, pos, tree_mask, rows)

    def plain_step(self, kv, roots) -> dict | None:
        """A plain (autoregressive) step of every occupied row of ``kv`` (a :class:`graphs.slots.SlotCache`):
        ``roots`` (n,) the tokens, each at its row's length; the outputs (n, 1, ...) by name, written
        in place like :meth:`base_forward`'s, valid until the next call (copy what must outlive it).
        None where the graphs take no bound call (K/V not written in place, or one-token calls
        padded to ``min_rows``): use :meth:`base_forward`. It computes what base_forward computes for
        the same call (the same graph, the same inputs), on arrays bound once (graphs.sessions.BoundCall)."""
        call, _ = self.plain_steps(kv, 1)
        return None if call is None else call.step(roots, kv.lens[: kv.n])

    def plain_steps(self, kv, most: int) -> tuple:
        """The bound call of up to ``most`` plain steps in a row of every occupied row of ``kv``, and
        how many it may run: ``(call, k)``, each ``call.step(roots, kv.lens[:kv.n])`` the call
        :meth:`plain_step` makes (K/V room reserved for the k; k stops where the one-sequence
        graph's positions end, so that each step runs on the graph a step alone would take).
        ``(None, 0)`` where :meth:`plain_step` returns None."""
        if self.min_rows != 1:
            return None, 0
        top = kv.top()
        k = max(1, min(int(most), kv.limit - top))
        if self._one_sequence is not None and top + 1 <= self._one_sequence_columns:
            k = min(k, self._one_sequence_columns - top)
        call = self.bound_call(kv, 1, columns=top + k)
        return (None, 0) if call is None else (call, k)

    def verify_trees(self, kv, trees: list, tokens: list) -> dict | None:
        """One verify of every occupied row of ``kv``: row b's tree ``trees[b]`` with its tokens
        ``tokens[b]`` after the row's length, padded to the widest; the outputs (n, S, ...) as
        :meth:`plain_step`'s. None where the graphs take no bound call: use :meth:`base_forward`."""
        width = max(len(t) for t in tokens)
        bound = self.bound_call(kv, width) if width >= self.min_rows else None
        return None if bound is None else bound.trees(trees, tokens, kv.lens[: kv.n], self.pad)

    def verify(self, kv, trees: list, tokens: list) -> dict:
        """:meth:`verify_trees`, or where the graphs take no bound call the same inputs made for this
        call and run through :meth:`base_forward`: every decode step's verify (the engine's, and the
        tuner's timing of one)."""
        out = self.verify_trees(kv, trees, tokens)
        if out is not None:
            return out
        n, width = len(tokens), max(len(t) for t in tokens)
        ids = np.full((n, width), self.pad, dtype=np.int64)
        depth = np.zeros((n, width), dtype=np.int64)
        tmask = np.broadcast_to(np.eye(width, dtype=bool), (n, width, width)).copy()
        for b, (tree, cand) in enumerate(zip(trees, tokens)):
            k = len(cand)
            ids[b, :k], depth[b, :k], tmask[b, :k, :k] = cand, tree.depth, tree.mask
        return self.base_forward(kv, ids, kv.lens[:n, None] + depth, tmask)

    def bound_call(self, kv, s: int, columns: int | None = None):
        """The :class:`graphs.sessions.BoundCall` of ``s`` new tokens per occupied row of ``kv`` on the
        graph :meth:`_graph_for` picks for such calls (their tree masks put every node after its
        ancestors), growing ``kv`` first to hold them (``columns``: to hold that many, for calls to
        come); None without in-place K/V."""
        if self._in_place is None:
            return None
        columns = kv.top() + s if columns is None else columns
        kv.reserve_columns(columns)
        return self._graph(columns, s, kv.n == 1 and kv.lens[0] > 0).bound_on(kv, s)

    def _forward(self, kv, ids, pos, tree_mask, rows) -> dict:
        if self._in_place is not None:
            return self._forward_in_place(kv, ids, pos, tree_mask, rows)
        past = kv.past_mask() if rows is None else kv.past_mask(rows)
        feed = {C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: attention_mask(past, tree_mask)}
        kv_feed = kv.feed() if rows is None else kv.feed(rows)
        return dict(zip(self._base_outputs, self.base.run(self._base_outputs, feed | kv_feed)))

    def _padded_forward(self, kv, ids, pos, tree_mask, rows) -> dict:
        bsz, s = ids.shape
        n = self.min_rows
        ids2 = np.concatenate([ids, np.full((bsz, n - s), self.pad, dtype=ids.dtype)], axis=1)
        pos2 = np.concatenate([pos, np.repeat(pos[:, -1:], n - s, axis=1)], axis=1)
        mask2 = np.broadcast_to(np.eye(n, dtype=bool), (bsz, n, n)).copy()
        mask2[:, :s, :s] = tree_mask
        out = self._forward(kv, ids2, pos2, mask2, rows)
        # the S real rows (a K/V buffer written in place keeps the padding row past them: never attended)
        return {k: (v[:, :, :s] if k.startswith("present.") else v[:, :s]) for k, v in out.items()}

    def _forward_in_place(self, kv, ids, pos, tree_mask, rows) -> dict:
        """The base graph writes the S new rows of row b into ``kv``'s buffers at the column of b's
        next write (``kv.write_columns``); the returned outputs hold no ``present.*`` and ``kv.commit``
        / ``kv.append`` then take ``None`` for them (the rows are already in place)."""
        s = ids.shape[1]
        starts = kv.write_columns(rows)
        kv.reserve_columns(int(starts.max(initial=0)) + s)
        past = kv.past_mask() if rows is None else kv.past_mask(rows)  # (B, capacity), after the growth
        feed = {C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: inplace_mask(past, starts, tree_mask),
                C.KV_WRITE: starts}
        return self._graph_for(ids, pos, tree_mask, starts).run_on(kv, feed, rows)

    def _graph_for(self, ids, pos, tree_mask, starts) -> InPlaceRun:
        """The one-sequence graph for the calls its GroupQueryAttention computes as asked: one token
        per row; one sequence after a past (its tree nodes come after their ancestors, as every tree
        here); one sequence's causal prefill (without a past the kernel takes positions 0..S-1).
        The base graph for the rest (a batch of trees), which the kernel refuses."""
        if self._one_sequence is None:
            return self._in_place
        bsz, s = ids.shape
        one_sequence = bsz == 1 and (starts[0] > 0 or (np.array_equal(pos[0], np.arange(s))
                                                      and np.array_equal(tree_mask[0], np.tri(s, dtype=bool))))
        return self._graph(int(starts.max(initial=0)) + s, s, one_sequence)

    def _graph(self, columns: int, s: int, one_sequence: bool) -> InPlaceRun:
        """The one-sequence graph for a call of ``s`` new tokens per row reaching ``columns`` columns where
        its kernel computes it as asked (one token per row, or ``one_sequence``: one sequence after a
        past, or its causal prefill) within its rotary tables; the base otherwise."""
        one = self._one_sequence
        if one is not None and columns <= self._one_sequence_columns and (s == 1 or one_sequence):
            return one
        return self._in_place

    def presents(self, out: dict) -> list | None:
        """The base's ``present.*`` outputs of ``out`` in layer order (K0, V0, K1, V1, ...); None when
        the graph wrote them in place (the caches' ``commit`` / ``append`` take None then)."""
        if self._in_place is not None:
            return None
        return [out[n] for i in range(self._n_layers) for n in (C.present_key(i), C.present_value(i))]

    @contextlib.contextmanager
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

    def watchers(self) -> list[list]:
        return self._watch

    def new_planner(self) -> Planner:
        """The adaptive policy of a new engine, sharing what this decoder's engines measured."""
        return Planner(self.adaptive_config, costs=self.costs, priors=self.priors)  # shared on purpose (__init__)

    # ------------------------------------------------------------------ requests

    def new_request(self, prompt, p: Resolved, max_len: int, stream: int = 0) -> Request:
        """A checked :class:`graphs.engine.Request` for one prompt (a string or token ids).

        ``stream``: which random stream of ``p.seed`` its sampler draws from (the b-th prompt of a
        seeded batch draws from its own; stream 0 is ``default_rng(seed)`` itself)."""
        (toks,) = check_prompt(prompt) if not _is_batch(prompt) else (None,)
        if toks is None:
            raise InputError("a request takes one prompt (a string or a list of token ids), not a batch")
        if isinstance(toks, str):
            toks = self.encode(toks)
        if not toks:
            raise InputError("empty prompt: pass at least one token of text")
        if len(toks) >= self.max_positions:
            raise InputError(f"prompt of {len(toks)} tokens exceeds the model's context limit of "
                             f"{self.max_positions}; shorten the prompt")
        if len(toks) >= max_len:
            raise InputError(f"prompt of {len(toks)} tokens does not fit the engine's max_len of {max_len} "
                             f"positions (prompt + new tokens); shorten the prompt or raise EngineConfig.max_len")
        vocab = self.manifest.source["vocab_size"]
        bad = [t for t in toks if not 0 <= t < vocab]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        mode = p.mode
        if mode == "auto":
            mode = "speculative" if self.kind else "autoregressive"
        if mode == "speculative" and not self.kind:
            raise InputError(f"{self.out_dir} has no draft graph: use mode='autoregressive' or export a drafter")
        if p.acceptance == "typical" and self.kind != "medusa":
            raise InputError("typical acceptance is Medusa's; EAGLE drafts use lossless acceptance" if self.kind else
                             f"typical acceptance needs a Medusa drafter; {self.out_dir} has none (base only, "
                             f"autoregressive): drop acceptance='typical'")
        if p.stop_strings and self.tokenizer is None:
            raise InputError(f"{self.out_dir} has no tokenizer.json, so stop strings cannot be matched; "
                             f"drop stop_strings or use eos_token_id")
        spec = p.speculation
        if spec in ("on", "adaptive") and not self.kind:
            raise InputError(f"speculation={spec!r} needs a drafter; {self.out_dir} has none: use speculation='off'")
        if mode == "autoregressive" or spec == "off":
            spec = "off"
        elif spec is None:
            spec = "adaptive" if self.adaptive else "on"
        # a seeded sampling request stays reproducible: its trees must not follow measured times
        if spec == "adaptive" and p.seed is not None and p.temperature > 0:
            spec = "on"
        seed = p.seed if stream == 0 or p.seed is None else [p.seed, stream]
        sampler = Sampler(p.temperature, p.top_p, p.top_k, np.random.default_rng(seed), p.acceptance)
        req = Request(id=-1, prompt=list(toks), params=p, max_new=p.new_tokens_for(len(toks)),
                      eos=set(self.eos if p.eos_token_ids is None else p.eos_token_ids), speculation=spec,
                      sampler=sampler)
        if spec != "off":
            if self.kind == "medusa":
                req.tree = self.medusa_tree(p.tree)
                req.tree_size = req.tree.size
                key = ("medusa", req.tree.parents.tobytes(), req.tree.rank.tobytes())
            else:
                req.tree = self.eagle_tree(p.tree)
                req.tree_role = choose_graph(self.manifest, req.tree, self.eagle_draft)
                req.tree_size = (self.manifest.graphs[req.tree_role].output(C.TREE_TOKENS).dims[1]
                                 if req.tree_role else req.tree["total_tokens"])
                key = ("eagle", req.tree_role, req.tree["topk"], req.tree["depth"], req.tree["total_tokens"])
            # sampling settings rounded: 0.7 and 0.7000001 accept the same drafts
            req.prior_key = (*key, round(p.temperature, 2), round(p.top_p, 2), p.top_k, p.acceptance)
            # on rows too: their expected tokens weigh in the batch's choice of width
            prior = self.priors.get(req.prior_key)
            ceiling = (tree_ceiling(req.tree) if self.kind == "medusa"
                       else chain_ceiling(req.tree_size, req.tree["depth"]))
            req.gains = RowGains(req.tree_size, None if prior is None else prior[0].copy(),
                                 (self.adaptive_config or AdaptiveConfig()).ema, ceiling)
        if self.tokenizer is not None:
            from tokenizers.decoders import DecodeStream

            req.detok = DecodeStream(skip_special_tokens=True)
        return req

    def medusa_tree(self, tree) -> Tree:
        """The Medusa tree a request asks for (paths, a JSON file, or None: the manifest's), checked."""
        if tree is None:
            paths = self.default_tree.get("medusa_paths") or default_medusa_paths(self.drafter["num_heads"])
        elif isinstance(tree, (str, Path)):
            with as_input_error():
                paths = load_tree_file(tree)
        else:
            paths = tree
        with as_input_error():
            t = medusa_tree(paths)
        if t.max_depth > self.drafter["num_heads"]:
            raise InputError(
                f"tree is {t.max_depth} deep but the drafter has {self.drafter['num_heads']} Medusa heads"
            )
        check_medusa_tree(t, self.manifest.source["vocab_size"], self.max_positions)
        return t

    def eagle_tree(self, tree) -> dict:
        """The EAGLE tree a request asks for ({"topk", "depth", "total_tokens"}, a JSON file, or None:
        the manifest's), checked."""
        cfg = dict(self.default_tree.get("eagle") or DEFAULT_EAGLE_TREE)
        if isinstance(tree, (str, Path)):
            try:
                tree = json.loads(Path(tree).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise InputError(f"cannot read EAGLE tree file {tree}: {e}") from None
        if tree is not None:
            if not isinstance(tree, dict) or set(tree) - {"topk", "depth", "total_tokens"}:
                raise InputError('an EAGLE tree is {"topk": k, "depth": d, "total_tokens": n}')
            cfg.update(tree)
        for k in ("topk", "depth", "total_tokens"):
            if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < 1:
                raise InputError(f"EAGLE tree {k} must be an int >= 1, got {cfg[k]!r}")
        vocab = self.drafter.get("draft_vocab_size") or self.manifest.source["vocab_size"]
        check_eagle_tree(cfg, vocab, self.max_positions)
        return cfg

    # ------------------------------------------------------------------ generate / stream

    def _run(self, prompt, p: Resolved, run: _Run, stream: bool = True):
        """A private engine over the batch; yields StreamEvents, fills ``run`` (requests, stats).
        ``stream`` False (generate): the events' text is not read, so a request without stop strings
        decodes its text once at the end instead of token by token."""
        prompts = [self.encode(x) if isinstance(x, str) else x for x in check_prompt(prompt)]
        if any(not x for x in prompts):
            raise InputError("empty prompt: pass at least one token of text")
        longest = max(len(x) for x in prompts)
        new = p.new_tokens_for(longest)  # HF's max_length counts the batch's longest prompt
        max_len = min(longest + new + 1, self.max_positions)
        cfg = batch_config(self.manifest.source, self.dtype, len(prompts), longest, max(max_len, 2))
        # (see _spare_kv; with min_rows > 1 a one-token prefill is padded into a call the base runs)
        spare = len(prompts) == 1 and self._one_sequence is not None and self.min_rows == 1
        engine = Engine(self, cfg, kv=self._spare_kv() if spare else None, keep_kv=spare, full_stats=True)
        try:
            r = Resolved(**{**p.__dict__, "max_new_tokens": new, "max_length": None})
            reqs = [self.new_request(x, r, engine.max_len, stream=b) for b, x in enumerate(prompts)]
            for req in reqs:
                req.text_per_token = stream or bool(r.stop_strings)
            ids = [engine.add(req) for req in reqs]
            run.requests = [engine.request(i) for i in ids]
            index = {rid: b for b, rid in enumerate(ids)}
            run.stats.prompt_tokens = sum(len(x) for x in prompts)
            yield from self._steps(engine, run, index, _now())
        finally:  # (a refused prompt too: the cache goes back untouched)
            self._keep_kv(engine)

    def _steps(self, engine: Engine, run: _Run, index: dict, t0: float):
        """The engine's steps until its requests finish, as StreamEvents (``index``: request id -> the
        prompt's place in the batch); the run's stats, timed from ``t0``, on the last event."""
        stats = run.stats
        while engine.has_pending_requests():
            events = engine.step()
            for e in events:  # a request's own failure (non-finite logits in its row, ...): the call's
                if e.finish_reason == "error":
                    raise e.error
            out = [StreamEvent(index=index[e.request_id], token_ids=e.token_ids, text=e.text,
                               finish_reason=e.finish_reason) for e in events]
            if not engine.has_pending_requests():  # the run's stats, once, after its last step
                stats.time_total = _now() - t0
                tot = engine.totals
                for name in ("steps", "plain_steps", "accepted", "accepted_counts", "time_prefill", "time_draft",
                             "time_verify", "draft_calls", "draft_tokens", "accepted_drafts", "accepted_per_pos"):
                    setattr(stats, name, getattr(tot, name))
                stats.new_tokens = sum(len(q.tokens) for q in run.requests)
                if out:
                    out[-1].stats = stats  # the run's last event carries its final stats
            yield from out

    def _spare_kv(self):
        """The K/V cache a one-prompt generate/stream call may reuse (None: its engine makes one): the
        last such call's, kept with its buffers, capacity and bound calls, which a new cache makes
        again (~1 ms a request on the 19M model: two bound calls, a growth of the buffers). Only where
        every call of one sequence runs the one-sequence graph, whose attention reads each row's own
        length: a capacity left above the length by a longer earlier request costs memory, not time,
        and the earlier request's columns are never read (the base's attention reads every column of
        the capacity, masked; a one-token prefill padded to ``min_rows`` runs it)."""
        with self._spare_lock:
            kv, self._kv_spare = self._kv_spare, None
        return kv

    def _keep_kv(self, engine: Engine) -> None:
        """Keep ``engine``'s cache for the next call where :meth:`_spare_kv` may lend it: idle, with its
        bound calls only (not the prefill's binding and its outputs), all of it at most SPARE_KV_BYTES
        (one spare: a later call's replaces it; concurrent calls make their own)."""
        kv = engine.kv
        if not (engine.keep_kv and kv.n == 0 and kv.temp == 0):
            return
        if kv.allocated_bytes + InPlaceRun.keep_bound_only(kv) <= SPARE_KV_BYTES:
            with self._spare_lock:
                self._kv_spare = kv


# The K/V memory a decoder keeps between generate/stream calls of one prompt (Decoder._keep_kv): at most
# one request's buffers of this size (the 19M model: 1.5 MB at 128 positions; TinyLlama-1.1B: ~90 MB
# at 2048, kept; a larger one is freed with its call).
SPARE_KV_BYTES = 128 << 20

# A generate/stream batch runs in one private engine. Its rows' K/V and one call's tokens are bounded so
# that a batch of 2000 prompts x 500 tokens queues its prompts instead of asking for 2000 rows at once
# (on TinyLlama's shape: ~100 GB of K/V, and one prefill call over 10**6 tokens).
BATCH_KV_BYTES = 4 << 30  # the K/V the batch's rows may hold at once
BATCH_STEP_TOKENS = 8192  # tokens of one call (a prompt longer than this is still one prefill chunk)


def batch_config(source: dict, dtype, n_prompts: int, longest: int, max_len: int) -> EngineConfig:
    """The private engine of a batch: every prompt in one prefill call while that fits the bounds above
    (the batch then runs as it always did); beyond them, as many rows as the K/V bound holds, the
    other prompts waiting for a free row (the engine's queue: the same tokens, greedy or seeded)."""
    per_row = (2 * source["num_layers"] * source["num_kv_heads"] * source["head_dim"] * np.dtype(dtype).itemsize
               * max_len)
    rows = max(1, min(n_prompts, BATCH_KV_BYTES // max(per_row, 1)))
    longest = max(longest, 1)
    # any tree fits (max_tree); nothing else shares this engine
    return EngineConfig(max_batch=rows, max_len=max_len, prefill_chunk=longest,
                        step_tokens=max(min(longest * rows, BATCH_STEP_TOKENS), longest), max_tree=4096)


class _Run:
    """What one generate/stream call produced (its own, not the decoder's)."""

    def __init__(self):
        self.requests: list[Request] = []
        self.stats = Stats()


def _now() -> float:
    import time

    return time.perf_counter()


def _is_batch(prompt) -> bool:
    return (isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) > 0
            and not isinstance(prompt[0], (int, float, np.integer, np.floating)))


def load(out_dir, provider: str = "auto", threads: int | None = None, optimization: str = "all",
         verify: bool = True, io_binding: bool | None = None, device_id: int = 0, session_options=None,
         provider_options: dict | None = None, eagle_draft: str = "auto", adaptive: bool = True) -> Decoder:
    """Build a :class:`Decoder` from an export directory (checks every file's sha256 first).

    ``provider``: "auto" (CUDA EP when onnxruntime-gpu sees a GPU, else CPU EP), "cuda", "cpu".
    ``io_binding``: not built for the engine yet (K/V stays in host memory; True warns).
    ``device_id``: which GPU (CUDA EP). ``session_options``: an ``onnxruntime.SessionOptions`` used
    as given, or a dict of its attributes / session config entries applied on top of ours.
    ``provider_options``: options of the execution provider (e.g. CUDA's ``gpu_mem_limit``).
    ``eagle_draft``: "auto" (one drafter call per step when the export baked the requested EAGLE
    tree, else step-wise), "one_call" (require a baked tree), "stepwise" (1 + depth calls per step).
    ``adaptive``: shrink the tree or fall back to one-token steps when speculation stops paying
    (graphs.adaptive; Medusa, step-wise and one-call EAGLE); greedy output is the same either way and sampling keeps the
    base distribution. The choices follow measured times, so the policy is off for seeded
    sampling runs (``seed=...``, temperature > 0): those stay reproducible.
    """
    return Decoder(out_dir, provider=provider, threads=threads, optimization=optimization, verify=verify,
                   io_binding=io_binding, device_id=device_id, session_options=session_options,
                   provider_options=provider_options, eagle_draft=eagle_draft, adaptive=adaptive)
