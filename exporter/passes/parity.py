"""Raw graph vs optimized graph on the same random inputs: the optimize stage's own gate.

Cases follow the contract's hard parts (docs/DESIGN.md, "Correctness is the product"): a random
non-causal tree mask at batch 2 over a past with holes (each sequence misses some past columns),
a one-token decode with a past, and a prefill without one. Inputs are built from the graph's
:class:`graphs.contract.GraphSpec` alone, so this needs neither torch nor the source model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exporter.distance import abs_error, sane
from graphs import contract as C


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    seq: int
    past: int
    chain: bool = False  # the new rows a causal chain (a prefill), not a random tree
    holes_all: bool = False  # every sequence's past has holes (else sequence 0's is full)


CASES = (Case("tree_b2_past7_holes", 2, 6, 7), Case("decode_b1_past5", 1, 1, 5), Case("prefill_b1", 1, 5, 0))
# the calls the one-sequence graph takes (exporter.passes.kv_inplace.group_query_graph): one sequence
# (a tree after a past with holes, a causal prefill), or one token per row of a batch with holes
ONE_SEQUENCE_CASES = (Case("tree_b1_past7_holes", 1, 6, 7, holes_all=True),
                      Case("decode_b3_past9_holes", 3, 1, 9, holes_all=True),
                      Case("prefill_b1_causal", 1, 5, 0, chain=True))


def random_tree_mask(rng, batch: int, seq: int, past: int, chain: bool = False, holes_all: bool = False
                     ) -> np.ndarray:
    """bool (B, 1, S, P+S): a random tree over the new rows (each row sees itself and its
    ancestors only; ``chain``: a causal chain) and a past with random holes per sequence (but the
    first, unless ``holes_all``)."""
    mask = np.zeros((batch, 1, seq, past + seq), dtype=bool)
    for b in range(batch):
        parents = [i - 1 for i in range(seq)] if chain else [-1] + [int(rng.integers(0, i)) for i in range(1, seq)]
        for i in range(seq):
            j = i
            while j >= 0:  # ancestors-or-self
                mask[b, 0, i, past + j] = True
                j = parents[j]
        if past:
            seen = rng.random(past) > (0.3 if b or holes_all else 0.0)  # sequence 0: full past; others: holes
            mask[b, 0, :, :past] = seen
    return mask


def random_feed(spec: C.GraphSpec, case: Case, seed: int = 0, vocab: int = 2) -> dict[str, np.ndarray]:
    """One feed for ``spec``; symbolic dims from ``case``. EAGLE-3's aux/draft split: aux rows on
    prefill, draft rows otherwise (exactly one of the two is non-zero, as the runtime calls it)."""
    rng = np.random.default_rng(seed)
    has_aux_in = any(t.name == C.AUX_HIDDEN for t in spec.inputs)
    aux_seq, draft_seq = (case.seq, 0) if case.past == 0 else (0, case.seq)
    in_place = C.kv_in_place(spec)  # the past is a buffer with room for the S new rows, written at ``past``
    sizes = {C.BATCH: case.batch, C.SEQ: case.seq, C.PAST: case.past + (case.seq if in_place else 0),
             C.TOTAL: case.past + case.seq, C.AUX_SEQ: aux_seq if has_aux_in else 0,
             C.DRAFT_SEQ: draft_seq if has_aux_in else 0}
    mask = random_tree_mask(rng, case.batch, case.seq, case.past, case.chain, case.holes_all)
    feed = {}
    for t in spec.inputs:
        shape = [sizes[d] if isinstance(d, str) else d for d in t.dims]
        if t.name == C.KV_WRITE:
            feed[t.name] = np.full(case.batch, case.past, dtype=np.int64)
        elif t.name == C.ATTENTION_MASK:
            feed[t.name] = mask
        elif t.name == C.POSITION_IDS:  # past length + tree depth
            depth = mask[:, 0, :, case.past:].sum(-1) - 1
            feed[t.name] = (case.past + depth).astype(np.int64)
        elif t.name == C.TOPK_IN:
            feed[t.name] = np.array([4], dtype=np.int64)
        elif t.dtype == "int64":
            feed[t.name] = rng.integers(0, vocab, shape).astype(np.int64)
        else:
            feed[t.name] = (rng.standard_normal(shape) * (1.0 if t.name.startswith("past") else 0.5)).astype(t.dtype)
    return feed


@dataclass
class ParityRow:
    case: str
    output: str
    max_abs: float
    limit: float
    top1: float | None  # argmax agreement (logits)
    ok: bool


def _limit(ref: np.ndarray, atol: float, rtol: float) -> float:
    return atol + rtol * float(np.abs(ref).max()) if ref.size else atol


def _error_and_limit(w64: np.ndarray, g64: np.ndarray, atol: float, rtol: float) -> tuple[float, float]:
    """Max abs error (the same infinity on both sides agrees, one side's alone is inf) and the
    tolerance over the raw graph's finite values."""
    err = float(abs_error(w64, g64).max()) if w64.size else 0.0
    return err, _limit(w64[np.isfinite(w64)], atol, rtol)


def _paired_runs(raw: Path, new: Path, spec: C.GraphSpec, new_spec: C.GraphSpec, cases, make_feed, vocab: int,
                 threads: int, raw_session=None):
    """``(case, want, got)`` per case: the raw graph on the case's feed, the rewritten one on the same
    feed cast to its own input dtypes (float16 graphs), each as a dict output name -> array.
    ``raw_session``: ``raw``'s, made once by a caller that checks several graphs against it."""
    from graphs.sessions import make_session  # honours a process-wide thread pool (exporter.bench)

    a = raw_session if raw_session is not None else make_session(raw, "cpu", threads)
    b = make_session(new, "cpu", threads)
    for i, case in enumerate(cases):
        feed = make_feed(spec, case, seed=i, vocab=vocab)
        new_feed, cut = rewritten_feed(feed, new_spec)
        got = cut(dict(zip(new_spec.output_names, b.run(new_spec.output_names, new_feed))))
        yield case, dict(zip(spec.output_names, a.run(spec.output_names, feed))), got


def rewritten_feed(feed: dict, new_spec: C.GraphSpec):
    """The raw graph's ``feed`` as the rewritten graph's: cast to its float dtype, and for a base that
    writes K/V in place, pasts padded into buffers (:func:`graphs.kv.as_inplace_feed`). Returns
    (feed, a function that turns the rewritten graph's outputs into the raw contract's)."""
    from graphs.kv import as_inplace_feed

    cut = dict
    if C.kv_in_place(new_spec):
        dflash = C.CONTEXT_POSITION_IDS in new_spec.input_names
        feed, cut = (as_inplace_dflash_feed if dflash else as_inplace_feed)(feed, new_spec)
    new_feed = {t.name: feed[t.name].astype(t.dtype) if t.dtype.startswith("float") else feed[t.name]
                for t in new_spec.inputs}
    return new_feed, cut


def graph_parity(raw: Path, new: Path, spec: C.GraphSpec, new_spec: C.GraphSpec, atol: float, rtol: float,
                 vocab: int, strict: bool = True, threads: int = 1, cases=CASES, raw_session=None, feeds=None
                 ) -> list[ParityRow]:
    """Run ``raw`` (float32, the exported trace) and ``new`` on every case; one row per output.
    ``feeds``: ``(name, feed)`` pairs in the raw contract to run instead of random ``cases`` (the
    DFlash draft graph's: :func:`dflash_parity_feeds`).

    ``strict=False`` (quantized graphs, a different model): only finiteness fails a row; the
    errors and top-1 agreement are reported. ``topk_ids`` is compared by agreement only (equal
    scores may come out in either order).
    """
    rows = []
    make_feed = random_feed
    if feeds is not None:  # given feeds, each as a case of its own name
        given = dict(feeds)
        cases = [Case(name, f[C.INPUT_IDS].shape[0], f[C.INPUT_IDS].shape[1], f[C.past_key(0)].shape[2])
                 for name, f in given.items()]

        def make_feed(spec, case, seed, vocab):
            return given[case.name]
    for case, want, got in _paired_runs(raw, new, spec, new_spec, cases, make_feed, vocab, threads, raw_session):
        for t in spec.outputs:
            w, g = want[t.name], got[t.name]
            w64, g64 = w.astype(np.float64), g.astype(np.float64)
            finite = sane(w64, g64)  # (-inf where the raw graph has it: a DFlash draft vocabulary's logits)
            if t.name == C.TOPK_IDS:
                rows.append(ParityRow(case.name, t.name, 0.0, 0.0, float((w == g).mean()) if w.size else 1.0, True))
                continue
            err, limit = _error_and_limit(w64, g64, atol, rtol)
            top1 = float((w64.argmax(-1) == g64.argmax(-1)).mean()) if t.name == C.LOGITS and w.size else None
            ok = finite and (not strict or err <= limit)
            rows.append(ParityRow(case.name, t.name, err, limit, top1, ok))
    return rows


ROW_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)  # one token (the autoregressive step) and the tree sizes used
ROW_SEEDS = 8  # chains the rows check calls with every size in ROW_SIZES
# With int8 activations (MatMulNBits accuracy level 4) a last-bit difference in a row's activations
# (its ancestors at other columns, another attention kernel) now and then moves a value across a
# quantization step: a discrete jump of ~1e-3 in the logits that a few chains may never show
# (measured on the tiny int8 EAGLE test model: none in 8 chains, 2.8e-3 in 64; its decoding parted
# from autoregressive at a top-2 margin of 6e-4). There the rows check samples this many chains more,
# each called whole and as a tree's path only, so the recorded bound sees the jumps.
ROW_SEEDS_INT8 = 32


