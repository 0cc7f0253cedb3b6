"""The DFlash proposer in the engine (graphs.proposers.DFlash): ``graphs.load`` on a DFlash export drafts
with it, the block verified as the chain or as a top-k tree, lossless, beside requests of other
strategies, with drafts the base accepts.

The export is conftest.trained_dflash: a tiny base and a DFlash drafter (block 4) trained on its own
distilled answers, built once for the session (test_dflash_loop reads it too)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import dflash_prompts
from dflash_reference import Graphs

import graphs
from exporter import pipeline
from exporter.speculative import enable_huggingface_checkpointing
from graphs import contract as C
from graphs.dflash_tree import block_trees
from graphs.engine import EngineConfig
from graphs.errors import InputError

QUIET = dict(log=lambda *a, **k: None)
CHAIN = {"topk": 1, "total_tokens": 4}
TREE = {"topk": 3, "total_tokens": 8}


def prompts(n, seed=0, length=6):
    """The prompts the drafter was trained on the answers of."""
    return dflash_prompts(n, seed, length)


@pytest.fixture(scope="module")
def dflash_export(trained_dflash):
    """(export dir, its reference graphs): a tiny base, a DFlash drafter (block 4) trained a little (conftest)."""
    return trained_dflash[0], Graphs(trained_dflash[0])


@pytest.fixture(scope="module")
def decoder(dflash_export):
    return graphs.load(dflash_export[0], provider="cpu", threads=1)


@pytest.fixture(scope="module")
def greedy_refs(decoder):
    """The base's greedy tokens of the trained prompts (autoregressive)."""
    ps = prompts(4)
    return ps, [r.token_ids for r in decoder.generate(ps, max_new_tokens=24, mode="autoregressive")]


def _drive(engine, requests: list[dict]) -> dict:
    """Every request added at once, stepped to the end: {request id: (tokens, last stats)}."""
    ids = [engine.add_request(r.pop("prompt"), **r) for r in requests]
    got = {i: [] for i in ids}
    stats = {}
    while engine.has_pending_requests():
        for e in engine.step():
            got[e.request_id] += e.token_ids
            if e.stats is not None:
                stats[e.request_id] = e.stats
    return [(got[i], stats.get(i)) for i in ids]


@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_is_exact_beside_other_strategies_and_drafts_are_accepted(decoder, greedy_refs, tree):
    """Greedy DFlash rows (chain or tree, speculation on and adaptive) equal autoregressive exactly in a
    batch that also holds a plain row and a sampled row; the drafted rows accept drafts (tau > 1)."""
    ps, refs = greedy_refs
    engine = decoder.engine(EngineConfig(max_batch=6, prefill_chunk=4))
    reqs = [{"prompt": p, "max_new_tokens": 24, "tree": tree, "speculation": s}
            for p, s in zip(ps, ["on", "on", "adaptive", "on"])]
    reqs.insert(2, {"prompt": ps[0], "max_new_tokens": 24, "speculation": "off"})
    reqs.insert(4, {"prompt": ps[1], "max_new_tokens": 24, "temperature": 0.8, "seed": 5, "tree": tree})
    out = _drive(engine, reqs)
    spec = [out[i] for i in (0, 1, 3, 5)]
    assert [t for t, _ in spec] == refs
    assert out[2][0] == refs[0]  # the plain row beside them
    assert len(out[4][0]) == 24  # the sampled row ran to its length
    taus = [st.mean_accepted_length for _, st in (out[0], out[1], out[5])]  # the rows always drafting
    print(f"\ndflash {tree}: tau {np.round(taus, 2).tolist()}")
    assert min(taus) > 1.1, taus  # the trained block drafts tokens the base accepts


