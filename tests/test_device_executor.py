"""The device path (graphs.device) on the CPU EP: the same code as on CUDA, OrtValues on the CPU device.

Greedy speculative output equals autoregressive exactly (float32) at batch > 1 with tree masks after
a past; equals the host path's; sampled speculative decoding keeps the base distribution (the
chi-square test of test_spec_sampling); the bytes a step brings to the host stay small at a 32k
vocabulary; the device graphs are in the manifest (hashed), and an export without them is refused
with one line naming the fix. The same for EAGLE-1 / EAGLE-3 (step-wise and one-call trees) and DFlash,
the drafter's K/V on the device (graphs.device.DeviceDraftKV, device.draft_kv_copy).
"""

from __future__ import annotations

import shutil

import numpy as np
import onnxruntime as ort
import pytest

import graphs
from exporter.optimize import optimize_export
from graphs import contract as C
from graphs.errors import InputError
from graphs.manifest import Manifest

QUIET = dict(progress=None, time_gain=False, tune=False)
PROMPTS = [[5, 9, 13, 40, 41, 7], [3, 3, 8], [100, 90, 80, 70, 60, 50, 40, 30, 20, 10, 11]]


@pytest.fixture(scope="module")
def device_export(exported, tmp_path_factory):
    """The tiny Medusa export, optimized (fused, K/V written in place, the device graphs beside it)."""
    out = tmp_path_factory.mktemp("device") / "out"
    shutil.copytree(exported("medusa"), out)
    optimize_export(out, **QUIET)
    return out


def test_the_device_graphs_are_in_the_manifest(device_export):
    m = Manifest.read(device_export)
    for role in C.DEVICE_ROLES:
        assert role in m.graphs and m.graphs[role].file in m.files  # hashed like every graph
    assert "kv_update" not in m.graphs  # read by nothing: dropped by optimize
    assert not (device_export / "kv_update.onnx").exists()


def test_greedy_speculative_equals_autoregressive_on_the_device_path(device_export):
    dec = graphs.load(device_export, provider="cpu", threads=1, device_resident=True)
    dec.eos = set()
    ar = dec.generate(PROMPTS, max_new_tokens=24, mode="autoregressive")
    sp = dec.generate(PROMPTS, max_new_tokens=24, mode="speculative", speculation="on")
    assert [r.token_ids for r in sp] == [r.token_ids for r in ar]
    assert sp[0].stats.speculative_steps > 0 and sp[0].stats.mean_accepted_length > 1.0
    host = graphs.load(device_export, provider="cpu", threads=1)
    host.eos = set()
    want = host.generate(PROMPTS, max_new_tokens=24, mode="speculative", speculation="on")
    assert [r.token_ids for r in sp] == [r.token_ids for r in want]


def test_rows_leave_and_join_on_the_device(device_export):
    """A row that finishes early moves the last row into its place on the device (device.kv_copy);
    the others go on exactly, and K/V growth past the first bucket copies on the device too."""
    dec = graphs.load(device_export, provider="cpu", threads=1, device_resident=True)
    dec.eos = set()
    host = graphs.load(device_export, provider="cpu", threads=1)
    host.eos = set()
    prompts = [*PROMPTS, [7, 8, 9, 10]]
    lens = [5, 80, 12, 40]  # row 0 leaves first: row 3 moves into it; 80 tokens grow past 64 columns
    got = [dec.generate([p], max_new_tokens=n, mode="speculative", speculation="on")[0].token_ids
           for p, n in zip(prompts, lens)]
    eng = dec.engine()
    from graphs.params import GenerationParams

    ids = [eng.add_request(p, GenerationParams(max_new_tokens=n, speculation="on")) for p, n in zip(prompts, lens)]
    toks = {i: [] for i in ids}
    while eng.has_pending_requests():
        for e in eng.step():
            toks[e.request_id] += list(e.token_ids)
    assert [toks[i] for i in ids] == got
    want = [host.generate([p], max_new_tokens=n, mode="autoregressive")[0].token_ids for p, n in zip(prompts, lens)]
    assert got == want


