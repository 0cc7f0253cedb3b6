"""The CUDA path end to end: float16 optimized graphs, IO binding, greedy speculative == greedy
autoregressive, CUDA greedy == CPU greedy of the same graphs, and the device path (graphs.device: K/V
and logits on the GPU, only the selection's few bytes back).

    python -m pytest -m gpu

Runs only where onnxruntime-gpu sees a CUDA device; otherwise every test skips and ``-ra`` prints
why. Never run in this project's CI (CPU only), so the first machine with a GPU proves or refutes
it in one command.
"""

from __future__ import annotations

import shutil

import pytest

pytestmark = pytest.mark.gpu


def _cuda_or_skip():
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"no CUDA: onnxruntime {ort.__version__} offers {ort.get_available_providers()} "
                    f"(pip install 'specexport[gpu]' on a machine with an NVIDIA GPU)")


@pytest.fixture(scope="module")
def cuda_export(exported, tmp_path_factory):
    """``cuda_export(kind) -> Path``: the tiny export optimized with --target cuda (float16, fused)."""
    from exporter.optimize import optimize_export

    cache = {}

    def make(kind):
        _cuda_or_skip()
        if kind not in cache:
            out = tmp_path_factory.mktemp(f"gpu-{kind}") / "out"
            shutil.copytree(exported(kind), out)
            optimize_export(out, target="cuda", progress=None, time_gain=False)
            cache[kind] = out
        return cache[kind]

    return make


PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2, 8]]


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_cuda_float16_greedy_speculative_equals_autoregressive(cuda_export, kind):
    import graphs
    from graphs.manifest import Manifest

    out = cuda_export(kind)
    m = Manifest.read(out)
    assert m.optimization["base"]["dtype"] == "float16" and m.optimization["base"]["target"] == "cuda"
    dec = graphs.load(out, provider="cuda")
    assert dec.provider == "cuda"  # K/V stays in host memory: the engine has no device K/V rows yet
    ar = dec.generate(PROMPTS, max_new_tokens=24, mode="autoregressive")
    sp = dec.generate(PROMPTS, max_new_tokens=24, mode="speculative")
    # CUDA kernels pick tiles by row count: rows are not bit-identical across call shapes. The
    # contract: equal, or diverging only at a near-tie within the rows bound measured on the device.
    from helpers import assert_greedy_within_bound

    from exporter.passes.parity import row_consistency

    src = m.source
    rows = [row_consistency(out / m.graphs["base"].file, m.graphs["base"], src["vocab_size"], seed=seed,
                            kv_dims=(src["num_kv_heads"], src["head_dim"]), provider="cuda") for seed in range(4)]
    bound = max(max(r["single"], r["multi"]) for r in rows)
    for p, a, b in zip(PROMPTS, ar, sp):
        assert_greedy_within_bound(dec, p, a.token_ids, b.token_ids, bound)


def test_cuda_device_path_greedy_speculative_equals_autoregressive(cuda_export):
    """graphs.device on CUDA: K/V OrtValues on the GPU written in place, device.select after each verify,
    device.kv_compact after it; the base file the optimize stage chose (Manifest.attention_form), batched
    trees on the ONNX Attention form. Greedy speculative == autoregressive within the rows bound, and
    the host path's tokens the same way; a step brings back a few hundred bytes, not the logits."""
    from helpers import assert_greedy_within_bound

    import graphs
    from exporter.passes.parity import row_consistency
    from graphs.manifest import Manifest

    out = cuda_export("medusa")
    m = Manifest.read(out)
    dec = graphs.load(out, provider="cuda", device_resident=True)
    assert dec.device_model.device == "cuda"
    assert (dec.device_model.one is not None) == (m.attention_form == "gqa")
    dec.eos = set()
    ar = dec.generate(PROMPTS, max_new_tokens=24, mode="autoregressive")
    sp = dec.generate(PROMPTS, max_new_tokens=24, mode="speculative", speculation="on")
    src = m.source
    rows = [row_consistency(out / m.graphs["base"].file, m.graphs["base"], src["vocab_size"], seed=seed,
                            kv_dims=(src["num_kv_heads"], src["head_dim"]), provider="cuda") for seed in range(4)]
    bound = max(max(r["single"], r["multi"]) for r in rows)
    for p, a, b in zip(PROMPTS, ar, sp):
        assert_greedy_within_bound(dec, p, a.token_ids, b.token_ids, bound)
    host = graphs.load(out, provider="cuda")
    host.eos = set()
    for p, a, b in zip(PROMPTS, host.generate(PROMPTS, max_new_tokens=24, mode="autoregressive"), ar):
        assert_greedy_within_bound(host, p, a.token_ids, b.token_ids, bound)
    eng = dec.engine()
    for p in PROMPTS:
        eng.add_request(p, max_new_tokens=30, speculation="on")
    eng.step()
    start, steps = eng.ex.host_bytes, 0
    while eng.has_pending_requests():
        eng.step()
        steps += 1
    assert (eng.ex.host_bytes - start) / steps < 64 * 1024


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_cuda_greedy_equals_cpu_greedy(cuda_export, kind):
    """The same float16 graphs on the CUDA EP (IO binding) and on the CPU EP (numpy feeds).

    Both run float16 kernels with float32 norms and softmax; a tiny random model's logits can have
    near-ties, so the first 12 tokens are compared."""
    import graphs

    out = cuda_export(kind)
    gpu = graphs.load(out, provider="cuda").generate(PROMPTS, max_new_tokens=12)
    cpu = graphs.load(out, provider="cpu", io_binding=False).generate(PROMPTS, max_new_tokens=12)
    assert [r.token_ids for r in gpu] == [r.token_ids for r in cpu]


