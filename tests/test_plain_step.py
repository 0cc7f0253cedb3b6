"""Decode steps on calls bound once (graphs.sessions.BoundCall; Decoder.plain_step, verify_trees).

A step's base call runs on arrays bound to the session once per (buffers, occupied rows, width) and
refilled in place, instead of new arrays and new bindings each step: an autoregressive step (every
row verifies its root, Engine._plain_step) and a verify of trees. Each must compute what
``Decoder.base_forward`` computes for the same call, step after step, across a growth of the K/V
buffers and rows leaving, on non-causal trees over rows of different lengths; and the engine must
decode exactly as it does without them (greedy and seeded sampling, requests arriving and leaving),
taking a bound call for every decode step.
"""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest

import graphs
from exporter.optimize import optimize_export
from graphs import contract as C
from graphs.adaptive import Planner
from graphs.sessions import BoundCall
from graphs.slots import SlotCache

QUIET = dict(progress=None, time_gain=False, tune=False)


@pytest.fixture(scope="module")
def exports(exported, tmp_path_factory):
    """The tiny Medusa model: optimized (K/V in place, with the one-sequence graph), optimized in the
    3-D layout without it, and the raw export (K/V concatenated: no bound step)."""
    outs = {}
    for name, opts in (("one-sequence", {}), ("bsh", {"kv_layout": "bsh", "one_sequence_graph": False})):
        out = tmp_path_factory.mktemp(f"step-{name}") / "out"
        shutil.copytree(exported("medusa"), out)
        optimize_export(out, **opts, **QUIET)
        outs[name] = out
    outs["raw"] = exported("medusa")
    return outs


def _cache(dec, slots: int, max_len: int) -> SlotCache:
    src = dec.manifest.source
    return SlotCache(src["num_layers"], slots, src["num_kv_heads"], src["head_dim"], dec.dtype, max_len,
                     headroom=8, bucket=16, layout=dec.kv_layout)


def _fill(kvs, lens, rng) -> None:
    """The same rows of every cache: ``lens`` committed columns, garbage everywhere (seen or not)."""
    for kv in kvs:
        for _ in lens:
            kv.add_row()
        kv.reserve(max(lens) + 1)
    for bufs in zip(*[kv.keys + kv.values for kv in kvs]):
        noise = rng.standard_normal(bufs[0].shape).astype(bufs[0].dtype)
        for buf in bufs:
            buf[...] = noise
    for kv in kvs:
        kv.lens[: len(lens)] = lens


@pytest.mark.parametrize("name", ["one-sequence", "bsh"])
def test_the_bound_step_computes_what_base_forward_computes(exports, name):
    """Rows of different lengths, garbage in every column: 24 steps of the bound step against
    base_forward's one-token calls on a copy of the cache: the same logits and hidden states and the
    same buffers after each step, while the buffers grow (new memory: the binding is made anew) and a
    row leaves (fewer rows: likewise). The returned arrays are the binding's, refilled each step."""
    import graphs

    dec = graphs.load(exports[name], provider="cpu", threads=1)
    assert (dec._one_sequence is not None) == (name == "one-sequence")
    vocab = dec.manifest.source["vocab_size"]
    rng = np.random.default_rng(0)
    fast, slow = _cache(dec, 3, 120), _cache(dec, 3, 120)
    _fill([fast, slow], [5, 25, 1], rng)  # 32 columns: row 1 outgrows them
    outputs, generations = [], set()
    for step in range(24):
        if step == 12:  # the first row leaves: the last one moves into its place
            for kv in (fast, slow):
                kv.remove_row(0)
        n = fast.n
        roots = rng.integers(0, vocab, n)
        got = dec.plain_step(fast, roots)
        want = dec.base_forward(slow, roots[:, None], slow.lens[:n, None].copy(), np.ones((n, 1, 1), dtype=bool))
        for out in (C.LOGITS, C.HIDDEN):
            assert got[out].shape == want[out].shape
            np.testing.assert_array_equal(got[out], want[out], err_msg=f"{out} at step {step}")
        for a, b in zip(fast.keys + fast.values, slow.keys + slow.values):
            np.testing.assert_array_equal(a[:n], b[:n], err_msg=f"K/V after step {step}")
        outputs.append(got[C.LOGITS])
        generations.add(fast.generation)
        counts = np.ones(n, dtype=np.int64)
        for kv in (fast, slow):
            kv.commit(dec.presents(want), np.zeros((n, 1), dtype=np.int64), counts)
    assert len(generations) > 1, "the buffers never grew: the test did not see a new binding"
    assert outputs[0] is outputs[1]  # one binding, refilled (the caller copies what it keeps)


@pytest.mark.parametrize("name", ["one-sequence", "bsh"])
def test_a_bound_tree_verify_computes_what_base_forward_computes(exports, name):
    """Non-causal trees of different sizes per row (a root-only row, padding up to the widest),
    rows of different lengths with garbage past them: verify_trees against base_forward with the
    engine's padded inputs, one row (the one-sequence graph's call where there is one) and three
    (the base's); the same outputs for every real node and the same buffers."""
    import graphs
    from graphs.trees import Tree

    dec = graphs.load(exports[name], provider="cpu", threads=1)
    vocab = dec.manifest.source["vocab_size"]
    rng = np.random.default_rng(2)

    def tree(k):
        return Tree.from_parents([-1] + [int(rng.integers(0, i)) for i in range(1, k)])

    for lens, sizes in (([9], [6]), ([4, 13, 7], [5, 1, 3]), ([30, 2], [4, 4])):
        fast, slow = _cache(dec, len(lens), 64), _cache(dec, len(lens), 64)
        _fill([fast, slow], lens, rng)
        trees = [tree(k) for k in sizes]
        tokens = [rng.integers(0, vocab, k) for k in sizes]
        got = dec.verify_trees(fast, trees, tokens)
        n, width = len(lens), max(sizes)
        ids = np.full((n, width), dec.pad, dtype=np.int64)
        depth = np.zeros((n, width), dtype=np.int64)
        tmask = np.broadcast_to(np.eye(width, dtype=bool), (n, width, width)).copy()
        for b, (t, tok) in enumerate(zip(trees, tokens)):
            ids[b, : t.size], depth[b, : t.size], tmask[b, : t.size, : t.size] = tok, t.depth, t.mask
        want = dec.base_forward(slow, ids, slow.lens[:n, None] + depth, tmask)
        for b, k in enumerate(sizes):
            for out in (C.LOGITS, C.HIDDEN):
                np.testing.assert_array_equal(got[out][b, :k], want[out][b, :k], err_msg=f"{out} {lens} row {b}")
        for a, b_ in zip(fast.keys + fast.values, slow.keys + slow.values):
            np.testing.assert_array_equal(a[:n], b_[:n], err_msg=f"K/V {lens}")


