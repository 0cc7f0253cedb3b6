"""A quantized base is a different model: compare reports its distance from PyTorch, not bit-parity.

The quantized graphs are made here with ONNX Runtime's own ``MatMulNBitsQuantizer`` on a tiny
export (independently of ``exporter.optimize``), the manifest rehashed and, where the test says so,
given the ``optimization`` entry the optimize stage writes.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from test_compare import run_compare

from exporter.compare import compare
from exporter.compare_report import TOLERANCES
from exporter.distance import QUALITY, Quality, logits_distance, perplexity
from exporter.validate import _role_dtype
from graphs import contract as C
from graphs.manifest import MANIFEST, Manifest


def quantize_base(src, dst, bits: int, declare: bool = True, lm_head_noise: float = 0.0):
    """Copy an export and quantize its base graph's MatMuls to ``bits`` (block 32); rehash the manifest."""
    pytest.importorskip("onnx_ir", reason="onnxruntime's MatMulNBitsQuantizer needs onnx-ir (pip install onnx-ir)")
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    shutil.copytree(src, dst)
    manifest = Manifest.read(dst)
    path = dst / manifest.graphs["base"].file
    proto = onnx.load(str(path))
    if lm_head_noise:  # a broken quantization: far more than rounding moved the lm_head
        node = next(n for n in proto.graph.node if n.name == "/lm_head/MatMul")
        init = next(t for t in proto.graph.initializer if t.name in node.input)
        w = numpy_helper.to_array(init)
        noise = np.random.default_rng(0).standard_normal(w.shape) * lm_head_noise
        init.CopyFrom(numpy_helper.from_array((w + noise).astype(w.dtype), init.name))
    quant = MatMulNBitsQuantizer(proto, bits=bits, block_size=32, is_symmetric=True, accuracy_level=4)
    quant.process()
    quant.model.save_model_to_file(str(path), False)
    assert any(n.op_type == "MatMulNBits" for n in onnx.load(str(path)).graph.node)
    manifest.write(dst)
    if declare:  # the entry exporter.optimize writes (its Manifest may not know the field yet: raw JSON)
        data = json.loads((dst / MANIFEST).read_text())
        data["optimization"] = {
            "base": {"passes": ["matmul_nbits"], "target": "cpu", "dtype": "float32", "quantization": f"int{bits}"},
        }
        (dst / MANIFEST).write_text(json.dumps(data, indent=2) + "\n")
    return dst




@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_base_reports_distance_not_parity(exported, tiny_model_dir, tmp_path, capsys, bits):
    out = quantize_base(exported("medusa"), tmp_path / f"int{bits}", bits)
    report_file = tmp_path / "report.json"
    rc, stdout, err = run_compare(capsys, tiny_model_dir("medusa"), out, "--json", report_file)
    assert rc == 0, stdout + err
    assert f"distance, not bit-parity: quantized graphs (base int{bits}) are a different model" in stdout
    assert "held-out text, teacher-forced" in stdout and "perplexity" in stdout
    report = json.loads(report_file.read_text())
    assert report["ok"] is True and report["parity"] is False
    assert report["quantization"] == {"base": f"int{bits}", "draft": "none"}
    base = [r for r in report["rows"] if r["graph"] == "base"]
    logits = [r for r in base if r["output"] == C.LOGITS]
    assert {r["check"] for r in logits} == {"distance"}
    assert {r["check"] for r in base if r["output"] != C.LOGITS} == {"info"}
    assert all(r["kl"] is not None and r["kl"] <= QUALITY[f"int{bits}"].kl for r in logits)
    assert max(r["max_abs"] for r in logits) > 1e-4  # really a different model: parity would have failed
    # the other graphs are still held to float32 parity
    assert {r["check"] for r in report["rows"] if r["graph"] != "base"} == {"parity"}
    (d,) = report["distance"]
    assert d["graph"] == "base" and d["quantization"] == f"int{bits}" and d["text"] == "built-in held-out text"
    assert d["tokens"] == 128 and d["ok"] is True and d["quality"]["kl"] == QUALITY[f"int{bits}"].kl
    assert 0 <= d["mean_kl"] <= QUALITY[f"int{bits}"].kl and 0 <= d["top1"] <= 1
    assert d["ppl_onnx"] / d["ppl_torch"] == pytest.approx(d["ppl_ratio"])


