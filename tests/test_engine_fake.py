"""The engine on a fake executor (tests/fake_executor.py: scripted logits, no ONNX files, no torch).

Scheduling, acceptance, the policy's decisions, plain runs, isolation and the step records, each
checked against the fake model's greedy continuation (its K/V holds each position's token, so a
wrong commit, row move or position changes the tokens)."""

from __future__ import annotations

import numpy as np
import pytest
from fake_executor import EOS, VOCAB, drive, fake_engine, reference

from graphs.adaptive import SPEC_OFF, AdaptiveConfig, Costs, Planner
from graphs.engine import PLAIN_RUN_MAX, EngineConfig
from graphs.errors import CapacityError, InputError

PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2, 8, 6, 2, 9], [11, 12], [3, 3, 8, 1, 30], [20, 21, 22, 23, 24, 25], [9]]


class FixedCosts(Costs):
    """Calls cost what ``verify(tokens)`` says, every measurement ignored: the policy's inputs fixed."""

    def __init__(self, verify=lambda t: 1.0 + 0.05 * t, draft=0.2, host=0.01):
        super().__init__()
        self.f, self.d, self.h = verify, draft, host
        self.verify, self.draft = {1: 1.0}, {1: draft}
        self.host_plain, self.host_spec = {1: host}, {1: host}

    def _avg(self, *a, **k):
        pass

    def warm(self, name, key=None):
        return True

    def verify_cost(self, tokens):
        return self.f(tokens)

    def draft_cost(self, rows):
        return self.d

    def host_cost(self, drafted, rows):
        return self.h


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("run_s", [0.0, 60.0])
def test_greedy_requests_are_exact_under_random_traffic(seed, run_s):
    """Requests of every speculation setting arrive over time, some are cancelled: every finished
    one has the model's greedy tokens; prefill chunks, row moves and trees of every width mix."""
    rng = np.random.default_rng(seed)
    engine, ex, _ = fake_engine(EngineConfig(max_batch=3, prefill_chunk=4, step_tokens=8, plain_run_s=run_s))
    want, got, cancelled = {}, {}, set()
    pending = [(rng.integers(3, VOCAB, size=int(rng.integers(1, 12))).tolist(), int(rng.integers(1, 30)),
                ["on", "off", "adaptive"][i % 3]) for i in range(14)]
    for _ in range(2000):
        if pending and rng.random() < 0.4:
            prompt, n, spec = pending.pop()
            rid = engine.add_request(prompt, max_new_tokens=n, speculation=spec)
            want[rid] = reference(prompt, n)
        if want and rng.random() < 0.03:
            rid = int(rng.choice(list(want)))
            if engine.remove_request(rid):
                cancelled.add(rid)
        if not pending and not engine.has_pending_requests():
            break
        for ev in engine.step():
            toks, _ = got.get(ev.request_id, ([], None))
            got[ev.request_id] = (toks + ev.token_ids, ev.finish_reason)
    assert not engine.has_pending_requests()
    for rid, ref in want.items():
        toks, reason = got[rid]
        if rid in cancelled:
            assert reason == "cancelled" and toks == ref[: len(toks)]
        else:
            assert toks == ref and reason == ("eos" if ref[-1] == EOS else "length"), rid
    kinds = {k for k, _, w in ex.calls if k == "verify" and w > 1}
    assert kinds, "no tree was verified"
    assert ex.kv.n == 0 and ex.kv.capacity == 0  # every row freed, the memory given back


def test_drafts_that_always_hit_or_never_hit_decode_the_same_tokens():
    for rate in (0.0, 1.0):
        engine, _, _ = fake_engine(EngineConfig(max_batch=4), hit_rate=rate)
        ids = [engine.add_request(p, max_new_tokens=20, speculation="on") for p in PROMPTS[:4]]
        got = drive(engine)
        assert [got[i][0] for i in ids] == [reference(p, 20) for p in PROMPTS[:4]]
        tot = engine.totals
        if rate == 1.0:
            assert tot.mean_accepted_length > 2.5 and tot.accepted_drafts > 0
        else:
            assert tot.accepted_drafts == 0 and tot.mean_accepted_length == 1.0


