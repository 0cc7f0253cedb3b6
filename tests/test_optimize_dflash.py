"""python -m exporter.optimize on a DFlash export: the draft graph's two-key-set attention fused into one ONNX
``Attention`` (plus rotary, norms, the context cache written in place), int8/int4 MatMulNBits, the parity gate
fed the DFlash calls (exporter.passes.parity.dflash_feeds, the export check's own), and the tree re-tuned
for the optimized graphs (the engine's DFlash proposer measures the chain and top-k trees)."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
import torch
from conftest import save_tiny_model
from tiny import tiny_model

from exporter import pipeline
from exporter.compare_report import TOLERANCES
from exporter.passes.parity import dflash_parity_feeds, rewritten_feed
from exporter.speculative import convert
from exporter.validate import dflash_cases, run_case
from graphs import contract as C
from graphs.manifest import Manifest
from graphs.sessions import make_session

CFG = {"dflash_block_size": 4, "dflash_mask_token_id": 250, "dflash_target_layer_ids": [0, 2],
       "dflash_architecture_config": {"num_hidden_layers": 2}}
VARIANTS = {"fused": {}, "int8": {"quantize": "int8"}, "int4": {"quantize": "int4"}}
F32 = TOLERANCES[("float32", "cpu")]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def dflash(request, tmp_path_factory):
    """(model, raw export, {variant: optimized copy})."""
    d = tmp_path_factory.mktemp(f"dflash-opt-{request.param}")
    torch.manual_seed(1)
    model = convert(tiny_model(request.param, seed=0), [("dflash", dict(CFG))])
    with torch.no_grad():  # away from the init, so a wrong weight cannot pass
        for p in model.dflash_module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_tiny_model(model, d / "model")
    pipeline.export(d / "model", d / "out", log=lambda *a, **k: None)
    done = {}
    for name, opts in VARIANTS.items():
        if request.param == "qwen3" and name != "fused":
            continue  # the quantizer does not care which base the drafter's MatMuls sit beside
        shutil.copytree(d / "out", d / name)
        pipeline.optimize_export(d / name, progress=None, time_gain=False, **opts)
        done[name] = d / name
    return model, d / "out", done


def _ops(path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in onnx.load(str(path), load_external_data=False).graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def _draft_runs(raw_out, opt_out):
    """The raw and the optimized draft graph on the DFlash calls (batch 2; the second over a cache of 5
    columns with holes), each as [(case, {output: array})] in the raw contract."""
    raw_m, opt_m = Manifest.read(raw_out), Manifest.read(opt_out)
    spec, new_spec = raw_m.graphs["draft"], opt_m.graphs["draft"]
    raw = make_session(raw_out / spec.file, "cpu", 1)
    new = make_session(opt_out / new_spec.file, "cpu", 1)
    feeds = dflash_parity_feeds(raw_out / raw_m.graphs["base"].file, raw_m.graphs["base"], raw, spec, raw_m.drafter,
                                raw_m.source["vocab_size"], seed=5)
    assert feeds[1][1][C.past_key(0)].shape[2] == 5 and feeds[1][1][C.INPUT_IDS].shape[0] == 2
    runs = []
    for case, feed in feeds:
        new_feed, cut = rewritten_feed(feed, new_spec)
        want = dict(zip(spec.output_names, raw.run(spec.output_names, feed)))
        got = cut(dict(zip(new_spec.output_names, new.run(new_spec.output_names, new_feed))))
        runs.append((case, want, got))
    return runs


def test_fused_draft_graph_has_one_attention_per_layer_and_its_cache_in_place(dflash):
    _, _, done = dflash
    m = Manifest.read(done["fused"])
    ops = _ops(done["fused"] / m.graphs["draft"].file)
    assert ops.get("Attention") == 2 and "Softmax" not in ops  # 2 draft layers, the eager pattern gone
    assert ops.get("RotaryEmbedding") == 6  # q, the block's k, the context's k per layer
    assert ops.get("TensorScatter") == 4 and C.KV_WRITE in m.graphs["draft"].input_names
    rec = m.optimization["draft"]
    assert rec["fused"]["Attention"] == 2 and rec["passes"][:2] == ["attention", "rotary"]
    assert m.validation["optimize"]["graphs"]["draft"]["ok"] is True
    assert m.tree == {"dflash": {"topk": 1, "total_tokens": 4}}


def test_fused_draft_graph_equals_the_raw_one_at_batch2_with_a_cache(dflash):
    """Raw vs fused float32 on the DFlash calls: top-k ids equal, logits/log-probs/context K/V within the
    float32 tolerance (measured: 3.0e-7 in the logits)."""
    _, out, done = dflash
    for case, want, got in _draft_runs(out, done["fused"]):
        np.testing.assert_array_equal(got[C.TOPK_IDS], want[C.TOPK_IDS], err_msg=case)
        for name, w in want.items():
            if name == C.TOPK_IDS:
                continue
            err = float(np.abs(got[name].astype(np.float64) - w).max())
            assert err <= F32.atol + F32.rtol * float(np.abs(w).max()), (case, name, err)


def test_fused_draft_graph_equals_pytorch(dflash):
    """A second reference: the export check's own calls (exporter.validate.dflash_cases) through the fused,
    in-place graph against the PyTorch drafter."""
    from exporter.trace import graph_module

    model, _, done = dflash
    m = Manifest.read(done["fused"])
    spec = m.graphs["draft"]
    session = make_session(done["fused"] / spec.file, "cpu", 1)
    draft = graph_module(model, "draft")
    for case, inputs in dflash_cases(model, m.graphs["base"], torch.Generator().manual_seed(3)):
        got = dict(zip(spec.output_names, run_case(session, spec, inputs)))  # buffers padded, rows cut back
        with torch.no_grad():
            want = dict(zip(spec.output_names, (t.numpy() for t in draft(*inputs))))
        np.testing.assert_array_equal(got[C.TOPK_IDS], want[C.TOPK_IDS], err_msg=case)
        for name in (C.LOGITS, C.TOPK_LOGPROBS, C.present_key(0), C.present_value(1)):
            assert np.abs(got[name] - want[name]).max() < 1e-4, (case, name)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_drafter_is_matmulnbits_and_reported(dflash, quantize):
    """Weight-only drafter (drafts are proposals the base verifies): MatMulNBits, finite on the DFlash calls,
    its distance from the float32 trace recorded by the gate."""
    _, out, done = dflash
    if quantize not in done:
        pytest.skip("quantized on the llama base only")
    m = Manifest.read(done[quantize])
    q = m.optimization["draft"]["quantization"]
    assert q["bits"] == {"int8": 8, "int4": 4}[quantize] and q["matmuls"] > 0
    ops = _ops(done[quantize] / m.graphs["draft"].file)
    assert ops.get("MatMulNBits") == q["matmuls"] and ops.get("Attention") == 2
    gate = m.validation["optimize"]["graphs"]["draft"]
    assert gate["ok"] is True and np.isfinite(gate["max_abs_logits"])
    for case, want, got in _draft_runs(out, done[quantize]):
        assert all(np.isfinite(v).all() for v in got.values()), case
        assert got[C.LOGITS].shape == want[C.LOGITS].shape


def test_optimize_re_tunes_the_dflash_tree(dflash, tmp_path):
    """optimize's re-tuning step (the CLI's default, and exporter.bench's) on a DFlash export measures the
    chain and top-k trees on the optimized graphs and records the winner as tree.dflash (tune.untunable
    refused DFlash before the engine had its proposer)."""
    _, out, _ = dflash
    shutil.copytree(out, tmp_path / "t")
    summary = pipeline.optimize_export(tmp_path / "t", tune=True, time_gain=False, validate=False, progress=None,
                                       tune_prompts=["abc", "xyz"])
    assert "skipped" not in summary["tune"]
    tree = Manifest.read(tmp_path / "t").tree
    assert set(tree["dflash"]) == {"topk", "total_tokens"} and tree["tuned"]["measured_tokens_per_s"] > 0