def test_rows_that_leave_move_the_drafter_rows_with_them(decoder, greedy_refs):
    """Requests finish early, one is cancelled, one arrives into a freed row (the engine moves the last
    row into each freed one, the drafter's K/V and pending rows with it): every greedy tree row stays
    exact and keeps accepting drafts."""
    ps, refs = greedy_refs
    engine = decoder.engine(EngineConfig(max_batch=4, prefill_chunk=4))
    lens = [5, 24, 16, 24]
    ids = [engine.add_request(p, max_new_tokens=n, tree=TREE, speculation="on") for p, n in zip(ps, lens)]
    got = {i: [] for i in ids}
    stats = {}
    steps = 0
    while engine.has_pending_requests():
        for e in engine.step():
            got.setdefault(e.request_id, []).extend(e.token_ids)
            if e.stats is not None:
                stats[e.request_id] = e.stats
        steps += 1
        if steps == 3:
            engine.remove_request(ids[2])  # cancelled mid-run: its row freed, the last moves into it
        if steps == 4:
            ids.append(engine.add_request(ps[0], max_new_tokens=20, tree=TREE, speculation="on"))
    for i, ref, n in zip(ids, [*refs, refs[0]], [*lens, 20]):
        if i == ids[2]:
            assert got[i] == ref[: len(got[i])] and len(got[i]) < n
        else:
            assert got[i] == ref[:n], i
    assert stats[ids[1]].mean_accepted_length > 1.1 and stats[ids[4]].mean_accepted_length > 1.1


def test_sampled_request_is_the_same_alone_and_in_a_batch(decoder):
    """A seeded sampled DFlash request draws the same tokens alone and beside greedy DFlash rows."""
    p = prompts(2)[1]
    params = dict(max_new_tokens=20, temperature=0.8, seed=11, tree=TREE)
    alone = _drive(decoder.engine(EngineConfig(max_batch=4)), [{"prompt": p, **params}])[0][0]
    crowd = _drive(decoder.engine(EngineConfig(max_batch=4, prefill_chunk=3)),
                   [{"prompt": q, "max_new_tokens": 12} for q in prompts(3)] + [{"prompt": p, **params}])[-1][0]
    assert crowd == alone and len(alone) == 20


@pytest.fixture(scope="module")
def optimized(dflash_export, tmp_path_factory):
    """The trained export optimized for the CPU (fused float32): both caches written in place."""
    d = tmp_path_factory.mktemp("dflash-engine-opt") / "fused"
    shutil.copytree(dflash_export[0], d)
    pipeline.optimize_export(d, progress=None, time_gain=False)
    return graphs.load(d, provider="cpu", threads=1)


def test_optimized_export_drafts_with_its_context_cache_in_place(optimized):
    """On the optimized export the drafter's context K/V is written in place by the draft graph
    (graphs.contract.inplace_dflash_spec): greedy chain and tree rows at batch 3 equal autoregressive."""
    assert C.KV_WRITE in optimized.model.draft_spec.input_names
    ps = prompts(3)
    refs = [r.token_ids for r in optimized.generate(ps, max_new_tokens=20, mode="autoregressive")]
    for tree in (CHAIN, TREE):
        got = optimized.generate(ps, max_new_tokens=20, tree=tree, speculation="on")
        assert [r.token_ids for r in got] == refs, tree
        assert got[0].stats.mean_accepted_length > 1.1


def test_tree_settings_are_checked(decoder):
    with pytest.raises(InputError, match="at most 4 nodes"):
        decoder.generate([5, 6], max_new_tokens=2, tree={"topk": 1, "total_tokens": 9})
    with pytest.raises(InputError, match="DFlash tree"):
        decoder.generate([5, 6], max_new_tokens=2, tree={"topk": 2, "depth": 3, "total_tokens": 9})
    assert decoder.requests.dflash_tree(None) == {"topk": 1, "total_tokens": 4}  # the manifest's: the chain


