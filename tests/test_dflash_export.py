"""DFlash export: the base emits the target layers, the draft graph takes context rows + cache + block in one
call; ONNX Runtime equals PyTorch at batch 2 with a past and holes (export's own check); the manifest."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from conftest import save_tiny_model
from tiny import tiny_model

from exporter import pipeline
from exporter.speculative import convert
from graphs import contract as C
from graphs.errors import ArtifactError
from graphs.manifest import MANIFEST, Manifest
from graphs.schema import check_manifest

CFG = {"dflash_block_size": 4, "dflash_mask_token_id": 250, "dflash_target_layer_ids": [0, 2],
       "dflash_architecture_config": {"num_hidden_layers": 2}}
QUIET = dict(log=lambda *a, **k: None)


VOCAB = 100  # "llama-vocab": the drafter's logits over 100 of the 256 tokens (dflash_draft_vocab_size)


@pytest.fixture(scope="module", params=["llama", "qwen3", "llama-vocab"])
def dflash_export(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"dflash-{request.param}")
    torch.manual_seed(1)
    arch, vocab = request.param.split("-")[0], request.param.endswith("-vocab")
    cfg = {**CFG, "dflash_draft_vocab_size": VOCAB if vocab else None}
    model = convert(tiny_model(arch, seed=0), [("dflash", cfg)])
    with torch.no_grad():  # away from the init, so a wrong weight cannot pass
        for p in model.dflash_module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        if vocab:  # not a prefix of the ids: a graph that took the head's first rows would fail
            model.dflash_module.draft_vocab.copy_(torch.randperm(256, generator=torch.Generator().manual_seed(4))[
                :VOCAB].sort().values)
    save_tiny_model(model, d / "model")
    pipeline.export(d / "model", d / "out", **QUIET)
    return model, d / "out"


def test_export_validates_the_draft_graph_at_batch2_with_a_past(dflash_export):
    _, out = dflash_export
    m = Manifest.read(out)
    assert m.validation["ok"] is True
    rows = m.validation["max_abs"]
    for case in ("context_b2_holes", "block_b2_past5"):
        for name in ("logits", "topk_logprobs", "present.0.key", "present.1.value"):
            assert rows[f"draft/{case}/{name}"] < 1e-4, (case, name)
    assert m.drafter["kind"] == "dflash" and m.drafter["block_size"] == 4 and m.drafter["mask_token_id"] == 250
    assert m.drafter["target_layer_ids"] == [0, 2] and m.tree == {"dflash": {"topk": 1, "total_tokens": 4}}
    base, draft = m.graphs["base"], m.graphs["draft"]
    assert base.output(C.AUX_HIDDEN).dims[-1] == 2 * 64
    assert draft.input_names[:5] == [C.AUX_HIDDEN, C.CONTEXT_POSITION_IDS, C.INPUT_IDS, C.POSITION_IDS,
                                     C.ATTENTION_MASK]
    assert draft.output(C.LOGITS).dims == (C.BATCH, C.BLOCK_DRAFTS, 256)
    assert "draft_kv_update" not in m.graphs


def test_graph_drafts_a_block_over_its_own_cache_as_pytorch_does(dflash_export):
    """Two calls through ONNX Runtime, the cache kept between them by the caller (as a runtime would),
    against one PyTorch pass over the whole context (training's block function)."""
    import onnxruntime as ort

    from exporter.speculative.dflash import block_hidden

    model, out = dflash_export
    m = Manifest.read(out)
    spec = m.graphs["draft"]
    sess = ort.InferenceSession(str(out / spec.file), providers=["CPUExecutionProvider"])
    dm = model.dflash_module
    ids = torch.randint(3, 250, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, _, aux = model.base_outputs(ids)
    b = dm.block_size
    past = [np.zeros((1, dm.num_kv_heads, 0, dm.head_dim), np.float32)] * (2 * len(dm.layers))
    got = None
    for lo, hi in ((0, 5), (5, 8)):  # context rows 0..4, then 5..7; the anchor is token `hi`
        block = np.array([[int(ids[0, hi])] + [dm.mask_token_id] * (b - 1)])
        feed = {C.AUX_HIDDEN: aux[:, lo:hi].numpy(), C.CONTEXT_POSITION_IDS: np.arange(lo, hi)[None],
                C.INPUT_IDS: block, C.POSITION_IDS: hi + np.arange(b)[None],
                C.ATTENTION_MASK: np.ones((1, 1, b, hi + b), bool), C.TOPK_IN: np.array([2])}
        feed |= {n: p for n, p in zip([t.name for t in spec.inputs if t.name.startswith("past_")], past)}
        res = dict(zip(spec.output_names, sess.run(spec.output_names, feed)))
        past = [np.concatenate([p, res[n]], axis=2) for p, n in
                zip(past, [t.name for t in spec.outputs if t.name.startswith("present.")])]
        got = res
    with torch.no_grad():
        hidden = block_hidden(dm, model, aux, ids, torch.tensor([[8]]), torch.tensor([[True]]))
        want = dm.logits(model, hidden[:, 1:]).numpy()
    np.testing.assert_allclose(got[C.LOGITS], want, atol=1e-4, rtol=1e-4)  # (-inf where want is -inf)


def test_a_draft_vocabulary_is_the_heads_rows_of_its_tokens_only(dflash_export):
    """dflash_draft_vocab_size: the draft graph holds the head's rows of those tokens (not the whole
    head), its logits are -inf elsewhere and its top-k are base token ids among them; the manifest says
    the size; without one, the whole vocabulary."""
    import onnx
    from onnx import numpy_helper

    from exporter.validate import dflash_cases, run_case

    model, out = dflash_export
    m = Manifest.read(out)
    dm = model.dflash_module
    if dm.draft_vocab is None:
        assert m.drafter["draft_vocab_size"] == 256
        return
    assert m.drafter["draft_vocab_size"] == VOCAB
    spec = m.graphs["draft"]
    proto = onnx.load(str(out / spec.file))
    shapes = [tuple(i.dims) for i in proto.graph.initializer]
    assert shapes.count((256, 64)) == 1 and ((VOCAB, 64) in shapes or (64, VOCAB) in shapes), shapes  # embedding, rows
    head = model.lm_head.weight.detach()[dm.draft_vocab].numpy()
    rows = [numpy_helper.to_array(i) for i in proto.graph.initializer if tuple(i.dims) in ((VOCAB, 64), (64, VOCAB))]
    assert any(np.array_equal(r if r.shape == head.shape else r.T, head) for r in rows)
    import onnxruntime as ort

    sess = ort.InferenceSession(str(out / spec.file), providers=["CPUExecutionProvider"])
    inside = np.zeros(256, bool)
    inside[dm.draft_vocab.numpy()] = True
    for _, inputs in dflash_cases(model, m.graphs["base"], torch.Generator().manual_seed(5)):
        res = dict(zip(spec.output_names, run_case(sess, spec, inputs)))
        logits = res[C.LOGITS]
        assert np.isneginf(logits[..., ~inside]).all() and np.isfinite(logits[..., inside]).all()
        assert inside[res[C.TOPK_IDS]].all()


def test_schema_refuses_a_bad_dflash_entry(dflash_export):
    _, out = dflash_export
    good = json.loads((out / MANIFEST).read_text())
    check_manifest(good)
    for key, value, fragment in (("mask_token_id", 256, "outside the vocabulary"),
                                 ("target_layer_ids", [0, 9], "target_layer_ids"),
                                 ("block_size", 1, "block_size"), ("num_layers", 3, "past K/V layers"),
                                 ("draft_vocab_size", 257, "over the vocabulary")):
        bad = copy.deepcopy(good)
        bad["drafter"][key] = value
        with pytest.raises(ArtifactError, match=fragment):
            check_manifest(bad)
    bad = copy.deepcopy(good)
    bad["graphs"]["base"]["outputs"] = [t for t in bad["graphs"]["base"]["outputs"] if t["name"] != C.AUX_HIDDEN]
    with pytest.raises(ArtifactError, match="does not emit"):
        check_manifest(bad)


def test_context_cache_written_in_place(dflash_export, tmp_path):
    """The K/V-in-place pass the base and EAGLE graphs get (each Concat(past, new) -> TensorScatter) turns the
    DFlash draft graph into one that writes the A new context rows into the caller's buffer at each row's
    own column (C.inplace_dflash_spec): the same outputs as the traced graph, the buffer holding the rows."""
    import onnx
    import onnxruntime as ort

    from exporter.passes.kv_inplace import write_in_place
    from exporter.validate import dflash_cases, run_case

    model, out = dflash_export
    m = Manifest.read(out)
    spec = m.graphs["draft"]
    layers = len(model.dflash_module.layers)
    proto, layout = write_in_place(onnx.load(str(out / spec.file)), layers, 0, 0, 0, compact=False)
    assert layout == "bhsd"
    onnx.save(proto, str(tmp_path / "draft_inplace.onnx"))
    ispec = C.inplace_base_spec(spec, layout)  # the optimize stage's call: the DFlash form
    assert ispec == C.inplace_dflash_spec(spec) and C.concat_base_spec(ispec, 0, 0).output(C.present_key(0)).dims[2] \
        == C.AUX_SEQ
    assert ispec.input(C.ATTENTION_MASK).dims[3] == C.TOTAL and ispec.input_names[-1] == C.KV_WRITE
    raw = ort.InferenceSession(str(out / spec.file), providers=["CPUExecutionProvider"])
    inplace = ort.InferenceSession(str(tmp_path / "draft_inplace.onnx"), providers=["CPUExecutionProvider"])
    for case, inputs in dflash_cases(model, m.graphs["base"], torch.Generator().manual_seed(3)):
        want = run_case(raw, spec, inputs)
        got = run_case(inplace, ispec, inputs)  # buffers padded, rows written at column P, cut back
        for name, a, b in zip(spec.output_names, want, got):
            np.testing.assert_allclose(b, a, atol=1e-6, rtol=1e-6, err_msg=f"{case} {name}")
    # the runtime's form: one buffer, row b's rows at its own column (sequence 1 holds 3 rows: its 2 new
    # rows go to columns 3..4), a spare column; the same outputs as the concat form with holes
    _, inputs = dflash_cases(model, m.graphs["base"], torch.Generator().manual_seed(3))[1]
    feed = {t.name: x.numpy() for t, x in zip(spec.inputs, inputs)}
    past = [t.name for t in spec.inputs if t.name.startswith("past_")]
    a, s = feed[C.AUX_HIDDEN].shape[1], feed[C.INPUT_IDS].shape[1]
    buf = {n: np.concatenate([feed[n], np.zeros((2, *feed[n].shape[1:2], a + 1, feed[n].shape[3]), np.float32)], 2)
           for n in past}  # capacity P + A + 1
    write = np.array([5, 3])
    ctx = np.zeros((2, 1, s, 5 + a + 1), bool)
    ctx[0, ..., : 5 + a] = True
    ctx[1, ..., : 3 + a] = True
    mask = np.concatenate([ctx, np.ones((2, 1, s, s), bool)], axis=3)
    ifeed = {**feed, **buf, C.ATTENTION_MASK: mask, C.KV_WRITE: write}
    got = dict(zip(ispec.output_names, inplace.run(ispec.output_names, ifeed)))
    want = dict(zip(spec.output_names, raw.run(spec.output_names, feed)))
    np.testing.assert_allclose(got[C.LOGITS], want[C.LOGITS], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(got[C.present_key(0)][0, :, 5 : 5 + a], want[C.present_key(0)][0], atol=1e-6)
    np.testing.assert_allclose(got[C.present_key(0)][1, :, 3 : 3 + a], want[C.present_key(0)][1], atol=1e-6)