def test_float16_device_graphs_of_a_cuda_build_on_the_cpu_ep(exported, tmp_path):
    """The --target cuda build (float16, both attention forms; on this machine the Attention form is
    chosen by default) through the device path on the CPU EP: float16 K/V buffers, TensorScatter, Pad
    and the selection in float16. Greedy speculative == autoregressive within the rows bound."""
    from helpers import assert_greedy_within_bound

    out = tmp_path / "cuda"
    shutil.copytree(exported("medusa"), out)
    optimize_export(out, target="cuda", **QUIET)
    m = Manifest.read(out)
    assert m.graphs[C.COMPACT_ROLE].inputs[0].dtype == "float16"
    dec = graphs.load(out, provider="cpu", threads=1, device_resident=True)
    dec.eos = set()
    ar = dec.generate(PROMPTS, max_new_tokens=16, mode="autoregressive")
    sp = dec.generate(PROMPTS, max_new_tokens=16, mode="speculative", speculation="on")
    bound = m.optimization["base"].get("rows_max_abs", 0.0)
    for p, a, b in zip(PROMPTS, ar, sp):
        assert_greedy_within_bound(dec, p, a.token_ids, b.token_ids, bound)


def test_an_older_export_listing_a_kv_update_graph_still_loads_and_optimize_drops_it(exported, tmp_path):
    """Exports made before the device graphs listed a ``kv_update`` graph that nothing reads any more:
    the host path loads them (the file is unused), and optimizing one drops it for the device graphs."""
    import json

    from graphs.manifest import MANIFEST, sha256_file

    out = tmp_path / "old"
    shutil.copytree(exported("medusa"), out)
    dims = ["batch", 2, "c", 16]
    spec = {"file": "kv_update.onnx", "inputs": [{"name": "cache.0", "dtype": "float32", "dims": dims}],
            "outputs": [{"name": "cache_out.0", "dtype": "float32", "dims": dims}]}
    (out / "kv_update.onnx").write_bytes(b"an old K/V update graph")
    data = json.loads((out / MANIFEST).read_text())
    data["graphs"]["kv_update"] = spec
    data["files"]["kv_update.onnx"] = sha256_file(out / "kv_update.onnx")
    (out / MANIFEST).write_text(json.dumps(data))
    want = graphs.load(exported("medusa"), provider="cpu", threads=1).generate([5, 6, 7], max_new_tokens=6).token_ids
    assert graphs.load(out, provider="cpu", threads=1).generate([5, 6, 7], max_new_tokens=6).token_ids == want
    optimize_export(out, **QUIET)
    m = Manifest.read(out)
    assert "kv_update" not in m.graphs and not (out / "kv_update.onnx").exists()
    dec = graphs.load(out, provider="cpu", threads=1, device_resident=True)
    assert dec.generate([5, 6, 7], max_new_tokens=6).token_ids == want


def test_greedy_rows_beside_sampled_rows_stay_exact(device_export):
    """One engine, greedy and sampled requests in the same verify calls: the greedy rows walk the
    argmax, the sampled ones device.sample's arrays; a greedy row's tokens are the autoregressive ones."""
    from graphs.params import GenerationParams

    dec = graphs.load(device_export, provider="cpu", threads=1, device_resident=True)
    dec.eos = set()
    want = [r.token_ids for r in dec.generate(PROMPTS, max_new_tokens=20, mode="autoregressive")]
    eng = dec.engine()
    temps = [0.0, 0.9, 0.0]
    ids = [eng.add_request(p, GenerationParams(max_new_tokens=20, speculation="on", temperature=t, seed=5))
           for p, t in zip(PROMPTS, temps)]
    toks = {i: [] for i in ids}
    while eng.has_pending_requests():
        for e in eng.step():
            assert e.finish_reason != "error", e.error
            toks[e.request_id] += list(e.token_ids)
    for i, t, w in zip(ids, temps, want):
        assert len(toks[i]) == 20
        if t == 0:
            assert toks[i] == w