def test_step_records_agree_with_the_statistics():
    """Each verified row (watchers) accounts for the engine's counters exactly."""
    watched: list = []
    engine, _, _ = fake_engine(EngineConfig(max_batch=3, plain_run_s=0), watchers=[watched])
    for p in PROMPTS[:3]:
        engine.add_request(p, max_new_tokens=15, speculation="on")
    drive(engine)
    tot = engine.totals
    drafted = [r for r in watched if r.tree.size > 1]
    assert tot.draft_tokens == sum(r.tree.size - 1 for r in drafted) > 0
    assert tot.accepted_drafts == sum(len(r.accepted) - 1 for r in drafted)
    assert sum(tot.accepted) == sum(len(r.accepted) for r in watched)
    assert tot.steps == len({r.step for r in watched})


def test_a_request_whose_sampler_fails_ends_alone():
    engine, _, maker = fake_engine(EngineConfig(max_batch=4))
    good = [engine.add_request(p, max_new_tokens=16, speculation=s) for p, s in zip(PROMPTS[:3], ["on", "off", "on"])]
    bad = maker.new_request([7, 7, 7], maker.resolve(max_new_tokens=16, speculation="on"), engine.max_len)

    def boom(*a):
        raise FloatingPointError("injected")

    bad.sampler.accept = boom
    bid = engine.add(bad)
    events = []
    while engine.has_pending_requests():
        events += engine.step()
    err = [e for e in events if e.request_id == bid and e.finish_reason == "error"]
    assert len(err) == 1 and isinstance(err[0].error, FloatingPointError)
    for rid, p in zip(good, PROMPTS[:3]):
        assert [t for e in events if e.request_id == rid for t in e.token_ids] == reference(p, 16)


def test_a_plain_run_takes_the_steps_one_at_a_time_would():
    """A run of plain steps (one step() call) emits the tokens and the K/V of steps taken singly."""
    runs = []
    for run_s in (0.0, 60.0):
        engine, ex, _ = fake_engine(EngineConfig(max_batch=2, plain_run_s=run_s), kind=None)
        ids = [engine.add_request(p, max_new_tokens=40, speculation="off") for p in PROMPTS[:2]]
        got = drive(engine)
        runs.append(([got[i][0] for i in ids], sum(1 for k, _, _ in ex.calls if k == "plain"), engine.totals.steps))
    (a, calls_a, steps_a), (b, calls_b, steps_b) = runs
    assert a == b == [reference(p, 40) for p in PROMPTS[:2]]
    assert calls_a == calls_b and steps_a == steps_b  # the same calls, the Python paid once a run


def test_a_plain_run_stops_at_the_room_it_reserved():
    engine, ex, _ = fake_engine(EngineConfig(max_batch=1, plain_run_s=60, max_len=3 + PLAIN_RUN_MAX + 20), kind=None)
    engine.add_request([5, 6, 7], max_new_tokens=PLAIN_RUN_MAX + 10, speculation="off")
    engine.step()  # prefill
    engine.step()  # one run: at most PLAIN_RUN_MAX steps
    assert ex.kv.lens[0] == 3 + PLAIN_RUN_MAX


def test_the_policy_goes_plain_where_drafting_cannot_pay_and_probes():
    """Verifying a tree costs far more than its drafts can buy: the policy steps plain, probing now and
    then; the tokens stay exact."""
    planner = Planner(AdaptiveConfig(max_probe_every=8), costs=FixedCosts(verify=lambda t: 1.0 + 10.0 * (t - 1)))
    engine, _, _ = fake_engine(EngineConfig(max_batch=2), planner=planner, hit_rate=0.3)
    ids = [engine.add_request(p, max_new_tokens=60, speculation="adaptive") for p in PROMPTS[:2]]
    got = drive(engine)
    assert [got[i][0] for i in ids] == [reference(p, 60) for p in PROMPTS[:2]]
    widths = list(planner.history)
    assert widths.count(1) > 0.7 * len(widths) and max(widths) > 1  # plain, with probes


