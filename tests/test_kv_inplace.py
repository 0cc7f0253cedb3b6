"""K/V written in place (exporter.passes.kv_inplace, graphs.sessions.InPlaceRun, the caches' commit).

The optimized base writes each row's new K/V into the caller's buffer at that row's own column
instead of concatenating the cache in every layer. Against the same fused graph with the traced
concatenation kept (``kv_in_place=False``): non-causal trees, a batch whose rows have different
lengths (so different write columns) and garbage in every column a row may not see; the written
rows must be the concat graph's new K/V and nothing else in the buffers may change. Then the caches'
in-place commit against the copy-in commit, and the pass's refusal of a graph it does not know.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from exporter.loading import UserError
from exporter.optimize import optimize_export
from graphs import contract as C
from graphs.manifest import Manifest, sha256_file
from graphs.sessions import InPlaceRun, make_session
from graphs.slots import SlotCache

QUIET = dict(progress=None, time_gain=False, tune=False)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(exported, tmp_path_factory):
    """(in-place export, concat export, in-place export in the compact 3-D "bsh" layout) of the tiny
    Medusa model, otherwise the same passes."""
    outs = []
    for name, opts in (("in-place", {}), ("concat", {"kv_in_place": False}), ("bsh", {"kv_layout": "bsh"})):
        out = tmp_path_factory.mktemp(f"kv-{name}") / "out"
        shutil.copytree(exported("medusa"), out)
        optimize_export(out, **opts, **QUIET)
        outs.append(out)
    return outs


def src_kv_width(m) -> int:
    return m.source["num_kv_heads"] * m.source["head_dim"]


def _tree(rng, s: int) -> np.ndarray:
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, s)]
    m = np.zeros((s, s), dtype=bool)
    for i in range(s):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def test_the_pass_and_the_contract(pair):
    ip, cat, bsh = pair
    m, mc = Manifest.read(ip), Manifest.read(cat)
    spec = m.graphs["base"]
    assert C.kv_in_place(spec) and not C.kv_in_place(mc.graphs["base"])
    assert spec.inputs[-1].name == C.KV_WRITE and spec.input(C.ATTENTION_MASK).dims[-1] == C.PAST
    assert spec.output(C.present_key(0)).dims == spec.input(C.past_key(0)).dims  # the buffer itself
    assert m.optimization["base"]["passes"][-1] == "kv" and "kv" not in mc.optimization["base"]["passes"]
    ops = [n.op_type for n in onnx.load(str(ip / "base.onnx"), load_external_data=False).graph.node]
    layers = m.source["num_layers"]
    assert ops.count("TensorScatter") == 2 * layers
    cat_ops = [n.op_type for n in onnx.load(str(cat / "base.onnx"), load_external_data=False).graph.node]
    assert cat_ops.count("Concat") - ops.count("Concat") >= 2 * layers  # every past+new concatenation gone
    # the default 4-D layout: q/k/v one MatMul, their heads split once, the output's heads merged
    kvh, hd = m.source["num_kv_heads"], m.source["head_dim"]
    assert m.optimization["base"]["fused"]["kv_layout"] == "bhsd" and C.kv_layout(spec) == "bhsd"
    assert ops.count("Transpose") == ops.count("Reshape") == 2 * layers and ops.count("Split") == layers
    assert ops.count("MatMul") == cat_ops.count("MatMul") - 2 * layers
    assert spec.input(C.past_key(0)).dims == (C.BATCH, kvh, C.PAST, hd)
    assert not C.kv_in_place(m.graphs["draft"])  # the Medusa heads have no K/V
    # the compact 3-D layout: no head split/merge around attention at all
    mb = Manifest.read(bsh)
    ops = [n.op_type for n in onnx.load(str(bsh / "base.onnx"), load_external_data=False).graph.node]
    assert mb.optimization["base"]["fused"]["kv_layout"] == "bsh" and "Transpose" not in ops and "Reshape" not in ops
    assert ops.count("Split") == layers and ops.count("TensorScatter") == 2 * layers
    assert mb.graphs["base"].input(C.past_key(0)).dims == (C.BATCH, C.PAST, src_kv_width(m))


@pytest.mark.parametrize(("seed", "layout"), [(0, "bhsd"), (1, "bhsd"), (0, "bsh")])
def test_in_place_equals_concat_on_trees_with_rows_of_different_lengths(pair, seed, layout):
    ip, cat = pair[0] if layout == "bhsd" else pair[2], pair[1]
    m = Manifest.read(ip)
    src = m.source
    layers, kvh, hd, vocab = src["num_layers"], src["num_kv_heads"], src["head_dim"], src["vocab_size"]
    rng = np.random.default_rng(seed)
    lens = np.array([5, 9, 2])  # each row's committed columns
    bsz, s, cap = len(lens), 4, 16
    ids = rng.integers(0, vocab, (bsz, s))
    trees = np.stack([_tree(rng, s) for _ in range(bsz)])
    depth = trees.sum(-1) - 1
    pos = lens[:, None] + depth
    # the in-place buffers: real past in [0, lens), garbage everywhere else (old rejected rows)
    bufs = [rng.standard_normal((bsz, kvh, cap, hd)).astype(np.float32) for _ in range(2 * layers)]
    before = [b.copy() for b in bufs]
    mask = np.zeros((bsz, 1, s, cap), dtype=bool)
    for b in range(bsz):
        mask[b, 0, :, : lens[b]] = True
        mask[b, 0, :, lens[b] : lens[b] + s] = trees[b]
    names = [n for i in range(layers) for n in (C.past_key(i), C.past_value(i))]
    assert C.kv_layout(m.graphs["base"]) == layout
    if layout == "bsh":
        graph_bufs = [np.ascontiguousarray(b.transpose(0, 2, 1, 3).reshape(bsz, cap, kvh * hd)) for b in bufs]
    else:
        graph_bufs = [b.copy() for b in bufs]
    run = InPlaceRun(make_session(ip / "base.onnx", "cpu", 1), m.graphs["base"])
    got = run.run({C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: mask, C.KV_WRITE: lens},
                  dict(zip(names, graph_bufs)))
    # what the graph wrote, as (B, kv, cap, hd)
    bufs = [g.reshape(bsz, cap, kvh, hd).transpose(0, 2, 1, 3) for g in graph_bufs] if layout == "bsh" else graph_bufs
    # the concat graph: the same pasts padded to the longest row, holes masked
    p = int(lens.max())
    cmask = np.zeros((bsz, 1, s, p + s), dtype=bool)
    for b in range(bsz):
        cmask[b, 0, :, : lens[b]] = True
        cmask[b, 0, :, p:] = trees[b]
    spec_c = Manifest.read(cat).graphs["base"]
    sess = make_session(cat / "base.onnx", "cpu", 1)
    feed = {C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: cmask}
    feed |= {n: before[j][:, :, :p] for j, n in enumerate(names)}
    want = dict(zip(spec_c.output_names, sess.run(spec_c.output_names, feed)))
    np.testing.assert_allclose(got[C.LOGITS], want[C.LOGITS], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got[C.HIDDEN], want[C.HIDDEN], atol=2e-5, rtol=1e-5)
    assert C.present_key(0) not in got  # the presents are the buffers themselves
    for j, n in enumerate(names):
        present = want["present." + n[len("past_key_values."):]]  # (B, kv, S, hd)
        for b in range(bsz):
            w = slice(lens[b], lens[b] + s)
            np.testing.assert_allclose(bufs[j][b, :, w], present[b], atol=2e-5, rtol=1e-5)
            outside = np.ones(cap, dtype=bool)
            outside[w] = False
            assert np.array_equal(bufs[j][b, :, outside], before[j][b, :, outside]), f"{n} row {b}: wrote outside"


@pytest.mark.parametrize(("one_row", "layout"), [(False, "bhsd"), (True, "bhsd"), (True, "bsh")])
def test_slot_cache_commit_in_place_equals_copy_in(one_row, layout):
    """The in-place compaction (every layer in one move; a row alone as Python lists) against the
    copy-in commit: a tree path, a chain prefix, a jump back."""
    rng = np.random.default_rng(3)
    layers, slots, kvh, hd, s = 2, 3, 2, 4, 5
    a = SlotCache(layers, slots, kvh, hd, np.float32, max_len=32, headroom=8, layout=layout)
    b = SlotCache(layers, slots, kvh, hd, np.float32, max_len=32, headroom=8, layout=layout)
    for c in (a, b):
        for _ in range(slots):
            c.add_row()
        c.reserve(16)
        c.lens[:slots] = [3, 7, 0]
    for c in (a, b):
        for bufs in (c.keys, c.values):
            for i in range(layers):
                bufs[i][:] = np.arange(bufs[i].size, dtype=np.float32).reshape(bufs[i].shape)
    presents = [rng.standard_normal((slots, kvh, s, hd)).astype(np.float32) for _ in range(2 * layers)]
    # what the in-place graph did: each row's S new rows written at its length
    starts = a.write_columns()
    for j, buf in enumerate(x for i in range(layers) for x in (a.keys[i], a.values[i])):
        for r in range(slots):
            buf[r, :, starts[r] : starts[r] + s] = presents[j][r]
    idx = np.array([[0, 2, 4], [0, 1, 0], [0, 3, 0]])  # a tree path, a chain prefix, a jump
    counts = np.array([3, 2, 2])
    if one_row:  # each row committed alone (first=r), as a request alone in its engine is
        for r in range(slots):
            a.commit(None, idx[r : r + 1], counts[r : r + 1], first=r)
    else:
        a.commit(None, idx, counts)
    b.commit(presents, idx, counts)
    assert np.array_equal(a.lens, b.lens)
    for i in range(layers):
        for r in range(slots):
            n = int(a.lens[r])  # columns past a row's length are free (garbage) in both layouts
            assert np.array_equal(a.keys[i][r, :, :n], b.keys[i][r, :, :n])
            assert np.array_equal(a.values[i][r, :, :n], b.values[i][r, :, :n])


def test_a_graph_without_the_traced_concatenation_is_refused(exported, tmp_path):
    """Another exporter's graph (the past not concatenated with the new rows as traced): a one-line
    error naming --no-kv-in-place, the export untouched."""
    out = tmp_path / "out"
    shutil.copytree(exported("medusa"), out)
    proto = onnx.load(str(out / "base.onnx"))
    for node in proto.graph.node:  # Concat(past, new) -> Concat(new, past): not the traced pattern
        if node.op_type == "Concat" and node.input and node.input[0] == C.past_key(0):
            node.input[0], node.input[1] = node.input[1], node.input[0]
    onnx.save(proto, str(out / "base.onnx"))
    mf = json.loads((out / "manifest.json").read_text())
    mf["files"]["base.onnx"] = sha256_file(out / "base.onnx")
    (out / "manifest.json").write_text(json.dumps(mf))
    before = (out / "base.onnx").read_bytes()
    with pytest.raises(UserError, match="--no-kv-in-place"):
        optimize_export(out, **QUIET)
    assert (out / "base.onnx").read_bytes() == before
    assert not Manifest.read(out).optimization


def test_kv_in_place_on_both_targets():
    """In place by default on CPU and CUDA too (the device path binds its K/V buffers; CUDA's
    TensorScatter since ONNX Runtime PR #27446; the GroupQueryAttention form needs it);
    --no-kv-in-place keeps the traced concatenation on either."""
    from exporter.optimizing import OptimizeOptions

    assert OptimizeOptions().writes_kv_in_place and OptimizeOptions(target="cuda").writes_kv_in_place
    assert not OptimizeOptions(target="cuda", kv_in_place=False).writes_kv_in_place


@pytest.mark.parametrize(("model_type", "kind", "layout"), [("qwen3", "medusa", "bhsd"), ("qwen2", "eagle3", "bhsd"),
                                                       ("qwen2", "medusa", "bsh")])
def test_other_architectures_pick_their_layout_and_stay_exact(tiny_model_dir, exported, tmp_path, model_type, kind,
                                                              layout):
    """Qwen3's per-head q/k norms sit between the head split and the rotary: the 4-D in-place form
    (only the concatenations replaced). Qwen2's q/k/v biases: the compact form without the QKV fusion
    (in either layout). All match PyTorch on compare's cases, and speculative == autoregressive for a
    batch of prompts of different lengths on them."""
    import graphs
    from exporter.loading import load_model
    from exporter.validate import compare_model

    out = tmp_path / "out"
    shutil.copytree(exported(kind, model_type), out)
    optimize_export(out, kv_layout=layout, **QUIET)
    m = Manifest.read(out)
    assert C.kv_in_place(m.graphs["base"]) and C.kv_layout(m.graphs["base"]) == layout
    assert m.optimization["base"]["fused"]["kv_layout"] == layout
    ops = [n.op_type for n in onnx.load(str(out / "base.onnx"), load_external_data=False).graph.node]
    assert ops.count("TensorScatter") == 2 * m.source["num_layers"]
    if model_type == "qwen2":
        assert "Split" not in ops  # biased projections are left alone
    report = compare_model(load_model(tiny_model_dir(kind, model_type)), out)
    assert report.ok, report.table()
    # the one-sequence graph where the layers are the compact form (Qwen2's q, k, v unpacked into it),
    # compared with PyTorch as the base is, on the cases it takes
    one = m.optimization["base"].get("one_sequence")
    assert (one is not None) == (model_type == "qwen2" and layout == "bhsd")
    one_rows = [r for r in report.rows if r.case.endswith("(base.gqa.onnx)")]
    assert bool(one_rows) == (one is not None) and all(r.ok for r in one_rows)
    if one:
        assert {r.case.split(" ")[0] for r in one_rows} >= {"prefill", "decode", "tree_b2_past6[0]", "batch2_holes[1]"}
    dec = graphs.load(out, provider="cpu", threads=1)
    prompts = [[5, 9, 3], [7, 1, 4, 4, 2, 8, 6, 2, 9], [11]]
    ar = dec.generate(prompts, max_new_tokens=16, mode="autoregressive")
    sp = dec.generate(prompts, max_new_tokens=16, mode="speculative")
    assert [r.token_ids for r in sp] == [r.token_ids for r in ar]


def test_the_optimized_base_is_about_the_size_of_genais(pair, tmp_path):
    """ORT nodes after session optimization (what a call runs): onnxruntime-genai's builder writes 11
    per layer for a Llama (+ 3 in all). The one-sequence graph (each layer's attention one
    GroupQueryAttention, as genai's) that one-token steps and one sequence's trees run is within 1.5x
    of that (measured 74 vs 69 on the 19M model), and so is the compact 3-D form (96); the default
    4-D base that batches of trees run splits and merges heads around attention, 4 nodes a layer more
    (120 vs 69: 1.74x), for the faster ONNX Attention per cached token (docs/benchmarks.md).
    A regression guard on node counts."""
    import onnxruntime as ort

    ip, cat, bsh = pair
    layers = Manifest.read(ip).source["num_layers"]
    counts = {}
    for name, path in (("in_place", ip / "base.onnx"), ("concat", cat / "base.onnx"), ("bsh", bsh / "base.onnx"),
                       ("one_sequence", ip / "base.gqa.onnx")):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        counts[name] = len(onnx.load(so.optimized_model_filepath, load_external_data=False).graph.node)
    genai = 11 * layers + 3
    assert counts["one_sequence"] <= 1.5 * genai and counts["bsh"] <= 1.5 * genai, counts
    assert counts["in_place"] == counts["bsh"] + 4 * layers, counts
    # 10 ops a layer -> 1, and the per-row lengths computed once (at most 10 ops)
    assert counts["one_sequence"] <= counts["in_place"] - 9 * layers + 10, counts
    assert counts["concat"] > 2 * counts["bsh"]  # the shape plumbing the compact form removed


def _garbage_buffers(rng, names, bsz, kvh, cap, hd):
    return {n: rng.standard_normal((bsz, kvh, cap, hd)).astype(np.float32) for n in names}


@pytest.mark.parametrize("seed", [0, 1])
def test_the_one_sequence_graph_computes_what_the_base_computes_for_the_calls_it_takes(pair, seed):
    """base.gqa.onnx (exporter.passes.kv_inplace.group_query_graph) against the in-place base on the
    same buffers, garbage in every column a row may not see: one token per row of a batch whose rows
    have different lengths, one sequence's non-causal tree after a past with holes, a causal
    prefill; also with buffers wider than the model's positions (the cache's headroom), near the end
    of the context. Same logits and hidden states, the same rows written at the same columns, nothing else
    in the buffers changed."""
    ip = pair[0]
    m = Manifest.read(ip)
    one = m.optimization["base"]["one_sequence"]
    assert one["file"] == "base.gqa.onnx" and one["file"] in m.files and "vs_base_max_abs" in one
    layers, kvh, hd, vocab = (m.source[k] for k in ("num_layers", "num_kv_heads", "head_dim", "vocab_size"))
    ops = [n.op_type for n in onnx.load(str(ip / one["file"]), load_external_data=False).graph.node]
    assert ops.count("GroupQueryAttention") == layers and "Attention" not in ops and "TensorScatter" not in ops
    spec = m.graphs["base"]
    runs = {f: InPlaceRun(make_session(ip / f, "cpu", 1), spec) for f in ("base.onnx", one["file"])}
    names = [n for i in range(layers) for n in (C.past_key(i), C.past_value(i))]
    rng = np.random.default_rng(seed)
    wide = m.source["max_position_embeddings"] + 40  # a buffer wider than the rotary tables (cache headroom)
    for lens, s, tree, cap in (([5, 9, 2], 1, None, 24), ([7], 5, _tree(rng, 5), 24),
                               ([0], 5, np.tri(5, dtype=bool), 24), ([11], 1, None, 24),
                               ([500, 3], 1, None, wide), ([490], 5, _tree(rng, 5), wide)):
        lens = np.array(lens)
        bsz = len(lens)
        tree = np.ones((1, 1), bool) if tree is None else tree
        ids = rng.integers(0, vocab, (bsz, s))
        pos = lens[:, None] + (tree.sum(-1) - 1)[None]
        mask = np.zeros((bsz, 1, s, cap), dtype=bool)
        for b in range(bsz):
            mask[b, 0, :, : lens[b]] = rng.random(lens[b]) > (0.3 if s > 1 else 0.0)  # holes in a tree's past
            mask[b, 0, :, lens[b] : lens[b] + s] = tree
        before = _garbage_buffers(rng, names, bsz, kvh, cap, hd)
        got = {}
        for f, run in runs.items():
            bufs = {n: b.copy() for n, b in before.items()}
            feed = {C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.ATTENTION_MASK: mask, C.KV_WRITE: lens}
            got[f] = run.run(feed, bufs), bufs
        (want, wbufs), (have, hbufs) = got["base.onnx"], got[one["file"]]
        for out in (C.LOGITS, C.HIDDEN):
            np.testing.assert_allclose(have[out], want[out], atol=2e-5, rtol=1e-5, err_msg=f"{out} lens {lens} S {s}")
        for n in names:
            np.testing.assert_allclose(hbufs[n], wbufs[n], atol=2e-5, rtol=1e-5, err_msg=n)
            for b in range(bsz):
                outside = np.ones(cap, dtype=bool)
                outside[lens[b] : lens[b] + s] = False
                assert np.array_equal(hbufs[n][b, :, outside], before[n][b, :, outside]), f"{n} row {b}"


def test_the_runtime_runs_the_one_sequence_graph_where_its_kernel_can_and_the_base_elsewhere(pair):
    """Which graph each base call runs, as the engine decodes a batch whose requests arrive and leave
    at different steps: one-token calls and one sequence's calls on the one-sequence graph, batches
    of trees on the base (GroupQueryAttention's CPU kernel refuses them); the output is the greedy
    autoregressive output. Exports without the graph (the 3-D layout, K/V concatenated) run the base."""
    import graphs
    from graphs.engine import EngineConfig

    dec = graphs.load(pair[0], provider="cpu", threads=1, adaptive=False)
    # one sequence at a time never needs the base: its session (its weights) is made when a batch of
    # trees first comes
    one = dec.generate([5, 9, 3], max_new_tokens=12, mode="speculative")
    assert not dec.base.loaded
    assert one.token_ids == dec.generate([5, 9, 3], max_new_tokens=12, mode="autoregressive").token_ids
    calls = []
    for name, run in (("one", dec._one_sequence), ("base", dec._in_place)):
        inner, inner_bound = run.run_on, run.bound_on

        def record(kv, feed, rows=None, name=name, inner=inner):
            calls.append((name, *feed[C.INPUT_IDS].shape))
            return inner(kv, feed, rows)

        def record_bound(kv, s, name=name, inner=inner_bound):  # a decode step's call, bound once
            calls.append((name, kv.n, s))
            return inner(kv, s)

        run.run_on, run.bound_on = record, record_bound
    prompts = [[5, 9, 3], [7, 1, 4, 4, 2, 8, 6, 2, 9], [11], [3, 3, 8, 1, 2]]
    engine = dec.engine(EngineConfig(max_batch=3))
    got: dict[int, list[int]] = {}
    for step in range(200):
        if step < len(prompts):
            got[engine.add_request(prompts[step], max_new_tokens=14 + 3 * step)] = []
        for ev in engine.step():
            got[ev.request_id] += ev.token_ids
        if not engine.has_pending_requests():
            break
    assert all(b == 1 or s == 1 for g, b, s in calls if g == "one"), calls
    assert all(b > 1 and s > 1 for g, b, s in calls if g == "base"), calls
    assert {g for g, _, _ in calls} == {"one", "base"} and dec.base.loaded
    assert any(g == "one" and b == 1 and s > 1 for g, b, s in calls)  # a tree (or a prefill) of one sequence
    ar = dec.generate(prompts, max_new_tokens=14, mode="autoregressive")
    assert [t[:14] for t in got.values()] == [r.token_ids for r in ar]
    eager = graphs.load(pair[0], provider="cpu", threads=1)
    eager.load_sessions()  # what the server does at start when it may batch
    assert eager.base.loaded
    for out in pair[1:]:
        assert "one_sequence" not in Manifest.read(out).optimization["base"]
        assert graphs.load(out, provider="cpu", threads=1)._one_sequence is None


def test_decoding_runs_to_the_end_of_the_context(pair):
    """Near max_position_embeddings a tree's columns pass the model's positions (its nodes are wider
    than deep): the one-sequence graph takes calls up to its recorded width and the base the rest;
    speculative == autoregressive up to the last position."""
    import graphs

    dec = graphs.load(pair[0], provider="cpu", threads=1, adaptive=False)
    limit = dec.max_positions
    assert dec.manifest.optimization["base"]["one_sequence"]["max_columns"] > limit
    prompt = [int(x) for x in np.random.default_rng(3).integers(3, 200, limit - 30)]
    ar = dec.generate(prompt, max_new_tokens=29, mode="autoregressive")
    sp = dec.generate(prompt, max_new_tokens=29, mode="speculative")
    assert sp.token_ids == ar.token_ids and ar.finish_reason == sp.finish_reason
    assert ar.finish_reason == "eos" or len(prompt) + len(ar.token_ids) >= limit - 1, ar.finish_reason


@pytest.mark.parametrize(("quantize", "scale", "why"),
                         [("none", 0.05, "differs from the raw trace"),
                          ("int4", 50.0, "more than twice the quantized base's distance")])
def test_a_one_sequence_graph_that_fails_the_gate_is_dropped_and_the_base_kept(exported, tmp_path, monkeypatch,
                                                                               quantize, scale, why):
    """A one-sequence graph that computes something else (here its attention scale wrong) is removed
    with a line saying why; the optimized export is the base alone and decodes as before. int4 at
    level 4 gates nothing on its distance from the base (another kernel is another rounding), so it is
    held to the float trace: no further from it than twice the quantized base on the same calls. That
    catches gross errors only: on this tiny random model a scale of 0.05 (for 0.25) moves its logits by
    1e-2, inside int4's 0.13 from the float trace, and passes there (the float32 case catches it)."""
    import graphs
    from exporter.passes import kv_inplace

    real = kv_inplace.group_query_graph

    def wrong(*args):
        proto, columns = real(*args)
        for n in proto.graph.node:
            if n.op_type == "GroupQueryAttention":
                kept = [a for a in n.attribute if a.name != "scale"]
                del n.attribute[:]
                n.attribute.extend([*kept, onnx.helper.make_attribute("scale", scale)])
        return proto, columns

    monkeypatch.setattr(kv_inplace, "group_query_graph", wrong)
    out = tmp_path / "out"
    shutil.copytree(exported("medusa"), out)
    lines = []
    optimize_export(out, quantize=quantize, progress=lambda *a, **k: lines.append(" ".join(map(str, a))),
                    time_gain=False, tune=False)
    m = Manifest.read(out)
    assert "one_sequence" not in m.optimization["base"] and not (out / "base.gqa.onnx").exists()
    assert "base.gqa.onnx" not in m.files
    assert any("one-seq   dropped" in x and why in x for x in lines), lines
    assert m.validation["optimize"]["one_sequence"]["dropped"]
    dec = graphs.load(out, provider="cpu", threads=1)
    assert dec._one_sequence is None
    assert dec.generate([5, 9, 3], max_new_tokens=8, mode="speculative").token_ids == \
        dec.generate([5, 9, 3], max_new_tokens=8, mode="autoregressive").token_ids


@pytest.fixture(scope="module")
def eagle_pair(exported, tmp_path_factory):
    """(in-place export, concat export) of the tiny EAGLE-1 model: the drafter's graphs (step-wise and
    the one-call tree) write their own K/V in place too, otherwise the same passes."""
    outs = []
    for in_place in (True, False):
        out = tmp_path_factory.mktemp(f"kv-eagle-{in_place}") / "out"
        shutil.copytree(exported("eagle"), out)
        optimize_export(out, kv_in_place=in_place, **QUIET)
        outs.append(out)
    return outs


@pytest.mark.parametrize("draft", ["stepwise", "one_call"])
def test_the_drafter_writes_its_k_v_in_place_and_drafts_the_same_trees(eagle_pair, draft):
    """Every drafter graph with K/V (draft.onnx, draft_tree.*) takes its cache as buffers it writes
    in place; the engine, with requests arriving at different steps (rows of different lengths,
    rows moved when one leaves), proposes exactly the trees the concatenating drafter proposes, and
    the output is the base's greedy output."""
    import graphs

    m = Manifest.read(eagle_pair[0])
    drafters = [r for r in m.graphs if r != "base" and any(t.name.startswith("past_key_values.")
                                                           for t in m.graphs[r].inputs)]
    assert "draft" in drafters and any(r.startswith("draft_tree") for r in drafters)
    for role in drafters:
        spec = m.graphs[role]
        assert C.kv_in_place(spec) and C.kv_layout(spec) == "bhsd", role
        ops = [n.op_type for n in onnx.load(str(eagle_pair[0] / spec.file), load_external_data=False).graph.node]
        assert ops.count("TensorScatter") == 2 * m.drafter["num_layers"], role
        assert "kv" in m.optimization[role]["passes"] or m.optimization[role]["fused"].get("kv_layout") == "bhsd"
    assert not C.kv_in_place(Manifest.read(eagle_pair[1]).graphs["draft"])
    prompts = [[5, 9, 3], [7, 1, 4, 4, 2, 8, 6, 2, 9], [11], [3, 3, 8, 1, 2]]
    runs = []
    for out in eagle_pair:
        dec = graphs.load(out, provider="cpu", threads=1, eagle_draft=draft, adaptive=False)
        from graphs.engine import EngineConfig

        engine = dec.engine(EngineConfig(max_batch=3))
        with dec.watch_verify() as records:
            got: dict[int, list[int]] = {}
            for step in range(200):
                if step < len(prompts):  # one arrival per step; the 4th waits for a free row
                    got[engine.add_request(prompts[step], max_new_tokens=14 + 3 * step)] = []
                for ev in engine.step():
                    got[ev.request_id] += ev.token_ids
                if not engine.has_pending_requests():
                    break
        tokens = list(got.values())
        trees = [(r.request_id, r.tokens.tolist(), r.accepted) for r in records]
        runs.append((tokens, trees))
        ar = dec.generate(prompts, max_new_tokens=14, mode="autoregressive")
        assert [t[:14] for t in tokens] == [r.token_ids for r in ar]
    assert runs[0] == runs[1]
    drafted = [t for _, t, _ in runs[0][1] if len(t) > 1]
    assert len(drafted) > 20 and len({tuple(t) for t in drafted}) > 10  # the drafter ran, on varied contexts


def test_the_graph_against_graph_bench_runs_our_graphs_as_it_says(pair):
    """samples/bench_graphs.py's step of ours (docs/benchmarks.md, "graph against graph"): the one-sequence
    graph and the base each run a bound one-token step, and an export without the one-sequence graph
    is told so (not silently timed on the base)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_graphs", REPO / "samples" / "bench_graphs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ip, cat, _ = pair
    for graph, name in (("one-sequence", "base.gqa.onnx"), ("base", "base.onnx")):
        step, path = bench.ours(ip, graph, past=8, threads=1, rng=np.random.default_rng(0))
        step()
        assert path == ip / name
    with pytest.raises(SystemExit, match="no one-sequence graph"):
        bench.ours(cat, "one-sequence", past=8, threads=1, rng=np.random.default_rng(0))
