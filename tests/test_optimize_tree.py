"""The one-call EAGLE tree graphs (``draft_tree.*``) through export and the optimize stage.

Export folds their shape plumbing (exporter.eagle_tree.simplify_traced) without changing the tree;
optimize gives them the draft graph's fusions (the same tree as the raw graph at float32), quantizes
their weights (speculative == autoregressive through the one-call path) and converts them to float16
for CUDA with the manifest's I/O, instead of leaving them raw or dropping them.
"""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from helpers import assert_greedy_within_bound

import graphs
from exporter.optimize import optimize_export
from exporter.passes import graphio
from exporter.passes.parity import TREE_CASES, tree_parity
from graphs import contract as C
from graphs.manifest import Manifest

QUIET = dict(progress=None, time_gain=False)
ROLE = C.eagle_tree_role(2, 3, 6)  # the tree every export bakes by default
CALLS = 1 + 3  # drafter forwards unrolled in it: the context rows, then one per level
PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2, 8], [11]]


@pytest.fixture(scope="module")
def optimized(exported, tmp_path_factory):
    """``optimized(kind, quantize="none", target="cpu") -> Path``: the tiny export, optimized (cached)."""
    cache = {}

    def make(kind="eagle", quantize="none", target="cpu"):
        key = (kind, quantize, target)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"optree-{kind}-{quantize}-{target}") / "out"
            shutil.copytree(exported(kind), out)
            optimize_export(out, target=target, quantize=quantize, **QUIET)
            cache[key] = out
        return cache[key]

    return make


def _ops(path) -> dict[str, int]:
    return graphio.count_ops(onnx.load(str(path), load_external_data=False))


# ----------------------------------------------------------------------------- export: bake-time folding


def test_export_folds_the_tree_graphs_shape_plumbing(exported, tiny_model_dir, tmp_path, monkeypatch):
    """The baked graph against the same trace without simplify_traced: far fewer nodes, the same tree."""
    import exporter.eagle_tree as et
    from exporter.loading import load_model
    from exporter.trace import export_graph

    out = exported("eagle")
    m = Manifest.read(out)
    spec = m.graphs[ROLE]
    monkeypatch.setattr(et, "simplify_traced", lambda proto, _dir: proto)
    raw = export_graph(load_model(tiny_model_dir("eagle")), ROLE, spec, tmp_path / "raw.onnx")
    baked, traced = _ops(out / spec.file), _ops(raw)
    assert sum(baked.values()) < 0.6 * sum(traced.values()), (sum(baked.values()), sum(traced.values()))
    assert baked.get("Shape", 0) < traced["Shape"] / 2
    rows = tree_parity(raw, out / spec.file, spec, spec, 1e-6, 1e-6, vocab=m.source["vocab_size"])
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]


# ----------------------------------------------------------------------------- optimize: fusions


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_tree_graphs_get_the_draft_graphs_fusions(exported, optimized, kind):
    """Every unrolled drafter forward is fused as the draft graph is; the tree is the raw graph's."""
    raw, out = exported(kind), optimized(kind)
    m = Manifest.read(out)  # every file rehashed: verify=True passes
    assert ROLE in m.graphs and any(e["graph"] == ROLE for e in m.tree["eagle_trees"])
    draft, tree = _ops(out / m.graphs["draft"].file), _ops(out / m.graphs[ROLE].file)
    assert draft.get("Attention", 0) == m.drafter["num_layers"]
    for op in ("Attention", "RotaryEmbedding"):
        assert tree.get(op, 0) == CALLS * draft.get(op, 0), op

    def norms(ops):
        return ops.get("SimplifiedLayerNormalization", 0) + ops.get("SkipSimplifiedLayerNormalization", 0)

    # every norm fused (EAGLE-3's final norm reads the root row alone in the context call: no Skip there)
    assert norms(tree) == CALLS * norms(draft) > 0 and "ReduceMean" not in tree
    skip = "SkipSimplifiedLayerNormalization"
    assert tree.get(skip, 0) >= (CALLS - 1) * draft.get(skip, 0)
    assert "Softmax" not in tree and "GroupQueryAttention" not in tree and "MultiHeadAttention" not in tree
    assert sum(tree.values()) < sum(_ops(raw / m.graphs[ROLE].file).values())
    rec = m.optimization[ROLE]
    assert rec["passes"] == m.optimization["draft"]["passes"] and rec["dtype"] == "float32"
    assert rec["fused"]["Attention"] == CALLS * m.drafter["num_layers"] and rec["quantization"] is None
    assert m.validation["optimize"]["graphs"][ROLE]["ok"]
    # independent of the stage's own gate: the same tree, scores and drafter K/V within 1e-4
    spec, raw_spec = m.graphs[ROLE], Manifest.read(raw).graphs[ROLE]
    assert C.kv_in_place(spec) and C.kv_layout(spec) == "bhsd"  # the drafter's K/V written in place too
    rows = tree_parity(raw / spec.file, out / spec.file, raw_spec, spec, 1e-4, 1e-4, vocab=m.source["vocab_size"])
    assert {r.case for r in rows} == {c.name for c in TREE_CASES}
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]
    assert all(r.top1 == 1.0 for r in rows if r.output == C.TREE_TOKENS)