def test_declared_records_without_quantization_mean_none(exported, tmp_path):
    from exporter.distance import graph_quantization

    out = tmp_path / "declared"
    shutil.copytree(exported("medusa"), out)
    data = json.loads((out / MANIFEST).read_text())
    data["optimization"] = {"base": {"passes": ["rms_norm"], "dtype": "float32", "quantization": "none"},
                            "kv_update": {"passes": ["float16"], "dtype": "float16", "quantization": None}}
    (out / MANIFEST).write_text(json.dumps(data))
    assert graph_quantization(out, Manifest.read(out)) == {"base": "none", "draft": "none"}


@pytest.mark.parametrize(("value", "name"), [
    (None, "none"), ("", "none"), ("none", "none"), ("INT4", "int4"), ("int8", "int8"),
    ({"method": "matmulnbits", "bits": 4, "block_size": 32, "accuracy_level": 4}, "int4"),  # exporter.optimize's
    ({"method": "matmulnbits", "bits": 8}, "int8"), ({"method": "gptq"}, "gptq"),
])
def test_quantization_record_names(value, name):
    from exporter.distance import quality_for, quantization_name

    assert quantization_name(value) == name
    assert quality_for(name) == QUALITY.get(name, QUALITY["int4"])


def test_undeclared_quantization_is_found_in_the_graph(exported, tiny_model_dir, tmp_path):
    """A manifest without the optimization entry (or saying "none") cannot make a quantized graph claim parity."""
    out = quantize_base(exported("medusa"), tmp_path / "undeclared", 4, declare=False)
    report = compare(tiny_model_dir("medusa"), out)
    assert report.quantization["base"] == "undeclared (MatMulNBits)"
    assert report.quantized == ["base"] and report.to_json()["parity"] is False
    assert report.distance and report.distance[0].quality == vars(QUALITY["int4"])  # the loosest row
    assert report.ok, report.table()


def test_broken_quantized_base_fails_its_quality_thresholds(exported, tiny_model_dir, tmp_path, capsys):
    out = quantize_base(exported("medusa"), tmp_path / "broken", 4, lm_head_noise=0.5)
    rc, stdout, err = run_compare(capsys, tiny_model_dir("medusa"), out)
    assert rc == 1 and err == ""
    assert "FAIL (quality: top1_decided>=" in stdout
    report = compare(tiny_model_dir("medusa"), out)
    assert not report.ok
    assert {(r.graph, r.output, r.check) for r in report.failures()} == {("base", C.LOGITS, "distance")}
    assert all(r.kl > QUALITY["int4"].kl for r in report.failures())
    assert not report.distance[0].ok and report.distance[0].mean_kl > QUALITY["int4"].kl