def test_an_export_without_the_device_graphs_is_refused_with_the_fix(exported):
    with pytest.raises(InputError, match=r"python -m exporter.optimize"):
        graphs.load(exported("medusa"), provider="cpu", device_resident=True)


class _Copies:
    """ORT's copy-out calls wrapped: the bytes they bring to the host."""

    def __init__(self, monkeypatch):
        self.bytes = 0

        def wrap(cls, name, size):
            orig = getattr(cls, name)

            def f(*a, **k):
                got = orig(*a, **k)
                self.bytes += size(got)
                return got

            monkeypatch.setattr(cls, name, f)

        arrays = lambda got: sum(getattr(x, "nbytes", 0) for x in (got if isinstance(got, list) else [got]))
        wrap(ort.OrtValue, "numpy", arrays)
        wrap(ort.IOBinding, "copy_outputs_to_cpu", arrays)
        wrap(ort.IOBinding, "get_outputs", lambda got: sum(v.tensor_size_in_bytes() for v in got))


@pytest.fixture(scope="module")
def big_vocab_export(tmp_path_factory):
    """A tiny Medusa model with a 32000-token vocabulary (hidden 32), exported and optimized."""
    from conftest import build_tiny_model, save_tiny_model

    from exporter.export import export

    root = tmp_path_factory.mktemp("vocab32k")
    model = build_tiny_model("llama", "medusa", vocab_size=32000, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2)
    save_tiny_model(model, root / "model", tokenizer=False)
    export(root / "model", root / "onnx", log=lambda *a, **k: None)
    optimize_export(root / "onnx", **QUIET)
    return root / "onnx"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bytes_to_the_host_per_step_stay_small_at_a_32k_vocabulary(big_vocab_export, monkeypatch, temperature):
    """Greedy: the argmax and flags per node, the features at each row's accepted node, the heads' ids.
    Sampled: also each node's probabilities of the tree's tokens and a few draws (device.sample)."""
    copies = _Copies(monkeypatch)
    dec = graphs.load(big_vocab_export, provider="cpu", threads=1, device_resident=True)
    dec.eos = set()
    eng = dec.engine()
    from graphs.params import GenerationParams

    for p in PROMPTS:
        eng.add_request(p, GenerationParams(max_new_tokens=40, speculation="on", temperature=temperature, seed=3))
    eng.step()  # the prefills: each request's last logits row comes back once (its first token)
    ex = eng.ex
    start, steps = ex.host_bytes, 0
    while eng.has_pending_requests():
        eng.step()
        steps += 1
    per_step = (ex.host_bytes - start) / steps
    print(f"\ndevice path, 32k vocabulary, batch 3, temperature {temperature}: {per_step:.0f} host bytes a step "
          f"over {steps} steps")
    assert per_step < 64 * 1024
    assert copies.bytes == 0  # nothing through OrtValue.numpy / copy_outputs_to_cpu / get_outputs
    # the host path brings every verify's logits back: (rows x width x 32000 x 4 bytes)
    assert per_step < 3 * 32000 * 4


def test_seeded_sampling_on_the_device_path_is_reproducible(device_export):
    dec = graphs.load(device_export, provider="cpu", threads=1, device_resident=True)
    dec.eos = set()
    runs = [[r.token_ids for r in dec.generate(PROMPTS, max_new_tokens=20, temperature=0.8, top_p=0.9, top_k=40,
                                                seed=11, speculation="on")] for _ in range(2)]
    assert runs[0] == runs[1]
    other = [r.token_ids for r in dec.generate(PROMPTS, max_new_tokens=20, temperature=0.8, top_p=0.9, top_k=40,
                                               seed=12, speculation="on")]
    assert other != runs[0]


