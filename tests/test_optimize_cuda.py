"""optimize --target cuda: float16 graphs in two attention forms, each exact under tree masks.

The forms (exporter.attention_forms): the base with ONNX ``Attention`` fed the tree mask as a float
additive mask, and ``base.gqa.onnx`` with ``GroupQueryAttention`` fed it as ``attention_bias``. Both are
checked here against the raw float32 trace on the CPU EP, on non-causal tree masks after a past with
holes, one token per row of a batch of 3 with holes, and a prefill: float32 forms (``--float32``)
within compare's float32 tolerance, float16 forms within its float16 one. The choice between them
is the GPU's to make (tests/test_gpu.py times and checks them on CUDA); here it stays the default
and the measuring step runs on the CPU EP to prove its bookkeeping.
"""

from __future__ import annotations

import shutil

import onnx
import pytest
from conftest import run_module
from helpers import one_line

from exporter import attention_forms as F
from exporter.compare_report import TOLERANCES
from exporter.errors import UserError
from exporter.optimize import optimize_export
from exporter.optimizing import OptimizeOptions, rows_provider
from exporter.passes.parity import Case, graph_parity
from graphs import contract as C
from graphs.manifest import Manifest

# per form, the calls it takes (a batch of trees after a past: the Attention form only, see below)
FORM_CASES = {
    "attention": (Case("tree_b2_past7_holes", 2, 6, 7), Case("decode_b3_past9_holes", 3, 1, 9, holes_all=True),
                  Case("prefill_b2_tree", 2, 5, 0)),
    "gqa": (Case("tree_b1_past7_holes", 1, 6, 7, holes_all=True),
            Case("decode_b3_past9_holes", 3, 1, 9, holes_all=True), Case("prefill_b1_causal", 1, 5, 0, chain=True)),
}


@pytest.fixture(scope="module")
def cuda_optimized(exported, tmp_path_factory):
    """``cuda_optimized(kind, float16) -> Path``: the tiny export optimized with --target cuda."""
    cache = {}

    def make(kind="medusa", float16=True):
        if (kind, float16) not in cache:
            out = tmp_path_factory.mktemp(f"cuda-{kind}-{float16}") / "out"
            shutil.copytree(exported(kind), out)
            optimize_export(out, target="cuda", float16=float16, progress=None, time_gain=False)
            cache[kind, float16] = out
        return cache[kind, float16]

    return make


def _ops(path) -> dict:
    counts = {}
    for n in onnx.load(str(path), load_external_data=False).graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


@pytest.mark.parametrize("float16", [True, False])
def test_cuda_target_builds_both_attention_forms(cuda_optimized, float16):
    out = cuda_optimized(float16=float16)
    m = Manifest.read(out)
    base = m.optimization["base"]
    layers = m.source["num_layers"]
    assert base["target"] == "cuda" and base["dtype"] == ("float16" if float16 else "float32")
    forms = base["attention_forms"]
    assert set(forms["candidates"]) == {"attention", "gqa"}
    # no CUDA here: the default, and the line that says how the GPU chooses
    assert forms["chosen"] == "attention" and forms["decided"] == "default" and "--measure-forms" in forms["measure"]
    assert m.attention_form == "attention"  # what the runtime reads
    assert _ops(out / forms["candidates"]["attention"]["file"]).get("Attention") == layers
    gqa = onnx.load(str(out / forms["candidates"]["gqa"]["file"]), load_external_data=False)
    nodes = [n for n in gqa.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(nodes) == layers and all(len(n.input) >= 11 and n.input[10] for n in nodes)  # attention_bias fed
    want = onnx.TensorProto.FLOAT16 if float16 else onnx.TensorProto.FLOAT
    assert {i.type.tensor_type.elem_type for i in gqa.graph.input if i.name.startswith("past_key_values.")} == {want}
    assert C.kv_in_place(m.graphs["base"])  # both forms write the caller's K/V buffers (the device path's contract)


@pytest.mark.parametrize("float16", [False, True])
@pytest.mark.parametrize("form", ["attention", "gqa"])
def test_attention_form_parity_on_the_cpu_ep(exported, cuda_optimized, form, float16):
    """Each form against the raw float32 trace (CPU EP) on the calls it takes: a non-causal tree after
    a past with holes, one token per row of a batch of 3 with holes, a prefill."""
    raw = exported("medusa")
    out = cuda_optimized(float16=float16)
    m_raw, m = Manifest.read(raw), Manifest.read(out)
    tol = TOLERANCES[("float16" if float16 else "float32", "cpu")]
    path = out / m.optimization["base"]["attention_forms"]["candidates"][form]["file"]
    rows = graph_parity(raw / m_raw.graphs["base"].file, path, m_raw.graphs["base"], m.graphs["base"], tol.atol,
                        tol.rtol, vocab=m.source["vocab_size"], cases=FORM_CASES[form])
    worst = max(r.max_abs for r in rows if r.output == C.LOGITS)
    print(f"\n{form} {'float16' if float16 else 'float32'}: max |logits - raw float32| {worst:.3g}")
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]
    assert min(r.top1 for r in rows if r.top1 is not None) == 1.0


