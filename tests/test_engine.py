"""The serving engine (graphs.engine): requests that join and leave at every step, each its own settings.

Lossless under any traffic, tested with randomized arrival schedules (a fixed seed per schedule):
requests added at random steps with random lengths, speculation switches and trees, some cancelled
at random steps. Every greedy request's tokens must be the base's greedy tokens (PyTorch's, from
test_runtime's references) whatever joined, drafted or left around it; sampled requests amid
such traffic keep the base distribution (test_spec_sampling's chi-square); a seeded request is
reproducible whatever else runs. Then memory (a fixed budget, given back), chunked prefill,
cancellation, deadlines, admission limits and threads.
"""

from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest
from test_runtime import EAGLE_TREES, MEDUSA_TREES, N_NEW, PROMPTS, references, trained  # noqa: F401 (fixtures)
from test_spec_sampling import P_MIN, PROMPT, VOCAB, chi_square, exact_joint, setup  # noqa: F401 (fixture)

import graphs
import graphs.contract
from graphs.engine import EngineConfig

SCHEDULES = [("medusa", "auto"), ("eagle", "stepwise"), ("eagle", "one_call"), ("eagle3", "stepwise"),
             ("eagle3", "one_call")]


def _trees(kind: str, draft: str) -> list:
    if kind == "medusa":
        return [None, MEDUSA_TREES["chain"], MEDUSA_TREES["wide"], MEDUSA_TREES["deep_wide"]]
    if draft == "one_call":  # the baked ones (test_runtime exports (2, 3, 6) and (4, 4, 12))
        return [None, EAGLE_TREES["4-4-12"]]
    return [None, EAGLE_TREES["1-1-2"], EAGLE_TREES["4-4-12"]]


def drive(engine, schedule: list[dict], max_steps: int = 2000) -> dict[int, dict]:
    """Run ``schedule`` (each: arrive step, prompt, params, cancel step or None) to the end; returns
    {schedule index: {"tokens", "finish", "events"}}."""
    out: dict[int, dict] = {}
    ids: dict[int, int] = {}  # request id -> schedule index
    step = 0
    while step < max_steps:
        for i, s in enumerate(schedule):
            if s["arrive"] == step:
                ids[engine.add_request(s["prompt"], **s["params"])] = i
                out[i] = {"tokens": [], "finish": None, "events": 0}
            if s.get("cancel") == step and i in out and out[i]["finish"] is None:
                rid = next(r for r, j in ids.items() if j == i)
                assert engine.remove_request(rid)
        for e in engine.step():
            o = out[ids[e.request_id]]
            assert o["finish"] is None, "an event after the request finished"
            o["tokens"] += e.token_ids
            o["events"] += 1
            o["finish"] = e.finish_reason
        step += 1
        if step > max(s["arrive"] for s in schedule) and not engine.has_pending_requests():
            return out
    raise AssertionError("the schedule did not finish")


def random_schedule(seed: int, kind: str, draft: str, n: int = 14) -> list[dict]:
    rng = np.random.default_rng(seed)
    trees = _trees(kind, draft)
    sched = []
    for _ in range(n):
        p = int(rng.integers(0, len(PROMPTS)))
        params = {"max_new_tokens": int(rng.integers(1, N_NEW + 1)),
                  "speculation": str(rng.choice(["on", "off", "adaptive"])),
                  "tree": trees[int(rng.integers(0, len(trees)))]}
        if rng.random() < 0.25:  # sampled traffic around the greedy requests
            params.update(temperature=0.9, seed=int(rng.integers(0, 1000)))
        arrive = int(rng.integers(0, 25))
        cancel = arrive + int(rng.integers(0, 8)) if rng.random() < 0.2 else None
        sched.append({"arrive": arrive, "prompt": PROMPTS[p], "ref": p, "params": params, "cancel": cancel})
    return sched


@pytest.mark.parametrize(("kind", "draft"), SCHEDULES)
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_requests_are_exact_under_random_traffic(trained, kind, draft, seed):  # noqa: F811
    t = trained(kind)
    _greedy_under_traffic(t.out_dir, t.refs, kind, draft, seed)