def test_cuda_compare_passes_at_float16_tolerance(cuda_export, tiny_model_dir):
    """exporter.compare on the CUDA EP: PyTorch float32 vs the optimized float16 graphs."""
    from exporter.loading import load_model
    from exporter.validate import compare_model

    report = compare_model(load_model(tiny_model_dir("eagle3")), cuda_export("eagle3"), provider="cuda")
    assert report.ok, report.table()


# ----------------------------------------------------------------------------- the two attention forms on CUDA

# per form, the calls it takes on the GPU: the Attention form every call, GroupQueryAttention one token per
# row or one sequence (its input check refuses a batch of trees after a past on every provider)
FORM_CASES = {
    "attention": (("tree_b2_past7_holes", 2, 6, 7, False), ("decode_b3_past9_holes", 3, 1, 9, True),
                  ("prefill_b2_tree", 2, 5, 0, False)),
    "gqa": (("tree_b1_past7_holes", 1, 6, 7, True), ("decode_b3_past9_holes", 3, 1, 9, True)),
}


@pytest.mark.parametrize("form", ["attention", "gqa"])
def test_cuda_float16_attention_forms_match_the_float32_trace(cuda_export, exported, form):
    """Each float16 form on the CUDA EP against the raw float32 trace on the CPU EP: non-causal tree
    masks after a past with holes (batch 2 for the Attention form), one token per row of a batch of 3
    with holes, at compare's float16 CUDA tolerance; the argmax the same wherever the float32 top-2
    margin is wider than twice the error."""
    import numpy as np

    from exporter.compare_report import TOLERANCES
    from exporter.passes.parity import Case, random_feed, rewritten_feed
    from graphs import contract as C
    from graphs.manifest import Manifest
    from graphs.sessions import InPlaceRun, make_session

    out, raw = cuda_export("medusa"), exported("medusa")
    m, m_raw = Manifest.read(out), Manifest.read(raw)
    forms = m.optimization["base"]["attention_forms"]
    assert forms["decided"] == "measured" and forms["measured"]["provider"] == "cuda"  # chosen on this GPU
    tol = TOLERANCES[("float16", "cuda")]
    ref = make_session(raw / m_raw.graphs["base"].file, "cpu")
    gpu = InPlaceRun.caller(make_session(out / forms["candidates"][form]["file"], "cuda"), m.graphs["base"])
    for i, (name, batch, seq, past, holes_all) in enumerate(FORM_CASES[form]):
        feed = random_feed(m_raw.graphs["base"], Case(name, batch, seq, past, holes_all=holes_all), seed=i,
                           vocab=m.source["vocab_size"])
        want = ref.run([C.LOGITS], feed)[0].astype(np.float64)
        new_feed, _ = rewritten_feed(feed, m.graphs["base"])
        got = np.asarray(gpu(new_feed)[C.LOGITS], dtype=np.float64)  # (B, S, V): the new rows' logits
        err = float(np.abs(got - want).max())
        assert err <= tol.atol + tol.rtol * float(np.abs(want).max()), f"{form} {name}: max |logits diff| {err:.3g}"
        top2 = np.sort(want, axis=-1)[..., -2:]
        clear = top2[..., 1] - top2[..., 0] > 2 * err  # a near tie within the error may resolve either way
        assert (got.argmax(-1) == want.argmax(-1))[clear].all(), f"{form} {name}: argmax differs"


def test_cuda_rows_gate_ran_on_the_gpu(cuda_export):
    """optimize --target cuda on a GPU machine measures row consistency on the CUDA EP (MatMulNBits and
    the attention kernels pick tiles by row count there) and records which provider it ran on."""
    from graphs.manifest import Manifest

    rows = Manifest.read(cuda_export("medusa")).validation["optimize"]["rows"]
    assert rows["provider"] == "cuda" and rows["contract"] in ("exact", "recorded bound")