def row_consistency(path: Path, spec: C.GraphSpec, vocab: int, sizes=ROW_SIZES, past: int = 20, threads: int = 1,
                    seed: int = 7, kv_dims: tuple[int, int] | None = None, provider: str = "cpu",
                    session=None) -> dict:
    """How much a row's logits depend on how many rows its call has, over the same past (which the
    graph computed from a prefill): a chain of ``max(sizes)`` tokens after the past, called as its
    first M tokens for every M in ``sizes``; row j of the M-call against row j of the largest call.

    Returns ``{"single": max over rows of the 1-row call, "multi": max over calls of 2+ rows,
    "tree": the chain's tokens as one path of a tree (their ancestors at other columns) against the
    chain call, "sizes": sizes}``. Greedy speculative decoding equals greedy autoregressive decoding when both
    are 0 (or below every top-2 margin); when only "single" is large (MLAS's separate M == 1 int8
    kernel), calling one token as two rows (a padding row) makes every call use the many-row kernels.
    """
    return consistency(row_logits(path, spec, vocab, sizes, past, threads, seed, kv_dims, provider, session))


def consistency(logits: dict) -> dict:
    """:func:`row_consistency`'s record from :func:`row_logits`' output."""
    sizes = sorted(m for m in logits if m != "tree")
    ref = logits[sizes[-1]]
    diff = {m: float(np.abs(logits[m] - ref[:m]).max()) for m in sizes}
    tree = float(np.abs(logits["tree"] - ref).max()) if "tree" in logits else 0.0
    return {"single": diff.get(1, 0.0), "multi": max([v for m, v in diff.items() if m > 1] or [0.0]),
            "tree": tree, "sizes": list(sizes)}