def test_sampling_on_the_device_path_keeps_the_base_distribution(tmp_path_factory):
    """The chi-square test of test_spec_sampling, on the device path of an optimized float32 export."""
    import torch
    from helpers import torch_threads
    from test_optimize import _graph_joint
    from test_spec_sampling import (
        BATCH,
        DRAFTERS,
        PROMPT,
        VOCAB,
        _base,
        _distill,
        _sampled_text,
        chi_square,
        sample_counts,
    )

    from exporter.export import export
    from exporter.speculative import convert, enable_huggingface_checkpointing

    root = tmp_path_factory.mktemp("sampling-device")
    with torch_threads(1):
        base = _base()
        torch.manual_seed(2)
        model = convert(_base(), [DRAFTERS["medusa"]])
        _distill(model, _sampled_text(base, n=96, length=24, seed=1))
        enable_huggingface_checkpointing()
        model.save_pretrained(root / "model")
    export(root / "model", root / "onnx", log=lambda *a, **k: None)
    optimize_export(root / "onnx", **QUIET)
    dec = graphs.load(root / "onnx", provider="cpu", threads=1, device_resident=True)
    dec.eos = set()
    counts, tau = sample_counts(dec, seeds=range(4), temperature=1.0)
    assert tau > 1.05
    assert counts.sum() == 4 * BATCH
    joint = _graph_joint(dec, VOCAB, PROMPT)
    stat, dof, p = chi_square(counts, joint)
    print(f"\ndevice path medusa: chi2 {stat:.1f} dof {dof} p {p:.3g} tau {tau:.2f}")
    assert p > 1e-3
    np.testing.assert_equal(counts.sum(), 4 * BATCH)


# ---------------------------------------------------------------- EAGLE (EAGLE-1, EAGLE-3) on the device path

EAGLE_PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2, 8, 6, 2, 9], [11], [3, 3, 8, 1, 2]]


@pytest.fixture(scope="module")
def eagle_exports(exported, tmp_path_factory):
    """The tiny EAGLE-1 and EAGLE-3 exports, optimized: base and drafter K/V in place, the device
    graphs beside them (device.draft_kv_copy for the drafter's buffers), a baked one-call tree."""
    outs = {}
    for kind in ("eagle", "eagle3"):
        out = tmp_path_factory.mktemp(f"device-{kind}") / "out"
        shutil.copytree(exported(kind), out)
        optimize_export(out, **QUIET)
        outs[kind] = out
    return outs


def _engine_run(dec, prompts, lens=None):
    """Requests arriving one a step into 3 rows (the 4th waits for a free row; rows leave, the last
    moving into the freed one): each request's tokens, and the trees verified (watch_verify)."""
    from graphs.engine import EngineConfig

    engine = dec.engine(EngineConfig(max_batch=3))
    lens = lens or [14 + 3 * i for i in range(len(prompts))]
    with dec.watch_verify() as records:
        got: dict[int, list[int]] = {}
        for step in range(400):
            if step < len(prompts):
                got[engine.add_request(prompts[step], max_new_tokens=lens[step])] = []
            for ev in engine.step():
                assert ev.finish_reason != "error", ev.error
                got[ev.request_id] += ev.token_ids
            if not engine.has_pending_requests():
                break
    trees = [(r.request_id, r.tokens.tolist(), r.accepted) for r in records]
    return list(got.values()), trees, engine