def test_fused_one_call_decoding_equals_autoregressive(optimized):
    out = optimized("eagle3")
    dec = graphs.load(out, provider="cpu", threads=1, eagle_draft="one_call", adaptive=False)
    ar = dec.generate(PROMPTS, max_new_tokens=16, mode="autoregressive")
    sp = dec.generate(PROMPTS, max_new_tokens=16)
    assert [r.token_ids for r in sp] == [r.token_ids for r in ar]
    assert sp[0].stats.draft_calls == sp[0].stats.steps > 0


# ----------------------------------------------------------------------------- optimize: quantized


@pytest.mark.parametrize("quantize", ["int4", "int8"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_quantized_tree_graph_one_call_equals_autoregressive(exported, optimized, kind, quantize):
    out = optimized(kind, quantize)
    m = Manifest.read(out)
    rec = m.optimization[ROLE]
    assert rec["quantization"]["bits"] == {"int4": 4, "int8": 8}[quantize]
    proto = onnx.load(str(out / m.graphs[ROLE].file))
    inits = [t.name for t in proto.graph.initializer]
    assert len(inits) == len(set(inits))  # one copy of each weight, though each is read CALLS times
    ops = graphio.count_ops(proto)
    per_call = m.optimization["draft"]["quantization"]["matmuls"]
    fc_once = CALLS - 1 if kind == "eagle3" else 0  # EAGLE-3's fc reads the base's layers: context call only
    assert ops.get("MatMulNBits") == rec["quantization"]["matmuls"] == CALLS * per_call - fc_once
    assert all(n.input[1] not in inits for n in proto.graph.node if n.op_type == "MatMul")  # lm_head included
    # the gate can fail: held to the float32 tree strictly, the quantized drafter's scores differ
    spec, raw_spec = m.graphs[ROLE], Manifest.read(exported(kind)).graphs[ROLE]
    rows = tree_parity(exported(kind) / spec.file, out / spec.file, raw_spec, spec, 1e-4, 1e-4,
                       vocab=m.source["vocab_size"])
    assert any(not r.ok for r in rows if r.output == C.TREE_SCORES)
    dec = graphs.load(out, provider="cpu", threads=1, eagle_draft="one_call", adaptive=False)
    ar = dec.generate(PROMPTS, max_new_tokens=20, mode="autoregressive")
    sp = dec.generate(PROMPTS, max_new_tokens=20)
    for p, a, b in zip(PROMPTS, ar, sp):  # the measured contract of int8 activations (equal but for near-ties)
        assert_greedy_within_bound(dec, p, a.token_ids, b.token_ids, m.optimization["base"]["rows_max_abs"])
    assert sp[0].stats.draft_calls == sp[0].stats.steps > 0  # one drafter call per step: the tree graph ran


# ----------------------------------------------------------------------------- optimize: float16 (CUDA)

_NP = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "bool": np.bool_}


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_float16_tree_graph_follows_the_manifest(optimized, kind):
    """--target cuda converts the tree graphs (no longer dropped): float16 features and drafter K/V
    (the cache dtype), float32 scores, as the manifest declares; the CPU EP runs them."""
    out = optimized(kind, target="cuda")
    m = Manifest.read(out)
    assert any(e["graph"] == ROLE for e in m.tree["eagle_trees"]) and m.optimization[ROLE]["dtype"] == "float16"
    spec = m.graphs[ROLE]
    assert spec.output(C.TREE_SCORES).dtype == "float32"
    assert {t.dtype for t in spec.inputs if t.name.startswith("past_key_values.")} == {"float16"}
    assert spec.inputs[0].dtype == "float16"
    assert spec.to_json() == m.graphs[ROLE].to_json()
    proto = onnx.load(str(out / spec.file), load_external_data=False)
    for values, specs in ((proto.graph.input, spec.inputs), (proto.graph.output, spec.outputs)):
        assert [v.name for v in values] == [t.name for t in specs]
        for v, t in zip(values, specs):
            assert onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type) == _NP[t.dtype], t.name
    dec = graphs.load(out, provider="cpu", threads=1, eagle_draft="one_call", adaptive=False)
    ar = dec.generate(PROMPTS, max_new_tokens=12, mode="autoregressive")
    sp = dec.generate(PROMPTS, max_new_tokens=12)
    assert [r.token_ids for r in sp] == [r.token_ids for r in ar]
    assert sp[0].stats.draft_calls == sp[0].stats.steps > 0


def test_quantized_drafter_beside_a_float_base(exported, tmp_path):
    """--quantize none --quantize-draft int4: the base stays float32 (the output is the float model's),
    the drafter graphs (draft and the one-call trees) are int4 at accuracy level 4."""
    out = tmp_path / "out"
    shutil.copytree(exported("eagle"), out)
    optimize_export(out, quantize="none", quantize_draft="int4", progress=None, time_gain=False)
    m = Manifest.read(out)
    assert m.optimization["base"]["quantization"] is None
    trees = [r for r in m.graphs if r.startswith(C.TREE_ROLE_PREFIX)]
    assert trees
    for role in ["draft", *trees]:
        q = m.optimization[role]["quantization"]
        assert q["bits"] == 4 and q["accuracy_level"] == 4, role
    dec = graphs.load(out, provider="cpu", threads=1, eagle_draft="one_call", adaptive=False)
    prompts = [[5, 9, 3], [7, 1, 4, 4, 2, 8]]
    want = [r.token_ids for r in dec.generate(prompts, max_new_tokens=16, mode="autoregressive")]
    got = dec.generate(prompts, max_new_tokens=16)
    assert [r.token_ids for r in got] == want  # the float32 base's greedy output, token for token
    assert all(r.stats.draft_calls == r.stats.steps for r in got)