@pytest.mark.parametrize("name,rows", [("one-sequence", 1), ("one-sequence", 3), ("bsh", 3)])
def test_a_bound_calls_next_step_computes_what_a_fresh_step_computes(exports, name, rows):
    """BoundCall.again (a plain run's next step: positions +1 in place, the new column joins each
    row's mask, the tokens BoundCall.greedy wrote into the inputs) against a fresh bound step of each
    token on a copy of the cache: the same logits and hidden states at every step, rows of different
    lengths (or one row alone: its scalar path) with garbage in every column, the same buffers after the run."""
    import graphs

    dec = graphs.load(exports[name], provider="cpu", threads=1)
    rng = np.random.default_rng(3)
    fast, slow = _cache(dec, rows, 120), _cache(dec, rows, 120)
    _fill([fast, slow], [25, 5, 1][:rows], rng)
    call, k = dec.plain_steps(fast, 12)
    assert k == 12
    roots = rng.integers(0, dec.manifest.source["vocab_size"], rows)
    ones = np.ones(rows, dtype=np.int64)
    for step in range(k):
        got = call.step(roots, fast.lens[:rows]) if step == 0 else call.again()
        want = dec.plain_step(slow, roots)
        for out in (C.LOGITS, C.HIDDEN):
            np.testing.assert_array_equal(got[out], want[out], err_msg=f"{out} at step {step}")
        roots = call.greedy().copy()  # also the next call's input
        np.testing.assert_array_equal(roots, np.argmax(want[C.LOGITS][:, 0], axis=-1))
        slow.keep_new(ones)
    fast.keep_new(ones * k)
    np.testing.assert_array_equal(fast.lens, slow.lens)
    for a, b in zip(fast.keys + fast.values, slow.keys + slow.values):
        for r, n in enumerate(fast.lens[:rows]):  # (slots, kv_heads, capacity, head_dim) views in each layout
            np.testing.assert_array_equal(a[r, :, :n], b[r, :, :n])


def test_the_greedy_choice_of_a_bound_call_is_the_first_largest_and_refuses_nan(exports):
    """BoundCall.greedy: the first of equal largest logits (np.argmax's and greedy_accept's choice),
    for one row and several; a nan or +inf chosen is the one-line error, -inf elsewhere is a mask."""
    import graphs
    from graphs.errors import NonFiniteLogitsError

    dec = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    for rows in (1, 3):
        kv = _cache(dec, rows, 64)
        _fill([kv], [4] * rows, np.random.default_rng(0))
        call, _ = dec.plain_steps(kv, 4)
        logits = call.outputs[C.LOGITS]  # (rows, 1, V): the binding's, written here by hand
        logits[...] = -np.inf
        logits[:, 0, 7] = logits[:, 0, 3] = 2.0
        assert call.greedy().tolist() == [3] * rows and call.ids[:, 0].tolist() == [3] * rows
        for bad in (np.nan, np.inf):
            logits[rows - 1, 0, 5] = bad
            with pytest.raises(NonFiniteLogitsError, match="non-finite logits"):
                call.greedy()
            logits[rows - 1, 0, 5] = -np.inf


def test_greedy_plain_runs_of_several_rows_decode_what_single_steps_decode(exports, monkeypatch):
    """A batch of greedy rows only (the run's greedy choice: BoundCall.greedy and again): rows of
    different lengths, one ending at an end token mid-run, a request waiting for a row; the same tokens,
    finish reasons, statistics and base calls as one plain step per engine step."""
    import graphs
    from graphs.engine import EngineConfig

    dec = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    dec.eos = set()
    requests = [dict(prompt=[5, 9, 3], max_new_tokens=40), dict(prompt=[7, 1, 4, 4, 2, 8, 6, 6, 1], max_new_tokens=33),
                dict(prompt=[11, 2], max_new_tokens=25), dict(prompt=[4, 4, 8], max_new_tokens=20)]
    for r in requests:
        r["speculation"] = "off"  # (the adaptive policy's choices follow measured times)
    single = dict(max_batch=3, plain_run_s=0)
    first, _ = _drive(dec.engine(EngineConfig(**single)), requests[1:2])
    requests[1]["eos_token_id"] = first[0][0][17]
    chosen = []  # the rows of each greedy choice of a run (BoundCall.greedy)
    real = BoundCall.greedy
    monkeypatch.setattr(BoundCall, "greedy", lambda self: chosen.append(len(self.rows)) or real(self))
    seen = []
    for config in (EngineConfig(**single), EngineConfig(max_batch=3, plain_run_s=60)):
        engine = dec.engine(config)
        got, calls = _drive(engine, requests, stats=True)
        seen.append((got, engine.totals.steps, list(engine.totals.accepted)))
    assert seen[0] == seen[1]
    assert seen[0][0][1][2] == "eos" and len(calls) < seen[0][1] / 2  # runs of several steps
    assert chosen.count(3) > 20 and 1 in chosen  # runs of three rows, and of the last row alone