@pytest.mark.parametrize("draft", ["stepwise", "one_call"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_on_the_device_path_equals_the_host_path_and_autoregressive(eagle_exports, kind, draft):
    """The drafter's K/V on the device (its graphs write in place into OrtValue buffers; growth and row
    moves by device.draft_kv_copy): batch 3 with trees after a past, rows leaving and joining; the
    trees proposed are the host path's exactly, the output the base's greedy output."""
    out = eagle_exports[kind]
    m = Manifest.read(out)
    assert C.DRAFT_COPY_ROLE in m.graphs and m.graphs[C.DRAFT_COPY_ROLE].file in m.files
    runs = []
    for device in (True, False):
        dec = graphs.load(out, provider="cpu", threads=1, eagle_draft=draft, adaptive=False, device_resident=device)
        dec.eos = set()
        tokens, trees, engine = _engine_run(dec, EAGLE_PROMPTS)
        ar = dec.generate(EAGLE_PROMPTS, max_new_tokens=14, mode="autoregressive")
        assert [t[:14] for t in tokens] == [r.token_ids for r in ar]
        runs.append((tokens, trees))
        if device:
            ex = engine.ex
            assert type(ex).__name__ == "DeviceExecutor" and ex.draft_kv is not None
            assert ex.memory()["drafter_kv_allocated_bytes"] >= 0
    assert runs[0] == runs[1]
    drafted = [t for _, t, _ in runs[0][1] if len(t) > 1]
    assert len(drafted) > 20 and len({tuple(t) for t in drafted}) > 10  # the drafter ran, on varied contexts


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_drafter_k_v_grows_on_the_device(eagle_exports, kind):
    """Long rows: the drafter's buffers grow past the first bucket (device.draft_kv_copy) while a
    short row leaves; greedy speculative equals autoregressive, the host path's trees."""
    out = eagle_exports[kind]
    prompts, lens = EAGLE_PROMPTS[:3], [90, 6, 70]
    runs = []
    for device in (True, False):
        dec = graphs.load(out, provider="cpu", threads=1, eagle_draft="stepwise", adaptive=False,
                          device_resident=device)
        dec.eos = set()
        tokens, trees, engine = _engine_run(dec, prompts, lens)
        runs.append((tokens, trees))
        if device:
            assert engine.ex.draft_kv.generation >= 2  # grown at least once after the first allocation
    assert runs[0] == runs[1]
    dec = graphs.load(out, provider="cpu", threads=1)
    dec.eos = set()
    want = [dec.generate([p], max_new_tokens=n, mode="autoregressive")[0].token_ids for p, n in zip(prompts, lens)]
    assert runs[0][0] == want


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_bytes_to_the_host_per_step(eagle_exports, monkeypatch, kind):
    """What an EAGLE step brings back on the device path: the argmax and flags per node, the features
    of each row's accepted nodes (device.rows), the drafter's top-k and hidden output per drafted row
    (step-wise) or the tree (one call); never a logits row nor K/V."""
    copies = _Copies(monkeypatch)
    dec = graphs.load(eagle_exports[kind], provider="cpu", threads=1, adaptive=False, device_resident=True)
    dec.eos = set()
    eng = dec.engine()
    from graphs.params import GenerationParams

    for p in PROMPTS:
        eng.add_request(p, GenerationParams(max_new_tokens=30, speculation="on"))
    eng.step()
    ex = eng.ex
    start, steps = ex.host_bytes, 0
    while eng.has_pending_requests():
        eng.step()
        steps += 1
    per_step = (ex.host_bytes - start) / steps
    print(f"\ndevice path {kind}, batch 3: {per_step:.0f} host bytes a step over {steps} steps")
    assert 0 < per_step < 16 * 1024
    assert copies.bytes == 0


def test_an_eagle_export_without_the_drafter_copy_graph_is_refused_with_the_fix(eagle_exports, exported, tmp_path):
    import json

    from graphs.manifest import MANIFEST

    with pytest.raises(InputError, match=r"python -m exporter.optimize"):
        graphs.load(exported("eagle"), provider="cpu", device_resident=True)
    out = tmp_path / "old"
    shutil.copytree(eagle_exports["eagle"], out)
    data = json.loads((out / MANIFEST).read_text())
    del data["graphs"][C.DRAFT_COPY_ROLE]
    del data["files"]["device_draft_kv_copy.onnx"]
    (out / MANIFEST).write_text(json.dumps(data))
    (out / "device_draft_kv_copy.onnx").unlink()
    with pytest.raises(InputError, match=r"device\.draft_kv_copy.*python -m exporter.optimize") as err:
        graphs.load(out, provider="cpu", device_resident=True)
    assert "\n" not in str(err.value)
    graphs.load(out, provider="cpu", threads=1)  # the host path loads it as before


def test_eagle3_sampling_on_the_device_path_keeps_the_base_distribution(tmp_path_factory):
    """The chi-square test of test_spec_sampling with a self-distilled EAGLE-3 drafter, on the device
    path of an optimized float32 export (the drafter's K/V on the device; device.sample's walk)."""
    import torch
    from helpers import torch_threads
    from test_optimize import _graph_joint
    from test_spec_sampling import BATCH, PROMPT, VOCAB, _base, _distill, _sampled_text, chi_square, sample_counts

    from exporter.export import export
    from exporter.speculative import convert, enable_huggingface_checkpointing

    root = tmp_path_factory.mktemp("sampling-device-eagle3")
    with torch_threads(1):
        base = _base()
        torch.manual_seed(2)
        model = convert(_base(), [("eagle", {"eagle_num_layers": 1, "use_aux_hidden_state": True})])
        _distill(model, _sampled_text(base, n=96, length=24, seed=1))
        enable_huggingface_checkpointing()
        model.save_pretrained(root / "model")
    export(root / "model", root / "onnx", log=lambda *a, **k: None)
    optimize_export(root / "onnx", **QUIET)
    dec = graphs.load(root / "onnx", provider="cpu", threads=1, device_resident=True)
    assert dec.manifest.drafter["eagle3"]
    dec.eos = set()
    counts, tau = sample_counts(dec, seeds=range(4), temperature=1.0)
    assert tau > 1.05
    assert counts.sum() == 4 * BATCH
    joint = _graph_joint(dec, VOCAB, PROMPT)
    stat, dof, p = chi_square(counts, joint)
    print(f"\ndevice path eagle3: chi2 {stat:.1f} dof {dof} p {p:.3g} tau {tau:.2f}")
    assert p > 1e-3


# ---------------------------------------------------------------- DFlash on the device path

@pytest.fixture(scope="module")
def dflash_device_export(trained_dflash, tmp_path_factory):
    """conftest's trained tiny DFlash export (block 4), optimized for the CPU: the drafter's context K/V
    written in place, device.draft_kv_copy beside it."""
    out = trained_dflash[0]
    opt = tmp_path_factory.mktemp("device-dflash") / "out"
    shutil.copytree(out, opt)
    optimize_export(opt, **QUIET)
    return opt


def test_dflash_on_the_device_path_equals_the_host_path_and_autoregressive(dflash_device_export):
    """Chain and top-k tree rows at batch 3, the drafter's context K/V on the device: the trees verified
    are the host path's, the output autoregressive; a row leaving moves its drafter row on the device."""
    from test_dflash_engine import CHAIN, TREE, prompts

    out = dflash_device_export
    assert C.DRAFT_COPY_ROLE in Manifest.read(out).graphs
    dev = graphs.load(out, provider="cpu", threads=1, device_resident=True)
    host = graphs.load(out, provider="cpu", threads=1)
    ps = prompts(3)
    want = [r.token_ids for r in host.generate(ps, max_new_tokens=20, mode="autoregressive")]
    for tree in (CHAIN, TREE):
        runs = []
        for dec in (dev, host):
            with dec.watch_verify() as records:
                got = dec.generate(ps, max_new_tokens=20, tree=tree, speculation="on")
            runs.append(([r.token_ids for r in got], [(r.tokens.tolist(), r.accepted) for r in records]))
        assert runs[0] == runs[1], tree
        assert runs[0][0] == want, tree
        assert got[0].stats.mean_accepted_length > 1.1
    from graphs.params import GenerationParams

    lens = [4, 30, 18]  # row 0 leaves first: row 2's drafter row moves into it
    eng = dev.engine()
    ids = [eng.add_request(p, GenerationParams(max_new_tokens=n, speculation="on", tree=TREE))
           for p, n in zip(ps, lens)]
    toks = {i: [] for i in ids}
    steps, start = 0, None
    while eng.has_pending_requests():
        for e in eng.step():
            assert e.finish_reason != "error", e.error
            toks[e.request_id] += list(e.token_ids)
        steps += 1
        start = eng.ex.host_bytes if start is None else start  # (after the prefills)
    per_step = (eng.ex.host_bytes - start) / (steps - 1)
    print(f"\ndevice path dflash, batch 3, top-k tree: {per_step:.0f} host bytes a step over {steps - 1} steps")
    assert 0 < per_step < 16 * 1024
    assert [toks[i] for i in ids] == [host.generate([p], max_new_tokens=n, mode="autoregressive")[0].token_ids
                                      for p, n in zip(ps, lens)]