def test_the_policy_drafts_where_drafts_pay():
    planner = Planner(costs=FixedCosts(verify=lambda t: 1.0 + 0.01 * t))
    engine, _, _ = fake_engine(EngineConfig(max_batch=2), planner=planner, hit_rate=1.0)
    ids = [engine.add_request(p, max_new_tokens=60, speculation="adaptive") for p in PROMPTS[:2]]
    got = drive(engine)
    assert [got[i][0] for i in ids] == [reference(p, 60) for p in PROMPTS[:2]]
    widths = list(planner.history)
    assert widths.count(1) < 0.2 * len(widths) and engine.totals.mean_accepted_length > 2


def test_planner_history_is_a_window(monkeypatch):
    import graphs.adaptive

    monkeypatch.setattr(graphs.adaptive, "HISTORY_WINDOW", 8)
    p = Planner()
    for _ in range(100):
        p.plan(np.array([SPEC_OFF]), np.array([1]), [None])
    assert list(p.history) == [1] * 8


def test_seeded_sampling_is_reproducible_whatever_else_runs():
    def run(others: bool):
        engine, _, _ = fake_engine(EngineConfig(max_batch=3))
        rid = engine.add_request([5, 9, 3], max_new_tokens=30, temperature=0.9, seed=7, speculation="on")
        if others:
            for p in PROMPTS[1:3]:
                engine.add_request(p, max_new_tokens=25, temperature=1.1, seed=3)
        return drive(engine)[rid][0]

    alone = run(False)
    assert alone == run(True) and len(alone) == 30


def test_deadline_cancel_and_admission_limits():
    engine, ex, _ = fake_engine(EngineConfig(max_batch=1, max_waiting=1, max_len=64))
    a = engine.add_request([5, 6], max_new_tokens=50)
    engine.add_request([7, 8], max_new_tokens=5)
    engine.step()
    with pytest.raises(CapacityError):
        engine.add_request([9], max_new_tokens=5)
    with pytest.raises(InputError, match="max_len"):
        engine.add_request(list(range(3, 70)), max_new_tokens=5)
    assert engine.remove_request(a) and ex.kv.n == 0  # freed at once, between steps
    c = engine.add_request([9, 9], max_new_tokens=500, deadline_s=1e-6)
    got = drive(engine)
    assert got[c][1] == "deadline"
    assert engine.memory()["rows_used"] == 0 and engine.memory()["kv_allocated_bytes"] == 0


def test_a_long_prefill_is_chunked_beside_decoding_rows():
    engine, ex, _ = fake_engine(EngineConfig(max_batch=2, prefill_chunk=4, step_tokens=6, plain_run_s=0))
    short = engine.add_request([5, 6], max_new_tokens=12, speculation="off")
    first = [t for ev in engine.step() for t in ev.token_ids]
    long_prompt = list(range(3, 43))
    long = engine.add_request(long_prompt, max_new_tokens=4, speculation="off")
    got = drive(engine)
    assert first + got[short][0] == reference([5, 6], 12) and got[long][0] == reference(long_prompt, 4)
    decoded = [w for k, _, w in ex.calls if k in ("plain", "verify")]
    assert len(decoded) >= 10  # the short one decoded while the long one's chunks came in
    assert max(w for k, _, w in ex.calls if k == "prefill") <= 4  # the long prompt came in chunks


# ---------------------------------------------------------------------------------------------
# scheduling tests that ran on a trained export (tests/test_engine.py) and need no graph at all