@pytest.mark.parametrize("stop", [False, True])
def test_a_non_finite_row_inside_a_run_ends_that_request_only(exports, monkeypatch, stop):
    """A nan in one row's logits at a run's third call (the greedy choice's check, or with a stop-string
    row beside it the samplers'): that request alone ends, with finish_reason "error" and the
    NonFiniteLogitsError on its event, its row freed; the run ends there, the other row keeps its three
    tokens and decodes what a run without the nan decodes (issue 39: one request never ends another)."""
    import graphs
    from graphs.engine import EngineConfig
    from graphs.errors import NonFiniteLogitsError

    dec = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    dec.eos = set()
    requests = [dict(prompt=[5, 9, 3], max_new_tokens=12, speculation="off", stop=["\x00never"] if stop else None),
                dict(prompt=[7, 1, 4, 4], max_new_tokens=12, speculation="off")]
    clean, _ = _drive(dec.engine(EngineConfig(max_batch=2, plain_run_s=0)), requests)
    calls, _, _ = _hooked_steps(monkeypatch)
    real_again = BoundCall.again  # (the counting one)

    def poisoned(self):
        out = real_again(self)
        if len(calls) == 3:
            out[C.LOGITS][1, 0, 5] = np.nan
        return out

    monkeypatch.setattr(BoundCall, "again", poisoned)
    engine = dec.engine(EngineConfig(max_batch=2, plain_run_s=60))
    ids = [engine.add_request(**r) for r in requests]
    got = {i: [] for i in ids}
    for ev in engine.step():  # the prefills: each request's first token
        got[ev.request_id] += ev.token_ids
    calls.clear()
    events = engine.step()
    assert len(calls) == 3
    by_id = {ev.request_id: ev for ev in events}
    bad = by_id[ids[1]]
    assert bad.finish_reason == "error" and bad.token_ids == [] and isinstance(bad.error, NonFiniteLogitsError)
    assert len(by_id[ids[0]].token_ids) == 3 and by_id[ids[0]].finish_reason is None
    got[ids[0]] += by_id[ids[0]].token_ids
    assert engine.memory()["rows_used"] == 1 and engine.request(ids[1]) is None  # its row freed
    req = engine._rows[0]
    assert engine.kv.lens[0] == req.position == len(req.prompt) + len(req.tokens) - 1 and req.tokens == got[ids[0]]
    while engine.has_pending_requests():
        for ev in engine.step():
            got[ev.request_id] += ev.token_ids
    assert got[ids[0]] == clean[0][0]


def test_a_prefilling_rows_discarded_column_is_not_checked(exports, monkeypatch):
    """A plain step beside a row still prefilling computes a column for it that is dropped: a nan there
    fails nothing (greedy or sampled decoding rows), as in the general path."""
    import graphs
    from graphs.engine import EngineConfig

    dec = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    dec.eos = set()
    real_step = BoundCall.step
    poison = [False]

    def step(self, roots, lens):
        out = real_step(self, roots, lens)
        if poison[0]:
            out[C.LOGITS][1, 0, :] = np.nan  # row 1: the prefilling request's column
        return out

    monkeypatch.setattr(BoundCall, "step", step)
    for kw in ({}, dict(temperature=0.8, seed=1)):
        for run_s in (0, 60):
            engine = dec.engine(EngineConfig(max_batch=2, prefill_chunk=4, plain_run_s=run_s))
            a = engine.add_request([5, 9, 3], max_new_tokens=20, speculation="off", **kw)
            engine.step()
            engine.add_request(list(range(10, 30)), max_new_tokens=5, speculation="off")
            engine.step()
            assert [r.state for r in engine._rows] == ["decoding", "prefill"]
            poison[0] = True
            events = engine.step()
            poison[0] = False
            assert [(e.request_id, len(e.token_ids)) for e in events] == [(a, 1)]


def test_graphs_without_a_bound_step_say_so(exports):
    """The raw export (K/V concatenated) and one-token calls padded to two rows (min_rows 2) take the
    general path: plain_step returns None and changes nothing."""
    import graphs

    raw = graphs.load(exports["raw"], provider="cpu", threads=1)
    padded = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    padded.min_rows = 2
    for dec in (raw, padded):
        kv = _cache(dec, 2, 64)
        _fill([kv], [3, 4], np.random.default_rng(1))
        lens, cap = kv.lens.copy(), kv.capacity
        assert dec.plain_step(kv, np.array([1, 2])) is None
        assert np.array_equal(kv.lens, lens) and kv.capacity == cap
    root = raw.medusa_tree([[0]])  # a two-node tree: raw graphs have no bound call at any width
    kv = _cache(raw, 1, 64)
    _fill([kv], [3], np.random.default_rng(1))
    assert raw.verify_trees(kv, [root], [np.array([1, 2])]) is None


def _decode(dec, requests: list[dict], max_batch: int = 3) -> tuple[list, int]:
    """Requests arriving one per step into an engine of ``max_batch`` rows (so some wait and join as
    others leave): each request's (tokens, text), and the engine's steps that drafted nothing."""
    from graphs.engine import EngineConfig

    engine = dec.engine(EngineConfig(max_batch=max_batch))
    got: dict[int, list] = {}
    ids = []
    for step in range(400):
        if step < len(requests):
            rid = engine.add_request(**requests[step])
            ids.append(rid)
            got[rid] = [[], ""]
        for ev in engine.step():
            got[ev.request_id][0] += ev.token_ids
            got[ev.request_id][1] += ev.text
        if step >= len(requests) and not engine.has_pending_requests():
            break
    return [tuple(got[i]) for i in ids], engine.totals.plain_steps