# ------------------------------------------------------------------------------ on the fake executor


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("run_s", [0.0, 60.0])
def test_fake_dflash_rows_stay_exact_and_consistent_under_random_traffic(seed, run_s):
    """tests/fake_executor.py's DFlash drafter checks, at every draft call, that each row's cached +
    pending context rows are exactly its tokens before the root at their positions (so row moves,
    cancels, chunked prefill, plain runs and switching keep the drafter rows right); every greedy
    request of every setting (chain, tree, off, adaptive) has the model's greedy tokens."""
    from fake_executor import EOS, VOCAB, fake_engine, reference

    rng = np.random.default_rng(seed)
    engine, ex, _ = fake_engine(EngineConfig(max_batch=3, prefill_chunk=4, step_tokens=8, plain_run_s=run_s),
                                kind="dflash")
    want, got, cancelled = {}, {}, set()
    settings = [{"speculation": "on", "tree": CHAIN}, {"speculation": "off"}, {"speculation": "adaptive", "tree": TREE},
                {"speculation": "on", "tree": {"topk": 2, "total_tokens": 6}}]
    pending = [(rng.integers(3, VOCAB - 1, size=int(rng.integers(1, 12))).tolist(), int(rng.integers(1, 30)),
                settings[i % len(settings)]) for i in range(14)]
    for _ in range(3000):
        if pending and rng.random() < 0.4:
            prompt, n, kw = pending.pop()
            rid = engine.add_request(prompt, max_new_tokens=n, **kw)
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
    assert any(k == "draft" for k, _, _ in ex.calls) and engine.totals.accepted_drafts > 0
    assert ex.draft_kv.n == 0  # every drafter row freed with its request


def test_fake_dflash_request_whose_sampler_fails_ends_alone():
    from fake_executor import fake_engine, reference

    engine, _, maker = fake_engine(EngineConfig(max_batch=4), kind="dflash")
    ps = [[5, 9, 3], [7, 1, 4, 4, 2], [11, 12]]
    good = [engine.add_request(p, max_new_tokens=16, speculation=s, **({} if s == "off" else {"tree": TREE}))
            for p, s in zip(ps, ["on", "off", "on"])]
    bad = maker.new_request([7, 7, 7], maker.resolve(max_new_tokens=16, speculation="on", tree=TREE), engine.max_len)

    def boom(*a):
        raise FloatingPointError("injected")

    bad.sampler.accept = boom
    bid = engine.add(bad)
    events = []
    while engine.has_pending_requests():
        events += engine.step()
    err = [e for e in events if e.request_id == bid and e.finish_reason == "error"]
    assert len(err) == 1 and isinstance(err[0].error, FloatingPointError)
    for rid, p in zip(good, ps):
        assert [t for e in events if e.request_id == rid for t in e.token_ids] == reference(p, 16)


@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
def test_fake_dflash_policy_goes_plain_where_drafting_cannot_pay_and_drafts_where_it_does(tree):
    """The adaptive policy on DFlash rows (test_engine_fake's costs): plain steps with probes where a
    tree costs far more than its drafts buy, drafted steps where drafts pay; the tokens stay exact
    (and the fake checks the drafter's context at every draft across the switches)."""
    from fake_executor import drive, fake_engine, reference
    from test_engine_fake import FixedCosts

    from graphs.adaptive import AdaptiveConfig, Planner

    ps = [[5, 9, 3], [7, 1, 4, 4, 2, 8, 6, 2, 9]]
    for verify, rate, plain in [(lambda t: 1.0 + 10.0 * (t - 1), 0.3, True), (lambda t: 1.0 + 0.01 * t, 1.0, False)]:
        planner = Planner(AdaptiveConfig(max_probe_every=8), costs=FixedCosts(verify=verify))
        engine, _, _ = fake_engine(EngineConfig(max_batch=2), planner=planner, kind="dflash", hit_rate=rate)
        ids = [engine.add_request(p, max_new_tokens=60, speculation="adaptive", tree=tree) for p in ps]
        got = drive(engine)
        assert [got[i][0] for i in ids] == [reference(p, 60) for p in ps]
        widths = list(planner.history)
        if plain:
            assert widths.count(1) > 0.7 * len(widths) and max(widths) > 1  # plain, with probes
        else:
            assert widths.count(1) < 0.2 * len(widths) and engine.totals.mean_accepted_length > 2


# ------------------------------------------------------------------------------ the drafts themselves