@pytest.fixture(scope="module")
def optimized_trained(trained, tmp_path_factory):  # noqa: F811
    """``optimized_trained(kind) -> Path``: the trained export, optimized for the CPU (fused, K/V
    written in place by the base graph)."""
    import shutil

    from exporter.optimize import optimize_export

    cache = {}

    def make(kind):
        if kind not in cache:
            out = tmp_path_factory.mktemp(f"opt-trained-{kind}") / "out"
            shutil.copytree(trained(kind).out_dir, out)
            optimize_export(out, progress=None, time_gain=False, tune=False)
            cache[kind] = out
        return cache[kind]

    return make


@pytest.mark.parametrize(("kind", "draft"), [("medusa", "auto"), ("eagle", "one_call"), ("eagle3", "stepwise")])
def test_greedy_requests_are_exact_on_graphs_that_write_kv_in_place(trained, optimized_trained, kind,  # noqa: F811
                                                                   draft):
    """The optimized base writes each row's K/V at that row's own column and the engine compacts the
    accepted rows in place: the same tokens under the same random traffic (rows of different lengths
    verifying different trees in one call, rows leaving and moving)."""
    out = optimized_trained(kind)
    assert graphs.contract.kv_in_place(graphs.load(out, provider="cpu", threads=1).base_spec)
    _greedy_under_traffic(out, trained(kind).refs, kind, draft, seed=0)


def _greedy_under_traffic(out_dir, refs, kind, draft, seed):
    dec = graphs.load(out_dir, provider="cpu", threads=1, eagle_draft=draft)
    engine = dec.engine(EngineConfig(max_batch=4, prefill_chunk=4, step_tokens=12))
    sched = random_schedule(seed, kind, draft)
    with dec.watch_verify() as records:
        out = drive(engine, sched)
    checked = 0
    for i, s in enumerate(sched):
        o, ref = out[i], refs[s["ref"]]
        if s["params"].get("temperature"):
            continue
        want = ref[: s["params"]["max_new_tokens"]]
        if o["finish"] == "cancelled":
            assert o["tokens"] == want[: len(o["tokens"])], f"request {i}: cancelled, but not a prefix"
        else:
            assert o["tokens"] == want, f"request {i} ({s['params']}): not the base's greedy tokens"
            assert o["finish"] in ("length", "eos")
            checked += 1
    assert checked >= 5
    sizes = [r.tree.size for r in records]
    assert max(sizes) > 1 and 1 in sizes  # drafted and plain rows happened
    steps: dict[int, set] = {}
    for r in records:
        steps.setdefault(r.step, set()).add(r.tree.size)
    assert any(len(v) > 1 for v in steps.values())  # rows of one step verified different tree sizes
    assert engine.memory()["rows_used"] == 0 and engine.memory()["kv_allocated_bytes"] == 0


@pytest.mark.parametrize("speculation", ["on", "off"])
def test_a_seeded_request_is_reproducible_whatever_else_runs(trained, speculation):  # noqa: F811
    t = trained("eagle")
    dec = graphs.load(t.out_dir, provider="cpu", threads=1)
    params = {"max_new_tokens": 24, "temperature": 0.8, "seed": 11, "speculation": speculation}
    alone = drive(dec.engine(EngineConfig(max_batch=4, prefill_chunk=4)),
                  [{"arrive": 0, "prompt": PROMPTS[5], "params": params}])[0]["tokens"]
    sched = [*random_schedule(3, "eagle", "auto", n=10), {"arrive": 4, "prompt": PROMPTS[5], "params": params}]
    crowd = drive(dec.engine(EngineConfig(max_batch=4, prefill_chunk=4)), sched)[len(sched) - 1]["tokens"]
    assert crowd == alone and len(alone) == 24


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_sampled_requests_keep_the_base_distribution_under_traffic(setup, kind):  # noqa: F811
    """Requests of PROMPT at temperature 1 arrive in waves among greedy requests, some of which are
    cancelled; the joint of their first three tokens is the base's (chi-square, as test_spec_sampling)."""
    decoders, base = setup
    dec = decoders[kind]
    engine = dec.engine(EngineConfig(max_batch=96, prefill_chunk=2, step_tokens=64))
    rng = np.random.default_rng(7)
    counts = np.zeros((VOCAB,) * 3, dtype=np.int64)
    sampled, noise, tokens, taus = set(), [], {}, []
    for wave in range(40):
        for _ in range(60):
            sampled.add(engine.add_request(PROMPT, max_new_tokens=3, temperature=1.0,
                                           speculation=str(rng.choice(["on", "adaptive"]))))
        for _ in range(4):
            noise.append(engine.add_request(rng.integers(3, VOCAB, size=int(rng.integers(1, 9))).tolist(),
                                            max_new_tokens=int(rng.integers(1, 12))))
        for _ in range(3):
            for e in engine.step():
                tokens.setdefault(e.request_id, []).extend(e.token_ids)
                if e.stats is not None and e.request_id in sampled:
                    taus.append(e.stats.mean_accepted_length)
        if wave % 3 == 0 and noise:
            engine.remove_request(noise.pop(int(rng.integers(0, len(noise)))))
    while engine.has_pending_requests():
        for e in engine.step():
            tokens.setdefault(e.request_id, []).extend(e.token_ids)
            if e.stats is not None and e.request_id in sampled:
                taus.append(e.stats.mean_accepted_length)
    toks = np.array([tokens[r] for r in sorted(sampled)])
    assert toks.shape == (2400, 3)
    np.add.at(counts, tuple(toks.T), 1)
    assert np.mean(taus) > 1.02, "drafts are (almost) never accepted; the test would prove little"
    stat, dof, p = chi_square(counts, exact_joint(base))
    print(f"\n{kind} engine traffic: chi2 {stat:.1f} dof {dof} p {p:.3g} tau {np.mean(taus):.2f}")
    assert p > P_MIN