def row_logits(path: Path, spec: C.GraphSpec, vocab: int, sizes=ROW_SIZES, past: int = 20, threads: int = 1,
               seed: int = 7, kv_dims: tuple[int, int] | None = None, provider: str = "cpu", session=None,
               ids=None) -> dict:
    """M -> the (M, vocab) float64 logits of the first M tokens of one chain after a past (batch 1);
    "tree" -> the logits of the whole chain's tokens called as one path of a tree with side branches.
    ``session``: ``path``'s, made once by a caller that calls several seeds (else made here); ``sizes``
    ``(16,)``: the whole chain only (and its tree). ``ids``: the past and the chain's tokens (``past +
    max(sizes)`` of them; e.g. real text, where the gate draws random ones from ``seed``)."""
    from graphs.sessions import make_session
    from graphs.trees import Tree

    s = session if session is not None else make_session(path, provider, threads)
    rng = np.random.default_rng(seed)
    t = max(sizes)
    if ids is None:
        ids = rng.integers(0, vocab, past + t).astype(np.int64)
    else:
        ids = np.asarray(ids, dtype=np.int64)
        rng.integers(0, vocab, len(ids))  # the draw it stands for: the tree's side branches stay the seed's
        past = len(ids) - t
        if past < 1:
            raise ValueError(f"row_logits: {len(ids)} ids hold no past before a chain of {t}")
    kv = spec.input(C.past_key(0)).dims
    if len(kv) == 3:
        kv = (kv[0], kv_dims[0], kv[1], kv_dims[1])
    past_names = [x.name for x in spec.inputs if x.name.startswith("past_key_values.")]
    presents = [x.name for x in spec.outputs if x.name.startswith("present.")]

    def run(tokens, positions, mask, pasts):
        feed = {C.INPUT_IDS: tokens[None], C.POSITION_IDS: positions[None], C.ATTENTION_MASK: mask[None, None]}
        feed.update(zip(past_names, pasts))
        cut = dict
        if C.kv_in_place(spec):
            feed, cut = rewritten_feed(feed, spec)
        out = cut(dict(zip([C.LOGITS, *presents], s.run([C.LOGITS, *presents], feed))))
        return out[C.LOGITS][0].astype(np.float64), [out[n] for n in presents]

    empty = [np.zeros((1, kv[1], 0, kv[3]), spec.input(n).dtype) for n in past_names]
    _, pasts = run(ids[:past], np.arange(past), np.tril(np.ones((past, past), bool)), empty)
    logits = {}
    for m in sizes:
        mask = np.concatenate([np.ones((m, past), bool), np.tril(np.ones((m, m), bool))], axis=1)
        logits[m], _ = run(ids[past : past + m], past + np.arange(m), mask, pasts)
    # the same chain as one path of a tree, a sibling branch after every other node: each chain token
    # sees the same tokens at other columns (its ancestors scattered, as in a verified tree)
    parents, tokens, on_chain = [], [], []
    for k in range(t):
        parents.append(on_chain[-1] if on_chain else -1)
        tokens.append(ids[past + k])
        on_chain.append(len(parents) - 1)
        if k % 2:
            parents.append(int(rng.integers(0, len(parents))))
            tokens.append(int(rng.integers(0, vocab)))
    tree = Tree.from_parents(parents)
    mask = np.concatenate([np.ones((tree.size, past), bool), tree.mask], axis=1)
    out, _ = run(np.array(tokens, dtype=np.int64), past + tree.depth, mask, pasts)
    logits["tree"] = out[on_chain]
    return logits