def test_the_engine_decodes_on_bound_calls_exactly_as_without_them(exports, monkeypatch):
    """Greedy and seeded sampled requests, with speculation off, on and adaptive, arriving and
    leaving: every token and text equal to the engine's without bound calls (plain_step and
    verify_trees disabled), every decode step on a bound call (none of the per-call bindings left),
    each step that drafts nothing on a bound step of one token per row."""
    import graphs

    prompts = [[5, 9, 3], [7, 1, 4, 4, 2, 8, 6, 2, 9], [11, 2], [3, 3, 8, 1, 2], [4, 4], [9, 8, 7, 6]]
    settings = [dict(speculation="off"), dict(speculation="off", temperature=0.9, seed=3),
                dict(speculation="adaptive"), dict(speculation="off", temperature=0.7, top_k=20, seed=5),
                dict(speculation="on", temperature=0.8, seed=11), dict(speculation="off")]
    requests = [dict(prompt=p, max_new_tokens=10 + 3 * i, **s) for i, (p, s) in enumerate(zip(prompts, settings))]

    fast = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    bound = []  # (rows, width) of each bound call
    unbound = []  # the per-call runs left: prefill only (the prompts' chunks)
    for run in (fast._one_sequence, fast._in_place):
        bound_on, run_on = run.bound_on, run.run_on

        def counted_bound(kv, s, inner=bound_on):
            bound.append((kv.n, s))
            return inner(kv, s)

        def counted_run(kv, feed, rows=None, inner=run_on):
            unbound.append(feed[C.INPUT_IDS].shape)
            return inner(kv, feed, rows)

        run.bound_on, run.run_on = counted_bound, counted_run
    steps, _, _ = _hooked_steps(monkeypatch)  # each bound plain step's rows (a run's first and each next)
    got, plain = _decode(fast, requests)

    general = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    general.plain_steps = lambda kv, most: (None, 0)
    general.verify_trees = lambda kv, *a: None
    steps_before = len(steps)
    want, _ = _decode(general, requests)
    assert len(steps) == steps_before  # the general path took no bound step
    assert got == want
    assert sum(b for b, _ in unbound) == len(requests), unbound  # each prompt's one prefill, nothing else
    assert len(steps) == plain > 5, (steps, plain)  # every step that drafts nothing on a bound step
    assert sum(s == 1 for _, s in bound) <= plain  # a bound call made once for a run of steps
    assert any(s > 1 for _, s in bound)  # trees verified on bound calls too
    assert max(n for n, _ in bound) == 3  # calls of several rows (some of them still prefilling)
    # and the general path is what the bound step replaces: greedy autoregressive, request by request
    for (tokens, text), req in zip(got, requests):
        if req.get("temperature") is None:
            alone = general.generate(req["prompt"], max_new_tokens=req["max_new_tokens"], mode="autoregressive")
            assert tokens == alone.token_ids and text == alone.text


def test_generate_decodes_its_text_once_and_says_what_the_stream_says(exports):
    """generate() reads no event's text: without stop strings its requests decode their text at the
    end, not token by token; it equals the stream's text joined (and the stop string still cuts)."""
    import graphs

    dec = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    for kw in (dict(max_new_tokens=24), dict(max_new_tokens=24, temperature=0.9, seed=2)):
        res = dec.generate([5, 9, 3], mode="autoregressive", **kw)
        streamed = "".join(ev.text for ev in dec.stream([5, 9, 3], mode="autoregressive", **kw))
        assert res.text == streamed and res.text
    full = dec.generate([5, 9, 3], mode="autoregressive", max_new_tokens=24).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = dec.generate([5, 9, 3], mode="autoregressive", max_new_tokens=24, stop=stop)
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


def test_bound_calls_kept_are_few(exports):
    """Each bound call holds its outputs (rows x width x vocabulary): a cache keeps those of its
    current buffers and rows only, and of the last few widths; the one used last is kept."""
    import graphs
    from graphs.sessions import BOUND_WIDTHS

    dec = graphs.load(exports["bsh"], provider="cpu", threads=1)
    kv = _cache(dec, 3, 64)
    _fill([kv], [4, 9, 2], np.random.default_rng(5))
    kv.reserve(40)  # room for every width below: the buffers stay the same memory

    def runs():
        return [k for k in kv.bindings[dec._in_place] if k[0] == "bound"]

    for s in range(1, 9):
        dec.bound_call(kv, s)
        assert len(runs()) <= BOUND_WIDTHS
    assert sorted(k[3] for k in runs()) == list(range(9 - BOUND_WIDTHS, 9))
    dec.bound_call(kv, 5)  # reused, now the most recent: the oldest width goes next
    dec.bound_call(kv, 1)
    assert sorted(k[3] for k in runs()) == [1, 5, 7, 8]
    kv.remove_row(2)  # other rows: the bindings of three rows are dropped at the next call
    dec.bound_call(kv, 1)
    assert [k[2:] for k in runs()] == [(2, 1)]


def test_the_k_v_memory_goes_back_when_the_last_request_leaves(exports):
    """The bindings hold the K/V buffers they were made on: when the buffers grow or the last request
    leaves (the engine gives the memory back), they are dropped with them."""
    import gc
    import weakref

    import graphs
    from graphs.engine import EngineConfig

    dec = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    engine = dec.engine(EngineConfig(max_batch=2))
    engine.add_request([5, 9, 3], max_new_tokens=40, speculation="adaptive")
    stores = []
    while engine.has_pending_requests():
        engine.step()
        if engine.kv.capacity and (not stores or stores[-1]() is not engine.kv.store.base):
            stores.append(weakref.ref(engine.kv.store.base if engine.kv.store.base is not None else engine.kv.store))
    gc.collect()
    assert engine.kv.capacity == 0 and len(stores) >= 2  # it grew at least once, then gave it all back
    assert all(ref() is None for ref in stores), "a binding kept an old K/V buffer alive"


def test_the_host_time_benchmark_runs_as_it_says(exports):
    """samples/bench_host.py (the docs' host-time figures): a median per run, every step counted. It
    runs in its own process: it sets the process-wide ORT pool, which other tests' sessions refuse."""
    from conftest import run_module

    def bench_host(*args) -> list[str]:
        r = run_module("samples.bench_host", exports["one-sequence"], "--tokens", "60", "--threads", "1", *args)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    lines = bench_host("--speculation", "adaptive", "--runs", "1")
    assert len(lines) == 1 and lines[0].startswith("run 1: host ") and "us a token" in lines[0], lines
    lines = bench_host("--runs", "2", "--plain-run-s", "0,60")
    assert [ln.split(":")[0] for ln in lines] == [f"run {r} plain_run_s={s}" for r in (1, 2) for s in (0, 60)]
    per_step = [float(ln.split(", ")[-1].split()[0]) for ln in lines]
    assert per_step[0] == per_step[2] == 1.0 and per_step[1] > 5  # one token a step, or a run of them


