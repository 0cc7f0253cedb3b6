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
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from graphs import contract as C
from graphs.adaptive import AdaptivePolicy, plain_inputs, static_scores
from graphs.device import DeviceKVCache, run_bound
from graphs.eagle_draft import DRAFT_MODES, PendingRows, baked_trees, choose_graph, one_call_steps
from graphs.errors import InputError, as_input_error
from graphs.kv import KVCache
from graphs.limits import check_eagle_tree, check_medusa_tree
from graphs.manifest import Manifest
from graphs.params import GenerationParams, Resolved, check_prompt
from graphs.results import GenerationResult, Sampler, Stats, StreamEvent
from graphs.schema import check_session, load_graph
from graphs.sessions import make_session, resolve_provider, warn_if_other_target, warn_if_tree_stale
from graphs.trees import (
    DEFAULT_EAGLE_TREE,
    DynamicTreeBuilder,
    Tree,
    default_medusa_paths,
    load_tree_file,
    medusa_candidates_batch,
    medusa_tree,
)


@dataclass
class _Seq:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # emitted
    done: str | None = None
    text: str = ""
    streamed: str = ""  # the part of ``text`` already yielded by stream()
    detok: object = None  # tokenizers.decoders.DecodeStream: text in O(new tokens) per step


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
        # IO binding keeps K/V on the device (graphs.device); the default on CUDA. On the CPU EP the
        # plain numpy path is as fast (inputs are passed without copies) and simpler.
        self.io_binding = self.provider == "cuda" if io_binding is None else bool(io_binding)
        if self.io_binding and "kv_update" not in m.graphs:
            raise InputError(f"{out_dir} has no kv_update graph (exported by an older version): re-export it "
                             f"or pass io_binding=False")

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
        self.base = session("base")
        self.draft = session("draft")
        self.kv_update = session("kv_update") if self.io_binding else None
        self.draft_kv_update = session("draft_kv_update") if self.io_binding else None
        # one-call EAGLE trees (graphs.eagle_draft): a session per baked (topk, depth, total_tokens)
        if eagle_draft not in DRAFT_MODES:
            raise InputError(f"unknown eagle_draft {eagle_draft!r}; accepted: {', '.join(DRAFT_MODES)}")
        self.eagle_draft = eagle_draft
        self.tree_sessions = {} if eagle_draft == "stepwise" else {r: session(r) for r in baked_trees(m).values()}
        self.adaptive = bool(adaptive)
        self._adaptive_now = self.adaptive  # for the current run (off for seeded sampling)
        self.last_policy = None  # graphs.adaptive.AdaptivePolicy of the last speculative run
        self.adaptive_config = None  # a graphs.adaptive.AdaptiveConfig, None: its defaults
        self._policies: dict[tuple, AdaptivePolicy] = {}  # last policy per (loop, tree, batch, sampling)
        self._capacity = 256  # K/V columns to preallocate on the device, set per run
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

            self.tokenizer = Tokenizer.from_file(str(self.out_dir / m.tokenizer))
        self.default_tree = m.tree
        # generation_config.json (copied at export): its sampling defaults are this decoder's defaults
        gen_file = self.out_dir / "generation_config.json"
        self.generation_defaults = (GenerationParams.from_generation_config(gen_file) if gen_file.is_file()
                                    else GenerationParams())
        # its eos list is already the manifest's (export reads it there): self.eos is the one default
        self.generation_defaults.eos_token_id = None
        self._base_host = [t.name for t in self.base_spec.outputs if not t.name.startswith("present.")]
        self._n_layers = m.source["num_layers"]
        self.last_stats: Stats | None = None  # of the last generate/stream run

    # ------------------------------------------------------------------ public API

    def generate(self, prompt, params: GenerationParams | None = None, **overrides):
        """Decode ``prompt`` (a string, a list of token ids, or a list of either for a batch).

        ``params``: a :class:`graphs.params.GenerationParams`; keyword ``overrides`` (its field names,
        e.g. ``max_new_tokens=64, temperature=0.7, stop="\n\n"``) go on top. Unset fields take the
        export's ``generation_config.json`` values, else the defaults (greedy, 64 new tokens).
        Returns a :class:`GenerationResult` (a list of them for a batch); ``stats`` are shared by
        the batch. ``mode``: "auto" (speculative if the export has a drafter), "speculative",
        "autoregressive". ``tree``: Medusa paths (list or JSON file) or EAGLE
        ``{"topk", "depth", "total_tokens"}``; default from the manifest. ``acceptance`` when
        sampling: "lossless" (rejection sampling, keeps the base distribution) or "typical"
        (Medusa's, faster, not lossless).
        """
        batched = _is_batch(prompt)
        seqs, stats = None, None
        for event in self._run(prompt, self.resolve(params, **overrides)):
            if isinstance(event, tuple):
                seqs, stats = event
        results = [GenerationResult(s.tokens, s.text if self.tokenizer else None, s.done or "length", stats)
                   for s in seqs]
        return results if batched else results[0]

    def stream(self, prompt, params: GenerationParams | None = None, **overrides) -> Iterator[StreamEvent]:
        """Yield :class:`StreamEvent` as tokens are accepted (same arguments as :meth:`generate`).

        A sequence's last event has its ``finish_reason``; the run's last event carries ``stats``."""
        for event in self._run(prompt, self.resolve(params, **overrides)):
            if isinstance(event, StreamEvent):
                yield event

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

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    # ------------------------------------------------------------------ the loop

    def _prepare(self, prompt, mode):
        ids = []
        for p in check_prompt(prompt):
            toks = self.encode(p) if isinstance(p, str) else p
            if not toks:
                raise InputError("empty prompt: pass at least one token of text")
            if len(toks) >= self.max_positions:
                raise InputError(
                    f"prompt of {len(toks)} tokens exceeds the model's context limit of "
                    f"{self.max_positions}; shorten the prompt"
                )
            vocab = self.manifest.source["vocab_size"]
            bad = [t for t in toks if not 0 <= t < vocab]
            if bad:
                raise InputError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
            ids.append(toks)
        if mode == "auto":
            mode = "speculative" if self.kind else "autoregressive"
        if mode not in ("speculative", "autoregressive"):
            raise InputError(f"unknown mode {mode!r}; accepted: auto, speculative, autoregressive")
        if mode == "speculative" and not self.kind:
            raise InputError(f"{self.out_dir} has no draft graph: use mode='autoregressive' or export a drafter")
        return [_Seq(prompt=t) for t in ids], mode

    def _run(self, prompt, p: Resolved):
        seqs, mode = self._prepare(prompt, p.mode)
        if p.acceptance == "typical" and self.kind != "medusa":
            raise InputError("typical acceptance is Medusa's; EAGLE drafts use lossless acceptance" if self.kind else
                             f"typical acceptance needs a Medusa drafter; {self.out_dir} has none (base only, "
                             f"autoregressive): drop acceptance='typical'")
        if p.stop_strings and self.tokenizer is None:
            raise InputError(f"{self.out_dir} has no tokenizer.json, so stop strings cannot be matched; "
                             f"drop stop_strings or use eos_token_id")
        max_new_tokens = p.new_tokens_for(max(len(s.prompt) for s in seqs))
        eos = set(self.eos if p.eos_token_ids is None else p.eos_token_ids)
        if self.tokenizer is not None:
            from tokenizers.decoders import DecodeStream

            for s in seqs:
                s.detok = DecodeStream(skip_special_tokens=True)
        self._capacity = self._device_capacity(seqs, max_new_tokens)
        rng = np.random.default_rng(p.seed)
        sampler = Sampler(p.temperature, p.top_p, p.top_k, rng, p.acceptance)
        stats = Stats(prompt_tokens=sum(len(s.prompt) for s in seqs))
        self.last_stats = stats  # filled in as the run goes (also when a stream is left early)
        t_start = time.perf_counter()
        # a seeded sampling run stays reproducible: the adaptive policy (which follows measured times)
        # is off for it
        self._adaptive_now = self.adaptive and (p.seed is None or sampler.temperature == 0)
        steps = {"autoregressive": self._autoregressive, "speculative": self._speculative}[mode]
        for emitted in steps(seqs, sampler, stats, p.tree, max_new_tokens):
            events = [self._emit(seqs[b], b, toks, max_new_tokens, p.stop_strings, eos) for b, toks in emitted]
            events = [e for e in events if e is not None]
            stats.time_total = time.perf_counter() - t_start
            finished = all(s.done for s in seqs)
            if finished:  # the run's last event carries its final stats
                stats.new_tokens = sum(len(s.tokens) for s in seqs)
                if events:
                    events[-1].stats = stats
            yield from events
            if finished:
                break
        stats.time_total = time.perf_counter() - t_start
        stats.new_tokens = sum(len(s.tokens) for s in seqs)
        self.last_stats = stats
        yield seqs, stats

    def _emit(self, seq: _Seq, b: int, toks: list[int], max_new: int, stops: list[str], eos: set):
        if seq.done:
            return None
        # a sequence may fill the context: its last token sits at position max_positions - 1 and is
        # never fed back, so prompt + new tokens <= max_positions
        room = min(max_new, self.max_positions - len(seq.prompt)) - len(seq.tokens)
        toks = toks[: max(room, 0)]
        for i, t in enumerate(toks):
            if t in eos:
                toks, seq.done = toks[: i + 1], "eos"
                break
        if seq.detok is not None:
            # text grows token by token (tokenizers' DecodeStream: O(new tokens), never the whole
            # sequence again); a stop string keeps the tokens up to the one that completes it
            longest = max(map(len, stops), default=0)
            for k, t in enumerate(toks):
                start = max(0, len(seq.text) - longest)
                seq.text += seq.detok.step(self.tokenizer, t) or ""  # None: a character still incomplete
                cut = _find_stop(seq.text, stops, start) if stops else None
                if cut is not None:
                    toks, seq.done, seq.text = toks[: k + 1], "stop", seq.text[:cut]
                    break
        seq.tokens.extend(toks)
        if not seq.done and len(seq.tokens) >= max_new:
            seq.done = "length"
        if not seq.done and len(seq.prompt) + len(seq.tokens) >= self.max_positions:
            seq.done = "length"
        if seq.done and seq.done != "stop" and seq.detok is not None:
            seq.text = self._decode(seq.tokens)  # once at the end: a trailing partial character shows as U+FFFD
        # stream text that can no longer change: hold back the last characters that may begin a stop
        # string, until the sequence is done (DecodeStream already holds back partial characters)
        visible = seq.text
        if not seq.done and stops:
            visible = visible[: max(0, len(visible) - max(map(len, stops)) + 1)]
        new_text = ""
        if visible.startswith(seq.streamed):  # (else decoding changed streamed text: nothing to add)
            new_text, seq.streamed = visible[len(seq.streamed):], visible
        if toks or new_text or seq.done:
            return StreamEvent(index=b, token_ids=toks, text=new_text, finish_reason=seq.done)
        return None

    # ------------------------------------------------------------------ graph calls

    def _device_capacity(self, seqs, max_new_tokens: int) -> int:
        """K/V columns to preallocate on the device: the whole generation plus one tree (grows if
        sequences of a batch leave many holes)."""
        longest = max(len(s.prompt) for s in seqs) + max_new_tokens
        return min(longest, self.max_positions) + 64

    def _execute(self, session, spec, feed: dict, kv, host: list[str]) -> dict:
        """Run a graph that reads ``kv``: host inputs in; host outputs and ``present.*`` out.

        With IO binding the past is bound from device buffers and ``present.*`` stay on the device
        (OrtValues); otherwise everything is numpy and the past buffers are fed without a copy.
        """
        if self.io_binding:
            return run_bound(session, spec, feed, kv, host, self.provider, self.device_id)
        names = host + [t.name for t in spec.outputs if t.name.startswith("present.")]
        return dict(zip(names, session.run(names, feed | kv.feed())))

    def _run_base(self, kv, ids, pos, tree_mask) -> dict:
        """One base forward over S new positions per sequence; tree_mask (B, S, S) bool."""
        mask = _full_mask(kv.past_mask(), tree_mask)
        feed = {C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: mask}
        return self._execute(self.base, self.base_spec, feed, kv, self._base_host)

    def _presents(self, out: dict, n_layers: int) -> list:
        return [out[n] for i in range(n_layers) for n in (C.present_key(i), C.present_value(i))]

    def _new_cache(self, batch: int, layers: int, kv_heads: int, head_dim: int, draft: bool = False):
        if self.io_binding:
            update = self.draft_kv_update if draft else self.kv_update
            return DeviceKVCache(update, layers, batch, kv_heads, head_dim, self.dtype, device=self.provider,
                                 device_id=self.device_id, capacity=self._capacity)
        return KVCache(layers, batch, kv_heads, head_dim, self.dtype)

    def _prefill(self, seqs, stats):
        """Prompts right-padded into one forward; returns (kv, out, last row per sequence)."""
        src = self.manifest.source
        bsz = len(seqs)
        lens = np.array([len(s.prompt) for s in seqs])
        s_max = int(lens.max())
        ids = np.full((bsz, s_max), self.pad, dtype=np.int64)
        for b, s in enumerate(seqs):
            ids[b, : lens[b]] = s.prompt
        pos = np.broadcast_to(np.arange(s_max), (bsz, s_max)).astype(np.int64)
        causal = np.tril(np.ones((s_max, s_max), dtype=bool))
        tree = causal[None] & (np.arange(s_max)[None, None, :] < lens[:, None, None])
        tree |= np.eye(s_max, dtype=bool)[None]  # pad rows see themselves: no empty softmax
        kv = self._new_cache(bsz, self._n_layers, src["num_kv_heads"], src["head_dim"])
        t0 = time.perf_counter()
        out = self._run_base(kv, ids, pos, tree)
        stats.time_prefill += time.perf_counter() - t0
        kv.append(self._presents(out, self._n_layers), np.broadcast_to(np.arange(s_max), (bsz, s_max)), lens)
        return kv, out, lens - 1

    def _autoregressive(self, seqs, sampler, stats, tree, max_new):
        kv, out, last = self._prefill(seqs, stats)
        bsz = len(seqs)
        rows = np.arange(bsz)
        nxt = np.array([sampler.token(out[C.LOGITS][b, last[b]]) for b in rows])
        pos = last + 1
        yield [(b, [int(nxt[b])]) for b in rows]
        ones = np.ones((bsz, 1, 1), dtype=bool)
        while True:
            t0 = time.perf_counter()
            out = self._run_base(kv, nxt[:, None], pos[:, None], ones)
            stats.time_verify += time.perf_counter() - t0
            kv.append(self._presents(out, self._n_layers), np.zeros((bsz, 1), dtype=np.int64),
                      np.ones(bsz, dtype=np.int64))
            nxt = np.array([sampler.token(out[C.LOGITS][b, 0]) for b in rows])
            pos = pos + 1
            stats.steps += 1
            stats.plain_steps += 1
            live = [b for b in rows if not seqs[b].done]
            stats.accepted += [1] * len(live)
            yield [(b, [int(nxt[b])]) for b in live]

    def _speculative(self, seqs, sampler, stats, tree, max_new):
        if self.kind == "medusa":
            yield from self._medusa(seqs, sampler, stats, self._medusa_tree(tree))
        else:
            cfg = self._eagle_tree(tree)
            role = choose_graph(self.manifest, cfg, self.eagle_draft)
            if role is not None:
                yield from one_call_steps(self, seqs, sampler, stats, role)
            else:
                yield from self._eagle(seqs, sampler, stats, cfg)

    def _verify_and_accept(self, kv, seqs, sampler, stats, trees: list[Tree], tokens: np.ndarray, pos,
                           layout=None, policy=None, t_draft: float | None = None, live=None):
        """Verify (B, T) candidate tokens in one base forward; commit accepted K/V rows.

        ``layout``: (depth (B, T), mask (B, T, T)) when the trees are known in advance (static).
        ``policy``: the adaptive policy, told what the step cost and accepted (``t_draft`` None: a
        plain step; ``live``: the sequences still decoding).
        Returns (base outputs, accepted node lists, bonus tokens)."""
        bsz, t = tokens.shape
        depth, mask = layout or _tree_layout(trees, t)
        t0 = time.perf_counter()
        out = self._run_base(kv, tokens, pos[:, None] + depth, mask)
        t_verify = time.perf_counter() - t0
        stats.time_verify += t_verify
        accepted, bonus = [], []
        for b in range(bsz):
            nodes, nxt = sampler.accept(trees[b], tokens[b, : trees[b].size], out[C.LOGITS][b, : trees[b].size])
            accepted.append(nodes)
            bonus.append(nxt)
        # finished sequences keep being computed (the batch stays rectangular) but commit nothing
        counts = np.array([0 if seqs[b].done else len(a) for b, a in enumerate(accepted)])
        idx = np.zeros((bsz, max(int(counts.max()), 1)), dtype=np.int64)
        for b, a in enumerate(accepted):
            idx[b, : counts[b]] = a[: counts[b]]
        kv.append(self._presents(out, self._n_layers), idx, counts)
        stats.steps += 1
        stats.accepted += [int(c) for b, c in enumerate(counts) if not seqs[b].done]
        if policy is not None:
            policy.observe(None if t_draft is None else trees, accepted, t, t_verify, t_draft, live)
        return out, accepted, bonus

    # Medusa -----------------------------------------------------------------------------

    def _medusa_tree(self, tree) -> Tree:
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

    def _medusa(self, seqs, sampler, stats, tree: Tree):
        kv, out, last = self._prefill(seqs, stats)
        bsz = len(seqs)
        rows = np.arange(bsz)
        root = np.array([sampler.token(out[C.LOGITS][b, last[b]]) for b in rows])
        hidden = out[C.HIDDEN][rows, last]  # (B, H) last cached position
        pos = last + 1  # the root's position
        yield [(b, [int(root[b])]) for b in rows]
        topk = np.array([int(tree.rank.max()) + 1], dtype=np.int64)
        # the adaptive policy ranks a static tree's nodes by their assumed acceptance (best-n cuts)
        ranked = dataclasses.replace(tree, score=static_scores(tree))
        policy = self._new_policy(bsz, tree.size, sampler, ("medusa", tuple(tree.parents), tuple(tree.rank)))
        trees = [ranked] * bsz
        layout = _tree_layout(trees, tree.size)  # static: built once
        while True:
            live = np.array([not s.done for s in seqs])
            sizes = policy.plan(live) if policy is not None else None
            t_draft = None
            if sizes is not None and sizes.max() == 1:  # a plain step: the heads are not run at all
                step_trees, cand, step_layout = plain_inputs(root)
                stats.plain_steps += 1
            else:
                t0 = time.perf_counter()
                (ids,) = self.draft.run([C.TOPK_IDS], {C.HIDDEN: hidden[:, None], C.TOPK_IN: topk})
                t_draft = time.perf_counter() - t0
                stats.time_draft += t_draft
                stats.draft_calls += 1
                cand = medusa_candidates_batch(tree, root, ids[:, 0])  # (B, T)
                step_trees, step_layout = trees, layout
                if sizes is not None and sizes.min() < tree.size:
                    step_trees, cand, step_layout = policy.shrink(trees, cand, sizes, static=True)
            out, accepted, bonus = self._verify_and_accept(kv, seqs, sampler, stats, step_trees, cand, pos,
                                                           step_layout, policy, t_draft, live)
            emitted = []
            for b in rows:
                a = accepted[b]
                hidden[b] = out[C.HIDDEN][b, a[-1]]
                emitted.append((b, [int(x) for x in cand[b, a[1:]]] + [int(bonus[b])]))
                pos[b] += len(a)
                root[b] = bonus[b]
            yield emitted

    def _new_policy(self, bsz: int, tree_size: int, sampler, key: tuple):
        """The run's :class:`AdaptivePolicy` (None when adaptive is off for it), seeded with what the
        last run of the same loop, tree, batch size and sampling settings measured."""
        if not self._adaptive_now:
            self.last_policy = None
            return None
        key = (*key, bsz, sampler.temperature, sampler.top_p, sampler.top_k, sampler.acceptance,
               self.adaptive_config)
        policy = AdaptivePolicy(bsz, tree_size, self.adaptive_config).carry(self._policies.get(key))
        if len(self._policies) >= 64:  # a memory, not a log: forget the oldest setting
            self._policies.pop(next(iter(self._policies)))
        self._policies[key] = self.last_policy = policy
        return policy

    # EAGLE ------------------------------------------------------------------------------

    def _eagle_tree(self, tree) -> dict:
        cfg = dict(self.default_tree.get("eagle") or DEFAULT_EAGLE_TREE)
        if isinstance(tree, (str, Path)):
            import json

            try:
                tree = json.loads(Path(tree).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise InputError(f"cannot read EAGLE tree file {tree}: {e}") from None
        if tree is not None:
            if not isinstance(tree, dict) or set(tree) - {"topk", "depth", "total_tokens"}:
                raise InputError('an EAGLE tree is {"topk": k, "depth": d, "total_tokens": n}')
            cfg.update(tree)
        for k in ("topk", "depth", "total_tokens"):
            if not isinstance(cfg[k], int) or cfg[k] < 1:
                raise InputError(f"EAGLE tree {k} must be an int >= 1, got {cfg[k]!r}")
        vocab = self.drafter.get("draft_vocab_size") or self.manifest.source["vocab_size"]
        check_eagle_tree(cfg, vocab, self.max_positions)
        return cfg

    def _run_draft(self, dkv: KVCache, feats, ids, pos, tree_mask, topk, stats, mask=None, is_aux=False):
        """One drafter forward; feats are the base's (``is_aux``: EAGLE-3 layers) or the drafter's own.

        The attention mask is the cache's columns + ``tree_mask`` (B, S, S), or ``mask`` as given."""
        bsz = ids.shape[0]
        if mask is None:
            mask = _full_mask(dkv.past_mask(), tree_mask)
        feed = {C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: mask, C.TOPK_IN: topk}
        if self.drafter.get("eagle3"):  # exactly one of the two feature inputs has rows (contract)
            aux_dim = self.draft_spec.input(C.AUX_HIDDEN).dims[-1]
            hid_dim = self.draft_spec.input(C.HIDDEN).dims[-1]
            feed[C.AUX_HIDDEN] = feats if is_aux else np.empty((bsz, 0, aux_dim), self.dtype)
            feed[C.HIDDEN] = np.empty((bsz, 0, hid_dim), self.dtype) if is_aux else feats
        else:
            feed[C.HIDDEN] = feats
        t0 = time.perf_counter()
        out = self._execute(self.draft, self.draft_spec, feed, dkv, [C.HIDDEN_OUT, C.TOPK_IDS, C.TOPK_LOGPROBS])
        stats.time_draft += time.perf_counter() - t0
        stats.draft_calls += 1
        return out

    def _eagle_start(self, seqs, sampler, stats):
        """What both EAGLE loops (step-wise here, one-call in graphs.eagle_draft) begin with: the
        prefill, an empty drafter cache, the base feature the drafter reads, the first token, the
        drafter's pending context rows and the root's position."""
        kv, out, last = self._prefill(seqs, stats)
        rows = np.arange(len(seqs))
        d = self.drafter
        dkv = self._new_cache(len(seqs), d["num_layers"], d["num_kv_heads"], d["head_dim"], draft=True)
        feat_name = C.AUX_HIDDEN if d.get("eagle3") else C.HIDDEN
        root = np.array([sampler.token(out[C.LOGITS][b, last[b]]) for b in rows])
        # drafter context: (feature of position t, token t+1) for every position not yet drafted from
        pend = PendingRows([out[feat_name][b, : last[b] + 1] for b in rows],
                           [np.append(seqs[b].prompt[1:], root[b]) for b in rows], self.dtype, self.pad)
        return kv, rows, dkv, feat_name, root, pend, last + 1

    def _eagle_emit(self, seqs, out, accepted, bonus, cand, feat_name, pend, pos, root, drafted: bool) -> list:
        """Both EAGLE loops after a verify: the emitted tokens per sequence; the accepted rows become
        the drafter's next context (``drafted``) or join the rows still waiting (a plain step);
        ``pos`` and ``root`` move on (in place)."""
        emitted = []
        for b in range(len(seqs)):
            acc = accepted[b]
            emitted.append((b, [int(x) for x in cand[b, acc[1:]]] + [int(bonus[b])]))
            keep = 1 if seqs[b].done else len(acc)  # finished: one row keeps the batch rectangular
            feats_b, ids_b = out[feat_name][b, acc[:keep]], np.append(cand[b, acc[1:]], bonus[b])[:keep]
            if drafted:
                pend.set(b, feats_b, ids_b, pos[b])
            else:
                pend.extend(b, feats_b, ids_b)
            pos[b] += len(acc)
            root[b] = bonus[b]
        return emitted

    def _eagle(self, seqs, sampler, stats, cfg: dict):
        kv, rows, dkv, feat_name, root, pend, pos = self._eagle_start(seqs, sampler, stats)
        bsz = len(seqs)
        yield [(b, [int(root[b])]) for b in rows]
        topk = np.array([cfg["topk"]], dtype=np.int64)
        policy = self._new_policy(bsz, cfg["total_tokens"], sampler,
                                  ("eagle_stepwise", cfg["topk"], cfg["depth"], cfg["total_tokens"]))
        while True:
            live = np.array([not s.done for s in seqs])
            sizes = policy.plan(live) if policy is not None else None
            t_draft = None
            if sizes is not None and sizes.max() == 1:  # a plain step: no drafter call, its rows wait
                trees, cand, layout = plain_inputs(root)
                stats.plain_steps += 1
            else:
                t_draft = stats.time_draft
                trees, cand = self._eagle_draft(dkv, pend, root, pos, topk, cfg, stats)
                t_draft = stats.time_draft - t_draft
                layout = None
                if sizes is not None and sizes.min() < cand.shape[1]:
                    trees, cand, layout = policy.shrink(trees, cand, sizes)
            # 3) verify and accept
            out, accepted, bonus = self._verify_and_accept(kv, seqs, sampler, stats, trees, cand, pos, layout,
                                                           policy, t_draft, live)
            yield self._eagle_emit(seqs, out, accepted, bonus, cand, feat_name, pend, pos, root, t_draft is not None)

    def _eagle_draft(self, dkv, pend: PendingRows, root, pos, topk, cfg: dict, stats):
        """Step-wise EAGLE drafting: the pending context rows into the drafter cache, then one
        EAGLE-2 tree per sequence grown with ``depth`` more drafter calls. Returns (trees, cand (B, T))."""
        bsz, d = len(root), self.drafter
        rows = np.arange(bsz)
        # 1) context: feed the pending rows, commit them to the drafter cache
        feats, ids, ppos, causal, counts = pend.arrays()
        a = ids.shape[1]
        dout = self._run_draft(dkv, feats, ids, ppos, causal, topk, stats, is_aux=bool(d.get("eagle3")))
        dkv.append(self._presents(dout, d["num_layers"]), np.broadcast_to(np.arange(a), (bsz, a)), counts)
        # 2) grow one EAGLE-2 tree per sequence from the root's drafter output
        builders = [DynamicTreeBuilder(cfg["topk"], cfg["depth"], cfg["total_tokens"]) for _ in rows]
        frontiers = [builders[b].start(dout[C.TOPK_IDS][b, counts[b] - 1],
                                       dout[C.TOPK_LOGPROBS][b, counts[b] - 1]) for b in rows]
        prev = dout[C.HIDDEN_OUT][rows, counts - 1][:, None]  # (B, 1, H) output at the root
        w0 = dkv.w
        while frontiers[0] is not None:
            k, n_prev = frontiers[0].size, dkv.w - w0
            hid = np.stack([prev[b, f.parent_row] for b, f in enumerate(frontiers)])  # (B, k, H)
            tok = np.stack([f.tokens for f in frontiers])
            fpos = pos[:, None] + np.stack([f.depth for f in frontiers]) - 1  # parent's position
            attend = np.stack([f.attend for f in frontiers])  # (B, k, n_prev + k) over fed nodes
            cap = dkv.capacity
            mask = np.empty((bsz, 1, k, cap + k), dtype=bool)  # context, fed tree rows, this level
            mask[:, 0, :, :cap] = dkv.past_mask()[:, None, :]
            mask[:, 0, :, w0 : w0 + n_prev] = attend[:, :, :n_prev]
            mask[:, 0, :, cap:] = attend[:, :, n_prev:]
            dout = self._run_draft(dkv, hid, tok, fpos, None, topk, stats, mask=mask)
            dkv.append(self._presents(dout, d["num_layers"]), None, np.zeros(bsz, dtype=np.int64), width=k)
            prev = dout[C.HIDDEN_OUT]
            frontiers = [builders[b].expand(dout[C.TOPK_IDS][b], dout[C.TOPK_LOGPROBS][b]) for b in rows]
        dkv.truncate(w0)
        built = [builders[b].finish(root_token=int(root[b])) for b in rows]
        trees = [t for t, _ in built]
        t_max = max(t.size for t in trees)
        return trees, np.stack([_pad(tok, t_max, self.pad) for _, tok in built])  # (B, T)


def _full_mask(past: np.ndarray, tree: np.ndarray) -> np.ndarray:
    """(B, 1, S, P+S) bool from the past columns each row may see and the (B, S, S) new block.

    ``past`` is (B, P) (the same for every row) or (B, S, P) (per row, for draft trees).
    """
    bsz, s, _ = tree.shape
    if past.ndim == 2:
        past = np.broadcast_to(past[:, None, :], (bsz, s, past.shape[1]))
    return np.concatenate([past, tree], axis=2)[:, None]


def _find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Where the earliest stop string begins in ``text[start:]`` (an index into ``text``), or None."""
    hits = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def _tree_layout(trees: list[Tree], t: int) -> tuple[np.ndarray, np.ndarray]:
    """(depth (B, T), mask (B, T, T)) of per-sequence trees padded to T nodes."""
    depth = np.stack([_pad(tr.depth, t, 0) for tr in trees])
    mask = np.stack([_pad_mask(tr.mask, t) for tr in trees])
    return depth, mask


def _pad(x: np.ndarray, n: int, value) -> np.ndarray:
    out = np.full(n, value, dtype=np.int64)
    out[: len(x)] = x
    return out


def _pad_mask(mask: np.ndarray, n: int) -> np.ndarray:
    out = np.eye(n, dtype=bool)  # padding nodes see only themselves (and are never accepted)
    out[: mask.shape[0], : mask.shape[1]] = mask
    return out


def _is_batch(prompt) -> bool:
    return (isinstance(prompt, (list, tuple)) and bool(prompt)
            and not isinstance(prompt[0], (int, float, np.integer, np.floating)))


def load(out_dir, provider: str = "auto", threads: int | None = None, optimization: str = "all",
         verify: bool = True, io_binding: bool | None = None, device_id: int = 0, session_options=None,
         provider_options: dict | None = None, eagle_draft: str = "auto", adaptive: bool = True) -> Decoder:
    """Build a :class:`Decoder` from an export directory (checks every file's sha256 first).

    ``provider``: "auto" (CUDA EP when onnxruntime-gpu sees a GPU, else CPU EP), "cuda", "cpu".
    ``io_binding``: keep K/V on the device and update it in place (default: on for CUDA).
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