# ----------------------------------------------------------------------------- one-call EAGLE tree graphs

TREE_CASES = (Case("tree_b2_past5_holes", 2, 4, 5), Case("decode_b1_past6", 1, 1, 6), Case("prefill_b2", 2, 5, 0))
_TREE_EXACT = (C.TREE_TOKENS, C.TREE_PARENTS, C.TREE_DEPTH, C.TREE_MASK)


def tree_feed(spec: C.GraphSpec, case: Case, seed: int = 0, vocab: int = 2) -> dict[str, np.ndarray]:
    """One feed for a ``draft_tree.*`` graph: ``case.seq`` context rows (a random tree over them, as
    :func:`random_tree_mask`) after a drafter cache of ``case.past`` rows with holes; sequence b > 0
    has fewer real rows (its root is an earlier row), as a batch whose sequences accepted different
    numbers of tokens."""
    feed = random_feed(spec, case, seed=seed, vocab=vocab)
    roots = np.array([max(0, case.seq - 1 - 2 * b) for b in range(case.batch)], dtype=np.int64)
    feed[C.ROOT_INDEX] = roots
    return feed


def tree_parity(raw: Path, new: Path, spec: C.GraphSpec, new_spec: C.GraphSpec, atol: float, rtol: float,
                vocab: int, strict: bool = True, threads: int = 1, strict_kv: bool | None = None) -> list[ParityRow]:
    """Raw vs optimized tree graph on :data:`TREE_CASES`; one row per output and case.

    ``strict``: the tree (tokens, parents, depths, ancestor mask) must be identical and the scores
    within ``atol + rtol * max|raw|``. Not strict (a quantized or float16 drafter may draft another
    tree: near-ties resolve differently): reported only (``top1`` holds the fraction of equal tree
    tokens); a NaN fails a row. ``strict_kv`` (default: ``strict``): the drafter K/V of the context
    rows, which no tree choice affects, within the tolerance.
    """
    strict_kv = strict if strict_kv is None else strict_kv
    rows = []
    for case, want, got in _paired_runs(raw, new, spec, new_spec, TREE_CASES, tree_feed, vocab, threads):
        for name in spec.output_names:
            w, g = want[name], got[name]
            if name in _TREE_EXACT:
                same = float((w == g).mean()) if w.size else 1.0
                rows.append(ParityRow(case.name, name, float(same < 1.0), 0.0,
                                      same if name == C.TREE_TOKENS else None, same == 1.0 or not strict))
                continue
            w64, g64 = w.astype(np.float64), g.astype(np.float64)
            no_nan = not np.isnan(g64).any()  # (not strict: a NaN alone fails)
            err, limit = _error_and_limit(w64, g64, atol, rtol)  # -inf scores (log-prob underflow) both sides agree
            gate = strict_kv if name.startswith("present.") else strict
            rows.append(ParityRow(case.name, name, err, limit, None, no_nan and (not gate or err <= limit)))
    return rows