@pytest.mark.parametrize("name", ["one-sequence", "raw"])
def test_the_context_benchmark_steps_as_the_engine_does(exports, name):
    """samples/bench_context.py times the engine's plain step (bound arrays) where the graphs take one,
    base_forward where they do not (it timed base_forward with a binding per call before), and
    commits each step's token."""
    import sys
    from pathlib import Path

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `samples` is not an installed package
    from samples import bench_context

    ours = bench_context.Ours(str(exports[name]), 1)
    calls = {"plain_step": 0, "base_forward": 0}
    for method in calls:
        real = getattr(ours.dec, method)

        def counted(*a, _real=real, _name=method, **k):
            calls[_name] += 1
            return _real(*a, **k)

        setattr(ours.dec, method, counted)
    ours.prepare(2, 8, np.random.default_rng(0))
    before = dict(calls)
    seen = []
    for _ in range(3):
        ours.step()
        seen.append(ours.next.copy())
    assert calls["plain_step"] - before["plain_step"] == 3
    assert calls["base_forward"] - before["base_forward"] == (0 if name == "one-sequence" else 3)
    assert ours.kv.lens[:2].tolist() == [11, 11]  # 8 prefilled + 3 steps, each committed
    assert all(t.shape == (2,) for t in seen)


class _Counts:
    """A request's statistics that do not depend on timing."""

    def __init__(self, s):
        self.value = (s.steps, s.plain_steps, list(s.accepted), s.new_tokens, s.draft_tokens, s.accepted_drafts)
        self.steps = s.steps

    def __eq__(self, other):
        return self.value == other.value

    def __repr__(self):
        return repr(self.value)


def _drive(engine, requests: list[dict], stats: bool = False) -> tuple[list, list]:
    """Every request added at once; each request's (tokens, text, finish reason[, counts of its final
    statistics]), and the events' token counts of each ``engine.step()`` call."""
    ids = [engine.add_request(**r) for r in requests]
    got = {rid: [[], "", None, None] for rid in ids}
    calls = []
    while engine.has_pending_requests():
        events = engine.step()
        calls.append([len(ev.token_ids) for ev in events])
        for ev in events:
            g = got[ev.request_id]
            g[0] += ev.token_ids
            g[1] += ev.text
            g[2] = ev.finish_reason or g[2]
            if ev.stats is not None:
                g[3] = _Counts(ev.stats)
    return [tuple(got[i] if stats else got[i][:3]) for i in ids], calls