def test_a_long_prefill_does_not_stall_the_others():
    engine, _, _ = fake_engine(EngineConfig(max_batch=4, prefill_chunk=8, step_tokens=16, max_len=128))
    a = engine.add_request(PROMPTS[3], max_new_tokens=30)
    while engine.request(a).state != "decoding":
        engine.step()
    b = engine.add_request((PROMPTS[1] * 10)[:80], max_new_tokens=4)
    steps = 0
    while engine.request(b) is not None and not engine.request(b).tokens:
        events = engine.step()
        steps += 1
        assert any(e.request_id == a for e in events), "the decoding request got nothing this step"
    assert steps >= 80 // 16  # the long prompt's prefill took several steps (chunks within the budget)


def test_remove_request_frees_the_row_at_once():
    engine, _, _ = fake_engine(EngineConfig(max_batch=2))
    ids = [engine.add_request(p, max_new_tokens=20) for p in PROMPTS[:3]]
    engine.step()
    assert engine.memory()["rows_used"] == 2 and engine.memory()["waiting"] == 1
    assert engine.remove_request(ids[0])
    assert engine.memory()["rows_used"] == 1  # freed now, not at the next step
    assert not engine.remove_request(ids[0]) and not engine.remove_request(12345)
    events = engine.step()
    assert any(e.request_id == ids[0] and e.finish_reason == "cancelled" for e in events)
    assert engine.memory()["rows_used"] == 2  # the waiting request took the row
    got = drive(engine)
    assert got[ids[2]][0][-5:] == reference(PROMPTS[2], 20)[-5:]


def test_admission_errors_name_the_limit():
    engine, _, _ = fake_engine(EngineConfig(max_batch=1, max_waiting=1, max_len=32))
    engine.add_request(PROMPTS[0], max_new_tokens=5)  # takes the free row at the next step
    engine.add_request(PROMPTS[1], max_new_tokens=5)  # waits: one may
    with pytest.raises(CapacityError, match="max_waiting"):
        engine.add_request(PROMPTS[2])
    with pytest.raises(InputError, match="max_len of 32"):
        engine.add_request(list(range(3, 40)))
    with pytest.raises(InputError, match="unknown speculation"):
        engine.add_request(PROMPTS[0], speculation="sometimes")
    with pytest.raises(InputError, match="deadline_s"):
        engine.add_request(PROMPTS[0], deadline_s=-1)
    drive(engine)
    late = engine.add_request(PROMPTS[2], max_new_tokens=30, deadline_s=1e-9)
    assert [e.finish_reason for e in engine.step() if e.request_id == late] == ["deadline"]
    with pytest.raises(InputError, match="max_len"):
        fake_engine(EngineConfig(max_len=10**9))


def test_requests_from_other_threads():
    """One thread drives step(); four others add and cancel requests: every request ends, greedy
    ones with the model's tokens."""
    import threading

    engine, _, _ = fake_engine(EngineConfig(max_batch=3, prefill_chunk=4))
    added: dict[int, int] = {}
    lock, stop = threading.Lock(), threading.Event()
    done: dict[int, list] = {}
    finish: dict[int, str] = {}

    def driver():
        while not stop.is_set() or engine.has_pending_requests():
            for e in engine.step():
                done.setdefault(e.request_id, []).extend(e.token_ids)
                if e.finish_reason:
                    finish[e.request_id] = e.finish_reason

    def client(k):
        rng = np.random.default_rng(k)
        for _ in range(6):
            p = int(rng.integers(0, len(PROMPTS)))
            rid = engine.add_request(PROMPTS[p], max_new_tokens=10)
            with lock:
                added[rid] = p
            if rng.random() < 0.3:
                engine.remove_request(rid)

    d = threading.Thread(target=driver)
    d.start()
    clients = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=60)
    stop.set()
    d.join(timeout=120)
    assert not d.is_alive() and set(finish) == set(added)
    for rid, p in added.items():
        want, got = reference(PROMPTS[p], 10), done.get(rid, [])
        assert got == want if finish[rid] != "cancelled" else got == want[: len(got)]