def reference_block(g: Graphs, tokens: list[int], root_pos: int, size: int, topk: int):
    """The (tree, tokens) DFlash drafts at ``root_pos`` (tokens[root_pos] the root) from the whole context
    at once: one base forward over tokens[:root_pos] for the features, one draft call with no cache."""
    src, d = g.m.source, g.m.drafter
    kv = [np.zeros((1, src["num_kv_heads"], 0, src["head_dim"]), np.float32) for _ in range(2 * src["num_layers"])]
    ctx = np.array(tokens[:root_pos])
    out = g.run_base(kv, ctx, np.arange(root_pos), np.tril(np.ones((root_pos, root_pos), bool)))
    dkv = [np.zeros((1, d["num_kv_heads"], 0, d["head_dim"]), np.float32) for _ in range(2 * d["num_layers"])]
    b = d["block_size"]
    block = np.array([tokens[root_pos]] + [d["mask_token_id"]] * (b - 1))
    dr = g.run_draft(dkv, out[C.AUX_HIDDEN][0], np.arange(root_pos), block, root_pos + np.arange(b), topk)
    ((tree, cand),) = block_trees(dr[C.TOPK_IDS], dr[C.TOPK_LOGPROBS], [tokens[root_pos]], [size], topk)
    return tree, cand


def check_dflash_drafts(g: Graphs, prompts_: list, results: list, records: list, tree: dict) -> int:
    """Every recorded drafted tree equals :func:`reference_block`'s for its context; returns how many."""
    full = [list(p) + list(r.token_ids) for p, r in zip(prompts_, results)]
    by_id = sorted({rec.request_id for rec in records})
    checked = 0
    for rec in records:
        seq = full[by_id.index(rec.request_id)]
        want_tree, want = reference_block(g, seq, rec.position, rec.tree.size, tree["topk"])
        assert rec.tokens.tolist() == want.tolist(), (rec.request_id, rec.position)
        assert rec.tree.parents.tolist() == want_tree.parents.tolist()
        checked += 1
    return checked


# ------------------------------------------------------------------------------ sampling stays lossless


@pytest.fixture(scope="module")
def sampling_setup(tmp_path_factory):
    """(decoder, base): test_spec_sampling's 16-token base, a DFlash drafter (block 4, 1 layer) distilled
    on its sampled text, exported."""
    from helpers import torch_threads
    from test_spec_sampling import _base, _distill, _sampled_text

    from exporter.speculative import convert

    root = tmp_path_factory.mktemp("dflash-sampling")
    with torch_threads(1):
        base = _base()
        text = _sampled_text(base, n=96, length=24, seed=1)
        torch.manual_seed(2)
        model = convert(_base(), [("dflash", {"dflash_block_size": 4, "dflash_mask_token_id": 15,
                                              "dflash_target_layer_ids": [0],
                                              "dflash_architecture_config": {"num_hidden_layers": 1}})])
        _distill(model, text, steps=60)
        enable_huggingface_checkpointing()
        model.save_pretrained(root / "model")
        pipeline.export(root / "model", root / "onnx", **QUIET)
    dec = graphs.load(root / "onnx", provider="cpu", threads=1)
    dec.eos = set()  # the tiny vocabulary holds the EOS id: sample it like any other token
    return dec, base


@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
def test_sampling_keeps_the_base_distribution_beside_other_requests(sampling_setup, tree):
    """test_spec_sampling's chi-square test for DFlash: the joint of the first three sampled tokens is the
    base's, with greedy plain and greedy DFlash requests in the same batches."""
    from test_spec_sampling import N_TOKENS, P_MIN, PROMPT, VOCAB, chi_square, exact_joint

    dec, base = sampling_setup
    counts = np.zeros((VOCAB,) * N_TOKENS, dtype=np.int64)
    taus = []
    rng = np.random.default_rng(3)
    for seed in range(6):
        engine = dec.engine(EngineConfig(max_batch=64, prefill_chunk=4))
        reqs = [{"prompt": PROMPT, "max_new_tokens": N_TOKENS, "temperature": 1.0, "seed": seed * 1000 + i,
                 "tree": tree} for i in range(1000)]
        noise = [{"prompt": rng.integers(3, VOCAB, size=5).tolist(), "max_new_tokens": 6,
                  "speculation": ["off", "on"][i % 2]} for i in range(12)]
        for i, r in enumerate(noise):
            reqs.insert(80 * i + 7, r)
        got = _drive(engine, reqs)
        sampled = [g for g, r in zip(got, reqs) if r.get("temperature")]
        toks = np.array([t for t, _ in sampled])  # (1000, 3)
        assert toks.shape == (1000, N_TOKENS)
        np.add.at(counts, tuple(toks.T), 1)
        taus += [st.mean_accepted_length for _, st in sampled[:50]]
    tau = float(np.mean(taus))
    assert tau > 1.05, f"drafts are (almost) never accepted ({tau:.2f}); the test would prove little"
    stat, dof, p = chi_square(counts, exact_joint(base))
    print(f"\ndflash {tree} sampling: chi2 {stat:.1f} dof {dof} p {p:.3g} tau {tau:.2f}")
    assert p > P_MIN