def test_raw_export_keeps_parity_and_distance_on_request(exported, tiny_model_dir, capsys, tmp_path):
    model_dir, out = tiny_model_dir("medusa"), exported("medusa")
    report = compare(model_dir, out)
    assert report.quantization == {"base": "none", "draft": "none"}
    assert report.distance == [] and report.to_json()["parity"] is True
    assert {r.check for r in report.rows} == {"parity"}
    text = tmp_path / "held_out.txt"
    text.write_text("for line in open(path):\n    print(line.rstrip())\n")
    rc, stdout, err = run_compare(capsys, model_dir, out, "--distance", "--text", text, "--json", tmp_path / "r.json")
    assert rc == 0, stdout + err
    (d,) = json.loads((tmp_path / "r.json").read_text())["distance"]
    assert d["quantization"] == "none" and d["text"] == "--text" and d["tokens"] == len(text.read_text())
    assert d["mean_kl"] < 1e-8 and d["top1"] == 1.0 and d["ppl_ratio"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("content", [None, b"", b"\xff\xfe\xfa"])
def test_bad_text_file_is_one_line_error(exported, tiny_model_dir, tmp_path, capsys, content):
    path = tmp_path / "text.txt"
    if content is not None:
        path.write_bytes(content)
    rc, out, err = run_compare(capsys, tiny_model_dir("medusa"), exported("medusa"), "--text", path)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --text {path} "), err


# ----------------------------------------------------------------------------- the measures


def test_top1_counts_only_positions_the_reference_has_decided():
    ref = np.zeros((1, 3, 4))
    ref[0, 0] = [5.0, 0, 0, 0]  # decided: p(top) - p(runner-up) ~ 0.95
    ref[0, 1] = [1.0, 1.0 - 1e-3, 0, 0]  # a near tie
    ref[0, 2] = [0.0, 0.0, 0.0, 1e-3]  # almost uniform
    got = ref.copy()
    got[0, 1] = [1.0 - 1e-3, 1.0, 0, 0]  # flips the tie: costs almost nothing
    d = logits_distance(ref, got, margin=0.1)
    assert d.top1 == pytest.approx(2 / 3) and d.decided == 1 and d.top1_decided == 1.0
    assert d.kl < 1e-6 and d.ok(Quality(top1=0.99, kl=1e-3, ppl_ratio=1.1))
    got[0, 0] = [0, 5.0, 0, 0]  # flips the decided position: fails top-1 and KL
    d = logits_distance(ref, got, margin=0.1)
    assert d.top1_decided == 0.0 and d.kl > 1.0 and not d.ok(Quality(top1=0.5, kl=10.0, ppl_ratio=1.1))
    none = logits_distance(ref[:, 1:], ref[:, 1:], margin=0.1)
    assert none.decided == 0 and none.top1_decided is None and none.ok(Quality(top1=1.0, kl=0.0, ppl_ratio=1.0))


def test_perplexity_of_a_known_distribution():
    logits = np.log(np.array([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25], [1.0, 1.0, 1.0]]))
    assert perplexity(logits, np.array([0, 1, 0])) == pytest.approx(np.exp(-(np.log(0.25) + np.log(0.5)) / 2))


def test_an_optimized_float16_graph_gets_float16_tolerances():
    spec = C.base_graph_spec(C.ModelDims(num_layers=1, num_kv_heads=1, head_dim=4, hidden_size=8, vocab_size=16,
                                         dtype="float32"))
    assert _role_dtype(None, spec) == "float32"
    assert _role_dtype({"dtype": "float16", "quantization": "none"}, spec) == "float16"
    assert _role_dtype({"dtype": "mixed"}, spec) == "float32"  # unknown: the graph's own I/O dtype
    assert TOLERANCES[("float16", "cpu")].atol > TOLERANCES[("float32", "cpu")].atol


# ----------------------------------------------------------------------------- e2e on a quantized base


def test_e2e_on_a_quantized_base_gates_speculative_against_its_own_greedy(exported, tiny_model_dir, tmp_path,
                                                                         capsys):
    """Lossless relative to the quantized base: speculative == autoregressive of the same graphs, PyTorch reported."""
    out = quantize_base(exported("medusa"), tmp_path / "int4", 4)
    report_file = tmp_path / "e2e.json"
    rc, stdout, err = run_compare(capsys, tiny_model_dir("medusa"), out, "--e2e", "--max-new-tokens", 8,
                                  "--json", report_file)
    assert rc == 0, stdout + err
    assert "on the same quantized graphs" in stdout and "PyTorch agrees on the first" in stdout
    rows = json.loads(report_file.read_text())["rows"]
    assert len(rows) == 4
    for row in rows:
        assert row["quantized"] is True and row["speculative_tokens"] == row["autoregressive_tokens"]
        assert 0 <= row["torch_agreement"] <= len(row["torch_tokens"])


def test_e2e_quantized_rows_gate_only_the_same_graphs():
    from exporter.e2e import TokenRow, _first_mismatch, table

    torch_tokens, spec, ar = [1, 2, 3], [1, 5, 6], [1, 5, 6]
    row = TokenRow("p", torch_tokens, spec, ar, _first_mismatch(spec, ar), 2.0, quantized=True, torch_agreement=1)
    assert row.ok and "PyTorch agrees on the first 1 of 3" in table([row]) and "PASS" in table([row])
    bad = TokenRow("p", torch_tokens, [1, 5, 7], ar, _first_mismatch([1, 5, 7], ar), 2.0, quantized=True,
                   torch_agreement=1)
    assert not bad.ok and "DIFFER at new token 2" in table([bad]) and "FAIL" in table([bad])