def test_plain_runs_decode_what_single_steps_decode(exports):
    """Several plain steps in one engine step (EngineConfig.plain_run_s) emit exactly the tokens,
    text and finish reasons of one step per call: greedy and seeded sampling, an end token in the
    middle of a run, a stop string, rows of different lengths, requests waiting for a row; the
    runs took fewer engine steps for the same base calls, their events carrying several tokens."""
    import graphs
    from graphs.engine import EngineConfig

    dec = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    dec.eos = set()
    requests = [dict(prompt=[5, 9, 3], max_new_tokens=30), dict(prompt=[7, 1, 4, 4, 2, 8], max_new_tokens=21),
                dict(prompt=[11, 2], max_new_tokens=25, temperature=0.9, seed=3),
                dict(prompt=[3, 3, 8, 1], max_new_tokens=17, temperature=0.7, top_k=20, seed=5),
                dict(prompt=[4, 4], max_new_tokens=12)]
    for r in requests:
        r["speculation"] = "off"
    single = dict(max_batch=3, plain_run_s=0)
    first, _ = _drive(dec.engine(EngineConfig(**single)), requests[:1])
    requests[0]["eos_token_id"] = first[0][0][13]  # an end token in the middle of a run
    want, calls_single = _drive(dec.engine(EngineConfig(**single)), requests)
    engine = dec.engine(EngineConfig(max_batch=3, plain_run_s=60))
    got, calls_run = _drive(engine, requests)
    assert got == want
    assert got[0][2] == "eos" and len(got[0][0]) == 1 + first[0][0].index(first[0][0][13])
    assert max(max(c, default=0) for c in calls_run) > 1  # events carrying a run's tokens
    assert len(calls_run) < len(calls_single) / 2
    # the same base calls: each run ended where a row ended (nothing computed past its end)
    single_engine = dec.engine(EngineConfig(**single))
    _drive(single_engine, requests)
    assert engine.totals.steps == single_engine.totals.steps
    assert engine.totals.plain_steps == engine.totals.steps
    # a stop string ends the run where it completes: the same text, tokens, statistics and base calls,
    # alone and beside a row that goes on (whose tokens come in one event per run)
    text = want[1][1]
    stop = dict(requests[1], stop=text[len(text) // 2 : len(text) // 2 + 2])
    for batch in ([stop], [stop, requests[0] | {"eos_token_id": None, "max_new_tokens": 40}]):
        seen = []
        for config in (EngineConfig(**single), EngineConfig(max_batch=3, plain_run_s=60)):
            engine = dec.engine(config)
            got, _ = _drive(engine, batch, stats=True)
            seen.append((got, engine.totals.steps, engine.totals.plain_steps, list(engine.totals.accepted)))
        assert seen[0] == seen[1]
        assert seen[0][0][0][2] == "stop" and seen[0][0][0][3].steps < 20


def _hooked_steps(monkeypatch):
    """BoundCall's plain steps (a run's first, ``step``, and each next, ``again``) patched to count
    their calls (the rows of each), to run ``hooks[k]`` before the k-th call since ``calls`` was last
    cleared, and to sleep ``delay[0]`` seconds first: (calls, hooks, delay)."""
    calls, hooks, delay = [], {}, [0.0]
    real_step, real_again = BoundCall.step, BoundCall.again

    def before(n):
        if delay[0]:
            time.sleep(delay[0])
        calls.append(n)
        hook = hooks.pop(len(calls), None)
        if hook is not None:
            hook()

    def step(self, roots, lens):
        before(len(roots))
        return real_step(self, roots, lens)

    def again(self):
        before(len(self.rows))
        return real_again(self)

    monkeypatch.setattr(BoundCall, "step", step)
    monkeypatch.setattr(BoundCall, "again", again)
    return calls, hooks, delay


class _Clock:
    """A fake ``time`` module for graphs.engine (deadlines, a run's plain_run_s): perf_counter moves a
    microsecond a read (times stay positive and ordered) and jumps where a test advances it, so that a
    deadline passes at the step the test chooses, however fast or slow the machine runs."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        self.now += 1e-6
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _fake_clock(monkeypatch) -> _Clock:
    import graphs.engine

    clock = _Clock()
    monkeypatch.setattr(graphs.engine, "time", clock)
    return clock


def test_a_plain_run_ends_when_a_request_arrives_is_cancelled_or_expires(exports, monkeypatch):
    """A run of plain steps stops after the step during which a request arrived (it is admitted at
    once), a request was cancelled (from another thread), or a deadline passed; rows that may
    speculate get the plain steps the policy decided (below), a watcher of each verify one step per call."""
    import threading

    import graphs
    from graphs.engine import EngineConfig

    dec = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    dec.eos = set()
    calls, hooks, _ = _hooked_steps(monkeypatch)
    clock = _fake_clock(monkeypatch)  # the engine's time moves only where a hook moves it
    engine = dec.engine(EngineConfig(max_batch=3, plain_run_s=60))
    a = engine.add_request([5, 9, 3], max_new_tokens=40, speculation="off")
    engine.step()  # the prefill
    # a request arrives during the run's third step: the run ends there, the next step admits it
    calls.clear()
    hooks[3] = lambda: engine.add_request([7, 1, 4], max_new_tokens=40, speculation="off")
    events = engine.step()
    assert len(calls) == 3 and [len(e.token_ids) for e in events] == [3, 1]  # the new one's first token
    assert engine.kv.n == 2  # admitted and prefilled by the same engine step
    # a cancel from another thread during the second step of the next run
    calls.clear()
    b = max(engine._by_id)

    def cancel():
        t = threading.Thread(target=engine.remove_request, args=(b,))
        t.start()
        t.join()

    hooks[2] = cancel
    events = engine.step()
    assert len(calls) == 2
    assert {e.request_id: e.finish_reason for e in events}[b] == "cancelled"
    # a deadline: the run stops at it (passed during its third step), the next step finishes the request
    engine.remove_request(a)
    engine.step()
    slow = engine.add_request([5, 9, 3], max_new_tokens=200, speculation="off", deadline_s=0.3)
    engine.step()
    calls.clear()
    hooks[3] = lambda: clock.advance(1.0)
    events = engine.step()
    assert len(calls) == 3 and [(e.request_id, len(e.token_ids)) for e in events] == [(slow, 3)]
    assert not events[0].finish_reason
    assert {e.request_id: e.finish_reason for e in engine.step()}[slow] == "deadline"
    # one step per call where a watcher records each verify
    engine = dec.engine(EngineConfig(max_batch=3, plain_run_s=60))
    engine.add_request([5, 9, 3], max_new_tokens=12, speculation="off")
    engine.step()
    with dec.watch_verify() as seen:
        while engine.has_pending_requests():
            calls.clear()
            engine.step()
            assert len(calls) <= 1
    assert len(seen) == 11


@pytest.mark.parametrize("bad", [-0.1, "1", True, 61])
def test_plain_run_seconds_are_checked(bad):
    from graphs.engine import EngineConfig
    from graphs.errors import InputError

    with pytest.raises(InputError, match=r"EngineConfig\.plain_run_s must be a number of seconds in"):
        EngineConfig(plain_run_s=bad)


def test_adaptive_plain_steps_run_in_a_row_as_the_policy_decided_them(exports):
    """Where the adaptive policy has already decided the next plain steps (a reused plain decision:
    Planner.plain_ahead), they run in one engine step: the same tokens, the same width at every step
    (probes included), the same drafts (Medusa's state is a run's last) and the same base calls as one
    step per call and as the general path, in fewer engine steps. Costs are fixed (drafting never
    pays) so that the engines decide alike."""
    import graphs
    from graphs.adaptive import AdaptiveConfig, Costs, Planner
    from graphs.engine import EngineConfig

    class FixedCosts(Costs):
        def __init__(self):
            super().__init__()
            self.verify.update({1: 1e-3, 2: 2e-3, 64: 1.0})  # (2: the plain call of both rows)
            self.draft[1] = 1.0
            self.host_plain[1] = self.host_spec[1] = 0.0

        def _avg(self, name, key, value, cold=False):  # measured times change nothing
            pass

    dec = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    dec.eos = set()
    requests = [dict(prompt=[5, 9, 3], max_new_tokens=60, speculation="adaptive"),
                dict(prompt=[7, 1, 4, 4], max_new_tokens=45, speculation="adaptive")]
    general = graphs.load(exports["one-sequence"], provider="cpu", threads=1)  # no bound plain step
    general.eos, general.plain_steps = set(), lambda kv, most: (None, 0)
    runs, drafts = [], []
    for d, run_s in ((dec, 0), (dec, 60), (general, 0)):
        # (drafting can never pay here, so the default would wait 64 steps for a probe: 8 keeps
        # probes, and the drafts after runs, inside these requests)
        planner = Planner(AdaptiveConfig(max_probe_every=8), costs=FixedCosts())
        engine = d.engine(EngineConfig(max_batch=2, plain_run_s=run_s), planner=planner)
        proposed = []  # every drafted step's candidates: drafted from the hidden state the runs left
        propose = engine.proposer.propose

        def recorded(rows, sizes, propose=propose, proposed=proposed):
            result = propose(rows, sizes)
            proposed.append([p.tokens.tolist() for p in result.rows])
            return result

        engine.proposer.propose = recorded
        got, calls = _drive(engine, requests)
        runs.append((got, calls, list(planner.history), engine.totals))
        drafts.append(proposed)
    (got0, calls0, widths0, tot0), (got1, calls1, widths1, tot1), (got2, _, widths2, _) = runs
    assert got0 == got1 == got2 and widths0 == widths2
    # Medusa's drafts from the hidden state a run (or a bound step) left, as the general path leaves it
    assert drafts[0] == drafts[1] == drafts[2] and sum(len(c) > 1 for d in drafts[0] for c in d) > 3
    assert widths0 == widths1 and widths0.count(1) > 10 and max(widths0) > 1  # plain steps and probes
    assert (tot0.steps, tot0.plain_steps) == (tot1.steps, tot1.plain_steps)
    assert len(calls1) < len(calls0) - 10  # plain steps ran in a row


def test_a_plain_run_reserves_k_v_for_its_steps_only(exports):
    """A run reserves K/V columns for the steps it may take (at most PLAIN_RUN_MAX), not for its
    rows' whole length: the buffers still grow as the rows fill."""
    import graphs
    from graphs.engine import PLAIN_RUN_MAX, EngineConfig

    dec = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    dec.eos = set()
    engine = dec.engine(EngineConfig(max_batch=1, plain_run_s=60))
    engine.add_request([5, 9, 3], max_new_tokens=engine.max_len - 4, speculation="off")
    engine.step()  # the prefill
    engine.step()  # one run
    assert engine.max_len > 3 + 2 * PLAIN_RUN_MAX
    assert engine.kv.lens[0] == 3 + PLAIN_RUN_MAX
    assert engine.kv.capacity < engine.max_len


def test_a_plain_run_ends_at_an_interrupt_a_waiting_deadline_or_a_new_watcher(exports, monkeypatch):
    """Engine.interrupt() (a caller's own queue: the server's worker calls it for each command it
    queues) ends a run after its current step; so does a deadline of a request waiting for a row, and
    a verify watcher that starts during the run, which then records only the steps after it."""
    import asyncio
    import threading

    import graphs
    from graphs.engine import PLAIN_RUN_MAX, EngineConfig
    from graphs.serve.worker import Worker

    dec = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    dec.eos = set()
    calls, hooks, _ = _hooked_steps(monkeypatch)
    clock = _fake_clock(monkeypatch)  # the engine's time moves only where a hook moves it
    engine = dec.engine(EngineConfig(max_batch=1, plain_run_s=60))
    engine.add_request([5, 9, 3], max_new_tokens=200, speculation="off")
    engine.step()
    calls.clear()
    hooks[4] = engine.interrupt
    engine.step()
    assert len(calls) == 4
    # a request waiting for the only row: its deadline ends the run (it passes during the third step;
    # the run before, all 64 steps, takes no time on the engine's clock)
    late = engine.add_request([7, 1, 4], max_new_tokens=5, speculation="off", deadline_s=0.2)
    calls.clear()
    engine.step()
    assert len(calls) == PLAIN_RUN_MAX
    calls.clear()
    hooks[3] = lambda: clock.advance(1.0)
    events = engine.step()
    assert len(calls) == 3 and late not in {e.request_id for e in events}
    calls.clear()  # the next step says so at once: one base call, no run before the event
    assert {e.request_id: e.finish_reason for e in engine.step()}[late] == "deadline" and len(calls) == 1
    # a watcher that starts during a run: the run ends, the watcher records each later step alone
    calls.clear()
    watch = dec.watch_verify()
    hooks[2] = lambda: seen.append(watch.__enter__())
    seen = []
    engine.step()
    assert len(calls) == 2 and seen and seen[0] == []
    for _ in range(3):
        engine.step()
    steps = [r.step for r in seen[0]]
    assert len(steps) == 3 and steps == sorted(set(steps))  # one record a step, none for the run before
    watch.__exit__(None, None, None)

    # the server's worker: a request arriving during a run is admitted after the step it came in. The
    # worker is held inside the run's third call (its own thread, in the hook) while b is submitted
    # (Worker._post queues the add, then calls engine.interrupt), so b arrives during that step at
    # whatever speed either thread runs; the calls' rows say when b was admitted (its first 2-row call)
    inside, posted, release = threading.Event(), threading.Event(), threading.Event()

    def hold():
        inside.set()
        assert release.wait(60), "the test never released the worker"

    async def arrive():
        worker = Worker(dec, EngineConfig(max_batch=4, plain_run_s=60))
        interrupt = worker.engine.interrupt

        def interrupted():
            interrupt()
            posted.set()

        worker.engine.interrupt = interrupted
        calls.clear()
        hooks.clear()
        hooks[3] = hold
        worker.start()
        try:
            a = await worker.submit([5, 9, 3], {"speculation": "off"}, max_new=400)
            await a.queue.get()
            assert await asyncio.to_thread(inside.wait, 60), "the worker never reached the run's third call"
            posted.clear()
            submitted = asyncio.ensure_future(worker.submit([7, 1, 4], {"speculation": "off"}, max_new=3))
            try:
                assert await asyncio.to_thread(posted.wait, 60), "b was never posted"
            finally:
                release.set()
            b = await submitted
            while (await b.queue.get()).finish_reason is None:
                pass
            worker.cancel(a.id)
        finally:
            release.set()
            worker.stop()
        return list(calls)

    seen = asyncio.run(arrive())
    # a's run ended at the call during which b arrived (call 3), not after the rest of a 64-step run; the
    # next step decoded a alone (one call: a request waited for a free row), then admitted b, which
    # decoded beside a from the step after
    assert seen[:4] == [1, 1, 1, 1] and seen[4] == 2, seen[:8]


def test_the_adaptive_benchmark_decodes_the_same_tokens_both_ways(exports, tmp_path):
    """samples/bench_adaptive.py (the docs' adaptive-on-the-demo figures): both modes timed every
    round, and greedy adaptive decodes exactly the tokens plain decoding does."""
    import json

    from conftest import run_module

    out = tmp_path / "a.json"
    r = run_module("samples.bench_adaptive", exports["one-sequence"], "--repeats", "1", "--max-new-tokens", "12",
                   "--threads", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["same_tokens"] is True and len(report["adaptive_over_off"]) == 2
    assert all(len(v) == 2 and min(v) > 0 for v in report["tok_s"].values())
    assert report["mean_accepted_length"]["off"] == [1.0, 1.0]
    assert r.stdout.splitlines()[-1].startswith("adaptive / off: ") and r.stdout.rstrip().endswith("same tokens")
    bad = run_module("samples.bench_adaptive", str(tmp_path / "missing"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and bad.stderr.startswith("error: ")


class _DraftDraftPlain(Planner):
    """Two drafted steps (the full trees), then a plain decision whose run is ``1 + ahead`` steps."""

    def __init__(self, ahead: int, **kw):
        super().__init__(**kw)
        self.ahead, self.decisions = ahead, 0

    def plan(self, modes, full, gains, ceilings=None):
        drafted = self.decisions % 3 < 2
        self.decisions += 1
        sizes = np.where(modes == 0, 0, full if drafted else 1)
        self.history.append(int(sizes.max()))
        self.last_width = int(sizes.max())
        return sizes

    def plain_ahead(self) -> int:
        return self.ahead if self.last_width == 1 else 0

    def planned_plain(self) -> None:
        self.history.append(1)


@pytest.mark.parametrize("ahead", [0, 2])
def test_a_plain_run_after_drafting_is_measured_warm_or_not_at_all(exports, monkeypatch, ahead):
    """On the bound plain step: a run right after a drafted step measures its plain cost by its steps
    after the first (warm), and a run of one step is cold (graphs.adaptive.Costs)."""
    dec = graphs.load(exports["one-sequence"], provider="cpu", threads=1)
    monkeypatch.setattr(dec, "new_planner", lambda: _DraftDraftPlain(ahead, costs=dec.costs))
    plain, add_verify = [], dec.costs.add_verify

    def verify(tokens, seconds, cold=False):
        if tokens == 1:  # plain steps' (the drafted ones verify the tree, the prefill the prompt)
            plain.append(cold)
        add_verify(tokens, seconds, cold)

    monkeypatch.setattr(dec.costs, "add_verify", verify)
    res = dec.generate([5, 6, 7, 8], max_new_tokens=30, mode="speculative")
    assert res.stats.plain_steps > 2 and len(plain) >= 2
    assert plain == [ahead == 0] * len(plain)


def test_generate_reuses_its_last_kv_cache_and_decodes_the_same(exports, monkeypatch):
    """A one-prompt generate/stream call lends its K/V cache (buffers, capacity, bound calls) to the
    next one (Decoder._keep_kv): the next request decodes exactly what it decodes on a fresh decoder,
    after a longer one left its columns (stale K/V past the new row's length) and a larger capacity;
    a batch never takes it; a cache past SPARE_KV_BYTES is not kept; an export without the
    one-sequence graph (whose attention reads every column of the capacity) keeps none."""
    from graphs import runtime
    from graphs.errors import InputError

    out = exports["one-sequence"]
    fresh = {}
    for mode in ("speculative", "autoregressive"):
        fresh[mode] = graphs.load(out, provider="cpu").generate([7, 8, 9], max_new_tokens=12, mode=mode).token_ids
    dec = graphs.load(out, provider="cpu")
    assert dec._kv_spare is None
    dec.generate([3, 4, 5, 6, 7, 8], max_new_tokens=60, mode="speculative")  # long: a large capacity
    kv = dec._kv_spare
    assert kv is not None and kv.n == 0 and kv.capacity >= 66
    long_capacity, bindings = kv.capacity, len(kv.bindings)
    for mode in ("speculative", "autoregressive"):
        assert dec.generate([7, 8, 9], max_new_tokens=12, mode=mode).token_ids == fresh[mode]
        assert dec._kv_spare is kv and kv.capacity == long_capacity  # reused: no new buffers
    assert len(kv.bindings) >= bindings
    # kept idle with its bound calls only: a prefill's binding holds its (prompt x vocabulary) outputs
    assert all(key[0] == "bound" for calls in kv.bindings.values() for key in calls)
    with pytest.raises(InputError):  # a refused prompt hands the cache back untouched
        dec.generate([10**6], max_new_tokens=4)
    assert dec._kv_spare is kv
    dec.min_rows = 2  # one-token prefills padded into calls the base runs (reading every column): no lending
    assert dec.generate([7, 8, 9], max_new_tokens=12, mode="autoregressive").token_ids == fresh["autoregressive"]
    assert dec._kv_spare is kv and kv.n == 0
    dec.min_rows = 1
    streamed = [t for ev in dec.stream([7, 8, 9], max_new_tokens=12, mode="speculative") for t in ev.token_ids]
    assert streamed == fresh["speculative"] and dec._kv_spare is kv
    batch = dec.generate([[7, 8, 9], [5, 6]], max_new_tokens=4)
    assert batch[0].token_ids == fresh["speculative"][:4] and dec._kv_spare is kv  # a batch made its own
    # the K/V buffers alone fit the bound, not with the bound calls' arrays: taken, not kept
    monkeypatch.setattr(runtime, "SPARE_KV_BYTES", kv.allocated_bytes)
    dec.generate([7, 8, 9], max_new_tokens=4)
    assert dec._kv_spare is None
    no_gqa = graphs.load(exports["bsh"], provider="cpu")
    no_gqa.generate([7, 8, 9], max_new_tokens=4)
    assert no_gqa._kv_spare is None