def test_memory_stays_flat_over_hundreds_of_requests(trained):  # noqa: F811
    t = trained("eagle")
    dec = graphs.load(t.out_dir, provider="cpu", threads=1)
    engine = dec.engine(EngineConfig(max_batch=6, prefill_chunk=8, max_len=64))
    mem = engine.memory()
    assert mem["kv_budget_bytes"] > 0 and mem["kv_allocated_bytes"] == 0
    rng = np.random.default_rng(0)

    def wave(n):
        for _ in range(n):
            engine.add_request(rng.integers(3, 256, size=int(rng.integers(1, 30))).tolist(),
                               max_new_tokens=int(rng.integers(1, 20)))
        peak = 0
        while engine.has_pending_requests():
            engine.step()
            m = engine.memory()
            assert m["kv_allocated_bytes"] <= m["kv_budget_bytes"]
            assert m["drafter_kv_allocated_bytes"] <= m["drafter_kv_budget_bytes"]
            peak = max(peak, m["kv_allocated_bytes"])
        return peak

    wave(60)  # warm up (ONNX Runtime's arenas, numpy's caches)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    peak = max(wave(120), wave(120))
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert peak <= mem["kv_budget_bytes"]
    m = engine.memory()
    assert m["rows_used"] == 0 and m["waiting"] == 0 and m["kv_allocated_bytes"] == 0  # given back
    assert after - before < 2 * 2**20, f"Python memory grew by {(after - before) / 2**20:.1f} MiB over 240 requests"


# (the scheduling tests that need no graph, long prefills, cancels, admission limits and requests from
# other threads, run on the fake executor: tests/test_engine_fake.py)


def test_generate_from_several_threads_is_reproducible(trained):  # noqa: F811
    """A seeded sampling run gives the same tokens whether run alone or beside others on the same
    decoder from other threads (each run has its own engine; nothing about a run is on the decoder)."""
    t = trained("medusa")
    dec = graphs.load(t.out_dir, provider="cpu", threads=1)
    want = dec.generate(PROMPTS[4], max_new_tokens=20, temperature=0.9, seed=3).token_ids
    got: list = [None] * 6

    def run(k):
        got[k] = dec.generate(PROMPTS[4], max_new_tokens=20, temperature=0.9, seed=3).token_ids

    threads = [threading.Thread(target=run, args=(k,)) for k in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert got == [want] * 6


def test_a_2d_array_of_prompts_is_a_batch(trained):  # noqa: F811
    t = trained("medusa")
    arr = np.array([PROMPTS[1][:2], PROMPTS[2][:2]])
    results = t.decoder.generate(arr, max_new_tokens=5)
    assert isinstance(results, list) and len(results) == 2
    assert [r.token_ids for r in results] == [t.decoder.generate(list(p), max_new_tokens=5).token_ids for p in arr]