# ------------------------------------------------------------------------------ bench


def test_bench_runs_dflash_chain_and_tree_as_two_systems_and_sweeps_them(dflash_export, tmp_path):
    """exporter.bench on a DFlash export: ours-spec (the manifest's chain) and ours-spec-tree (--also-tree)
    in one run, both held to ours-ar's greedy tokens; --sweep measures DFlash chains and trees."""
    from exporter.bench import BenchOptions, bench

    rep = bench(dflash_export[0], BenchOptions(repeats=2, prompts=2, max_new_tokens=8, threads=1, peers=(),
                                               sweep=True, work=str(tmp_path),
                                               also_trees=(("tree", {"topk": 3, "total_tokens": 8}),)),
                log=lambda *a: None)
    by = {e["name"]: e for e in rep["systems"]}
    assert set(by) == {"ours-ar", "ours-spec", "ours-spec-tree"}
    assert all(e["status"] == "ok" for e in by.values()), {n: e["reason"] for n, e in by.items()}
    rows = {(g["system"], g["reference"]): g for g in rep["greedy"]}
    assert rows[("ours-spec-tree", "ours-ar")]["must_equal"] and rep["greedy_mismatches"] == 0
    sweep = rep["sweep"]
    assert sweep[0]["default"] and sweep[0]["tree"] == {"topk": 1, "total_tokens": 4}
    assert {r["tree"]["topk"] for r in sweep} == {1, 2, 4} and all(r["mean_accepted_length"] >= 1 for r in sweep)


def test_bench_also_tree_flag_is_parsed_and_checked(tmp_path):
    from exporter.bench import BenchOptions, _also_trees
    from exporter.loading import UserError

    (tmp_path / "t.json").write_text('{"topk": 4, "total_tokens": 16}')
    assert _also_trees(['t4={"topk": 4, "total_tokens": 16}', f"f={tmp_path / 't.json'}"]) == (
        ("t4", {"topk": 4, "total_tokens": 16}), ("f", {"topk": 4, "total_tokens": 16}))
    with pytest.raises(UserError, match="neither JSON nor a JSON file"):
        _also_trees(["x=nope"])
    with pytest.raises(UserError, match="ours-spec-NAME"):
        BenchOptions(also_trees=(("a b", {}),))


# ------------------------------------------------------------------------------ tune


def test_tune_chooses_dflash_chain_or_tree_by_measurement(dflash_export, tmp_path):
    """exporter.tune on a DFlash export: the chain and top-k trees measured (every node verified, a cut
    per size), the fastest predicted one confirmed and written as the manifest's tree.dflash."""
    import json

    from exporter.tune import tune

    out = tmp_path / "out"
    shutil.copytree(dflash_export[0], out)
    texts = ["".join(chr(40 + t % 80) for t in p) for p in prompts(2)]
    report = tune(out, prompts=texts, threads=1, max_new_tokens=12, log=lambda *a, **k: None)
    m = json.loads((out / "manifest.json").read_text())
    assert m["tree"]["dflash"] == report["tree"] and set(report["tree"]) == {"topk", "total_tokens"}
    cands = report["candidates"]
    assert {c["topk"] for c in cands} == {1, 2, 3, 4}
    assert max(c["total_tokens"] for c in cands if c["topk"] == 1) == 4  # the chain: the block at most
    assert report["best"]["predicted_tokens_per_s"] == max(c["predicted_tokens_per_s"] for c in cands)
    assert m["tree"]["tuned"]["measured_tokens_per_s"] > 0
    dec = graphs.load(out, provider="cpu", threads=1)
    assert dec.requests.dflash_tree(None) == report["tree"]