def test_gqa_form_refuses_a_batch_of_trees_after_a_past(exported, cuda_optimized):
    """Why a batch of trees always runs the Attention form: GroupQueryAttention's input check (shared
    by its CPU and CUDA kernels) refuses it. A regression guard: if ONNX Runtime lifts it, the GQA form
    could take every call."""
    raw = exported("medusa")
    out = cuda_optimized(float16=False)
    m_raw, m = Manifest.read(raw), Manifest.read(out)
    gqa = out / m.optimization["base"]["attention_forms"]["candidates"]["gqa"]["file"]
    with pytest.raises(Exception, match="batch_size must be 1"):
        graph_parity(raw / m_raw.graphs["base"].file, gqa, m_raw.graphs["base"], m.graphs["base"], 1e-4, 1e-4,
                     vocab=m.source["vocab_size"], cases=(Case("tree_b2_past7", 2, 6, 7),))


def test_measuring_the_forms_records_the_faster(cuda_optimized, tmp_path):
    """The device run's step, on the CPU EP: both forms timed on the same calls, the faster recorded."""
    from exporter.pipeline import measure_attention_forms

    out = tmp_path / "out"
    shutil.copytree(cuda_optimized(float16=False), out)
    rec = measure_attention_forms(out, provider="cpu", repeats=2, progress=None)
    m = Manifest.read(out)  # the schema holds (every candidate file listed, the choice among them)
    forms = m.optimization["base"]["attention_forms"]
    assert forms == rec and forms["decided"] == "measured" and forms["measured"]["provider"] == "cpu"
    assert m.attention_form == forms["chosen"] and m.one_sequence_file == forms["candidates"]["gqa"]["file"]
    calls = forms["measured"]["calls"]
    assert set(calls) == {name for name, *_ in F.measured_calls(forms["candidates"]["gqa"]["max_columns"])}
    totals = forms["measured"]["total_ms"]
    assert forms["chosen"] == min(totals, key=totals.get)


def test_measure_forms_without_cuda_is_one_line(cuda_optimized, exported):
    r = run_module("exporter.optimize", cuda_optimized(float16=False), "--measure-forms")
    one_line(r.returncode, r.stderr, "CUDAExecutionProvider", "GPU machine")
    r = run_module("exporter.optimize", exported("medusa"), "--measure-forms")
    one_line(r.returncode, r.stderr, "no attention forms", "--target cuda")


def test_rows_gate_runs_on_the_target_provider(monkeypatch):
    """The rows gate calls the base on CUDA when optimizing for CUDA on a GPU machine (CUDA
    MatMulNBits has separate M = 1 and M = 2..16 kernels), on the CPU EP otherwise."""
    import onnxruntime as ort

    cuda = OptimizeOptions(target="cuda")
    assert rows_provider(cuda) == ("cuda" if "CUDAExecutionProvider" in ort.get_available_providers() else "cpu")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert rows_provider(cuda) == "cuda"
    assert rows_provider(OptimizeOptions(target="cpu")) == "cpu"


def test_cuda_rows_gate_records_its_provider(cuda_optimized):
    m = Manifest.read(cuda_optimized(float16=False))
    rows = m.validation["optimize"]["rows"]
    assert rows["provider"] == "cpu" and rows["contract"] in ("exact", "recorded bound")


def test_a_form_the_device_cannot_time_leaves_the_export(cuda_optimized, tmp_path, monkeypatch):
    """--measure-forms where a kernel refuses the shapes: one line, the manifest as it was."""
    import onnxruntime as ort

    from exporter.pipeline import measure_attention_forms

    out = tmp_path / "out"
    shutil.copytree(cuda_optimized(float16=False), out)
    before = (out / "manifest.json").read_text()
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])

    def refuse(*_a, **_k):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : head_size not supported\nmore")

    monkeypatch.setattr(F, "measure", refuse)
    with pytest.raises(UserError, match=r"head_size not supported.*untouched"):
        measure_attention_forms(out, provider="cuda", progress=None)
    assert (out / "manifest.json").read_text() == before