# ----------------------------------------------------------------------------- the DFlash draft graph

DFLASH_CONTEXT = (5, 2)  # context rows of the first and the second call; sequence 1 holds 2 fewer in the first


def dflash_feeds(aux: np.ndarray, empty_past: list[np.ndarray], *, block_size: int, mask_token_id: int, vocab: int,
                 randint, first_presents) -> list[tuple[str, dict[str, np.ndarray]]]:
    """The DFlash draft graph's two calls at batch 2, in the raw contract (C.dflash_graph_spec), its
    inputs in the contract's order: export's check (exporter.validate.dflash_cases) and the optimize
    gate both run these, so both see the same calls.

    ``aux`` (2, 7, n*H): the base's target-layer features of 7 positions. ``empty_past``: each past
    input with no columns (2, kv, 0, d). ``randint(high, shape)``: the block's anchor tokens.
    ``first_presents(feed)``: the first call's ``present.*`` (run by the caller's reference), which
    the second call takes as its cache.

    ``context_b2_holes``: no cache, 5 context rows; sequence 1 has 3 (its rows 3, 4 masked), its
    anchor at position 3. ``block_b2_past5``: the cache of those 5 columns (sequence 1's last two
    holes) and 2 new context rows each; every block [anchor, mask x (b-1)] sees its whole self."""
    b, (a, a2) = block_size, DFLASH_CONTEXT
    names = [(C.past_key if i % 2 == 0 else C.past_value)(i // 2) for i in range(len(empty_past))]

    def call(features, ctx_pos, anchor_pos, columns, past):
        toks = np.full((2, b), mask_token_id, dtype=np.int64)
        toks[:, 0] = randint(vocab, (2,))
        mask = np.ones((2, 1, b, columns), dtype=bool)  # (B, 1, S, P+A+S): cache | new context | block
        mask[1, :, :, a - 2 : a] = False  # sequence 1's context rows 3, 4: never its own
        return {C.AUX_HIDDEN: np.ascontiguousarray(features), C.CONTEXT_POSITION_IDS: ctx_pos.astype(np.int64),
                C.INPUT_IDS: toks, C.POSITION_IDS: (np.asarray(anchor_pos)[:, None] + np.arange(b)).astype(np.int64),
                C.ATTENTION_MASK: mask, **dict(zip(names, past)), C.TOPK_IN: np.array([4], dtype=np.int64)}

    first = call(aux[:, :a], np.broadcast_to(np.arange(a), (2, a)).copy(), [a, a - 2], a + b, empty_past)
    ctx_pos = np.stack([np.arange(a, a + a2), np.arange(a - 2, a - 2 + a2)])
    second = call(aux[:, a : a + a2], ctx_pos, [a + a2, a - 2 + a2], a + a2 + b, list(first_presents(first)))
    return [("context_b2_holes", first), ("block_b2_past5", second)]


def dflash_parity_feeds(base: Path, base_spec: C.GraphSpec, draft_session, draft_spec: C.GraphSpec, drafter: dict,
                        vocab: int, seed: int = 0) -> list[tuple[str, dict[str, np.ndarray]]]:
    """:func:`dflash_feeds` from the raw graphs of an export: the features from the raw base (a causal
    prefill of 7 random tokens at batch 2), the second call's cache from the raw draft graph
    (``draft_session``) on the first call."""
    from graphs.sessions import make_session

    rng = np.random.default_rng(seed)
    prefill = random_feed(base_spec, Case("prefill_b2_causal", 2, sum(DFLASH_CONTEXT), 0, chain=True), seed, vocab)
    aux = make_session(base, "cpu", 1).run([C.AUX_HIDDEN], prefill)[0]
    pasts = [t for t in draft_spec.inputs if t.name.startswith("past_key_values.")]
    empty = [np.zeros((2, t.dims[1], 0, t.dims[3]), dtype=t.dtype) for t in pasts]
    presents = [t.name for t in draft_spec.outputs if t.name.startswith("present.")]
    return dflash_feeds(aux, empty, block_size=int(drafter["block_size"]), mask_token_id=int(drafter["mask_token_id"]),
                        vocab=vocab, randint=lambda high, shape: rng.integers(0, high, shape, dtype=np.int64),
                        first_presents=lambda feed: draft_session.run(presents, feed))


def as_inplace_dflash_feed(feed: dict, spec: C.GraphSpec):
    """:func:`graphs.kv.as_inplace_feed` for a DFlash draft graph written in place
    (:func:`graphs.contract.inplace_dflash_spec`): each past (B, kv, P, hd) padded with A zero columns
    (A: the new context rows), every row's A rows written at column P; the mask's P+A+S columns line up
    with the buffer's P+A then the block's S. ``cut`` gives back each ``present.*`` as the A new rows."""
    p = feed[C.past_key(0)].shape[2]
    a = feed[C.AUX_HIDDEN].shape[1]
    out = dict(feed)
    for t in spec.inputs:
        if t.name.startswith("past_key_values."):
            x = feed[t.name]
            out[t.name] = np.concatenate([x, np.zeros((*x.shape[:2], a, x.shape[3]), dtype=x.dtype)], axis=2)
    out[C.KV_WRITE] = np.full(feed[C.AUX_HIDDEN].shape[0], p, dtype=np.int64)

    def cut(outputs: dict) -> dict:
        return {k: v[:, :, p : p + a] if k.startswith("present.") else v for k, v in outputs.items()}

    return out, cut
