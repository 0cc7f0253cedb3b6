"""python -m exporter.compare: the report (table, JSON), its exit code, and compare_arrays."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from conftest import run_module
from onnx import numpy_helper

from exporter.compare import main as compare_main
from exporter.compare_report import TOLERANCES, Tolerance, compare_arrays
from graphs.manifest import Manifest

TRACED_CASES = {"prefill", "decode", "tree_b2_past6", "batch2_holes"}
HF_CASES = {"hf_prefill_b2", "hf_step1_b2", "hf_step2_b2", "hf_step3_b2", "hf_chunk4_b2"}  # HF's own forward
BASE_CASES = TRACED_CASES | HF_CASES
DRAFT_CASES = {"medusa": {"heads_b2_tree"}, "eagle": {"context_b2", "tree_b2_past5"},
               "eagle3": {"context_b2", "tree_b2_past5"}}


def run_compare(capsys, *args) -> tuple[int, str, str]:
    try:
        rc = compare_main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_report_json(report: dict, kind: str) -> None:
    assert report["ok"] is True and report["dtype"] == "float32" and report["device"] == "cpu"
    assert report["tolerance"] == {"atol": 1e-4, "rtol": 1e-4, "top1": 0.99}
    assert set(report["tolerances"]) == set(report["quantization"]) and report["parity"] is True
    assert set(report["quantization"].values()) == {"none"} and report["distance"] == []
    rows = report["rows"]
    cases = {(r["graph"], r["case"]) for r in rows}
    assert {c for g, c in cases if g == "base"} == BASE_CASES
    assert {c for g, c in cases if g == "draft"} == DRAFT_CASES[kind]
    keys = {"graph", "case", "output", "shape", "max_abs", "max_rel", "where", "torch_value", "onnx_value",
            "top1", "limit", "ok", "check", "kl", "top1_decided", "error"}
    assert {r["check"] for r in rows} == {"parity"}
    assert all(set(r) == keys for r in rows)
    logits = [r for r in rows if r["output"] == "logits"]
    assert logits and all(r["top1"] == 1.0 and r["max_abs"] < 1e-4 for r in logits)
    base_outputs = {r["output"] for r in rows if r["graph"] == "base"}
    assert {"logits", "hidden_states", "present.0.key", "present.3.value"} <= base_outputs
    hf_outputs = {r["output"] for r in rows if r["case"] in HF_CASES}
    assert {"logits", "hidden_states", "present.0.key", "present.3.value"} <= hf_outputs
    assert ("aux_hidden_states" in hf_outputs) == (kind == "eagle3")


def test_cli_subprocess_writes_json(exported, tiny_model_dir, tmp_path):
    out_dir = exported("medusa")
    report_file = tmp_path / "report.json"
    proc = run_module("exporter.compare", tiny_model_dir("medusa"), out_dir, "--json", report_file)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "PASS (float32 on cpu" in proc.stdout
    for word in ("max_abs", "max_rel", "top1", "where", "tree_b2_past6", "heads_b2_tree", "hf_step1_b2"):
        assert word in proc.stdout
    assert_report_json(json.loads(report_file.read_text()), "medusa")


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_cli_in_process_eagle(exported, tiny_model_dir, tmp_path, capsys, kind):
    report_file = tmp_path / "report.json"
    rc, out, err = run_compare(capsys, tiny_model_dir(kind), exported(kind), "--json", report_file)
    assert rc == 0, err
    assert "PASS" in out
    report = json.loads(report_file.read_text())
    assert_report_json(report, kind)
    outputs = {r["output"] for r in report["rows"] if r["graph"] == "draft"}
    assert {"hidden_states_out", "logits", "topk_ids", "topk_logprobs", "present.0.key"} <= outputs


def _tamper(out_dir, dst, node_name: str, noise: float, rehash: bool = True):
    """Copy an export, add ``noise`` to the weight feeding ``node_name`` and (optionally) fix the hashes."""
    shutil.copytree(out_dir, dst)
    manifest = Manifest.read(dst)
    role = "draft" if node_name.startswith("/medusa") else "base"
    path = dst / manifest.graphs[role].file
    proto = onnx.load(str(path))
    node = next(n for n in proto.graph.node if n.name == node_name)
    init = next(t for t in proto.graph.initializer if t.name in node.input)
    w = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array((w + noise).astype(w.dtype), init.name))
    onnx.save(proto, str(path))
    if rehash:
        manifest.write(dst)
    return dst


@pytest.mark.parametrize(("node", "graph"), [("/lm_head/MatMul", "base"), ("/medusa_heads.0/lm_head/MatMul", "draft")])
def test_tampered_graph_fails_and_names_the_output(exported, tiny_model_dir, tmp_path, capsys, node, graph):
    bad = _tamper(exported("medusa"), tmp_path / "tampered", node, noise=0.05)
    report_file = tmp_path / "report.json"
    rc, out, err = run_compare(capsys, tiny_model_dir("medusa"), bad, "--json", report_file)
    assert rc == 1, out + err
    assert err == ""
    fail_lines = [line for line in out.splitlines() if "FAIL (limit" in line]
    assert fail_lines and all(line.split()[0] == graph for line in fail_lines)
    assert any(line.split()[2] == "logits" for line in fail_lines)
    assert out.strip().splitlines()[-1].startswith("FAIL: ")
    report = json.loads(report_file.read_text())
    assert report["ok"] is False
    failed = {(r["graph"], r["output"]) for r in report["rows"] if not r["ok"]}
    assert (graph, "logits") in failed
    if graph == "base":  # hidden states and K/V come before lm_head: untouched
        assert not any(o.startswith(("present.", "hidden")) for _, o in failed)


def test_tampered_without_rehash_is_refused(exported, tiny_model_dir, tmp_path, capsys):
    bad = _tamper(exported("medusa"), tmp_path / "tampered", "/lm_head/MatMul", noise=0.05, rehash=False)
    rc, _, err = run_compare(capsys, tiny_model_dir("medusa"), bad)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "sha256" in lines[0]


@pytest.mark.parametrize(
    ("model", "out", "fragment"),
    [
        (("medusa", "llama"), "missing", "is not a directory"),
        (("base", "llama"), ("medusa", "llama"), "exports to ['base']"),
        (("eagle", "llama"), ("eagle3", "llama"), "does not have this model's inputs/outputs"),
    ],
)
def test_compare_bad_input(exported, tiny_model_dir, tmp_path, capsys, model, out, fragment):
    out_dir = tmp_path / "missing" if out == "missing" else exported(*out)
    rc, _, err = run_compare(capsys, tiny_model_dir(*model), out_dir)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err


# ----------------------------------------------------------------------------- compare_arrays

TOL = Tolerance(atol=1e-3, rtol=0.0, top1=0.99)


def test_compare_arrays_where_and_max_abs():
    ref = np.zeros((2, 3, 4), np.float32)
    got = ref.copy()
    got[1, 2, 3] = 0.5
    got[0, 0, 0] = -0.1
    r = compare_arrays(ref, got, TOL, "hidden_states")
    assert r["where"] == [1, 2, 3]
    assert r["max_abs"] == pytest.approx(0.5)
    assert (r["torch_value"], r["onnx_value"]) == (0.0, pytest.approx(0.5))
    assert r["max_rel"] == pytest.approx(0.5 / TOL.atol)  # relative to max(|ref|, atol)
    assert r["top1"] is None and r["ok"] is False
    assert r["limit"] == pytest.approx(1e-3)


def test_compare_arrays_within_tolerance():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((2, 5, 16)).astype(np.float32)
    got = ref + 1e-5
    r = compare_arrays(ref, got, TOLERANCES[("float32", "cpu")], "logits")
    assert r["ok"] is True and r["top1"] == 1.0
    assert r["max_abs"] == pytest.approx(1e-5, rel=1e-2)


def test_compare_arrays_top1_agreement():
    ref = np.zeros((1, 4, 3), np.float32)
    ref[..., 0] = 1.0  # argmax 0 everywhere, a near tie with column 1
    ref[..., 1] = 1.0 - 2e-4
    got = ref.copy()
    got[0, 3, 1] = 1.0 + 2e-4  # within atol, but flips one argmax of four
    r = compare_arrays(ref, got, TOL, "logits")
    assert r["top1"] == pytest.approx(0.75)
    assert r["max_abs"] <= r["limit"]
    assert r["ok"] is False  # top1 0.75 < 0.99
    r = compare_arrays(ref, got, Tolerance(atol=1e-3, rtol=0.0, top1=0.7), "logits")
    assert r["ok"] is True


def test_compare_arrays_minus_inf_on_both_sides_agrees_on_one_side_fails():
    """A DFlash draft vocabulary's logits are -inf outside it: the same -inf on both sides is exact
    agreement (errors over the rest); -inf against a number, or a nan, fails."""
    ref = np.array([[-np.inf, -3.0, -2.0, -np.inf]])
    r = compare_arrays(ref, ref + np.array([[0.0, 1e-6, 0.0, 0.0]]), TOL, "logits")
    assert r["ok"] is True and r["max_abs"] < 1e-5 and r["top1"] == 1.0 and np.isfinite(r["max_rel"])
    for got in ([[-3.0, -3.0, -2.0, -np.inf]], [[-np.inf, -3.0, np.nan, -np.inf]], [[np.inf, -3.0, -2.0, -np.inf]]):
        r = compare_arrays(ref, np.array(got), TOL, "logits")
        assert r["ok"] is False and r["max_abs"] == np.inf, got


def test_compare_arrays_rtol_scales_with_the_reference():
    ref = np.full((3,), 100.0, np.float32)
    got = ref + 0.05
    assert compare_arrays(ref, got, Tolerance(atol=1e-3, rtol=1e-3, top1=0.0), "x")["ok"] is True
    assert compare_arrays(ref, got, Tolerance(atol=1e-3, rtol=1e-4, top1=0.0), "x")["ok"] is False


def test_compare_arrays_non_finite_shape_and_empty():
    ref = np.ones((2, 2), np.float32)
    got = ref.copy()
    got[0, 1] = np.nan
    assert compare_arrays(ref, got, TOL, "x")["ok"] is False
    r = compare_arrays(ref, np.ones((2, 3), np.float32), TOL, "x")
    assert r["ok"] is False and r["max_abs"] == float("inf")
    r = compare_arrays(np.ones((0, 4)), np.ones((0, 4)), TOL, "x")
    assert r["ok"] is True and r["max_abs"] == 0.0


def test_compare_arrays_topk_ids_are_agreement_only():
    ref = np.array([[3, 1], [2, 0]])
    got = np.array([[3, 1], [0, 2]])  # tied scores may come out in either order
    r = compare_arrays(ref, got, TOL, "topk_ids")
    assert r["ok"] is True and r["top1"] == pytest.approx(0.5)


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_e2e_tokens_match(capsys, exported, tiny_model_dir, tmp_path, kind):
    """--e2e: PyTorch greedy tokens == runtime speculative == runtime autoregressive, per prompt."""
    report_file = tmp_path / "e2e.json"
    rc, out, err = run_compare(capsys, tiny_model_dir(kind), exported(kind), "--e2e", "--max-new-tokens", 12,
                               "--json", report_file)
    assert rc == 0, err
    assert "PASS: greedy tokens identical" in out
    report = json.loads(report_file.read_text())
    assert report["ok"] and len(report["rows"]) == 4
    for row in report["rows"]:
        assert row["torch_tokens"] == row["speculative_tokens"] == row["autoregressive_tokens"]
        assert len(row["torch_tokens"]) == 12 or row["torch_tokens"][-1] == 2  # length, or stopped at EOS


def test_e2e_reports_a_divergence():
    from exporter.e2e import TokenRow, _first_mismatch, table

    assert _first_mismatch([1, 2, 3], [1, 2, 3], [1, 2, 3]) is None
    assert _first_mismatch([1, 2, 3], [1, 5, 3], [1, 2, 3]) == 1
    assert _first_mismatch([1, 2], [1, 2, 3], [1, 2]) == 2
    row = TokenRow("p", [1, 2], [1, 3], [1, 2], 1, 1.5)
    assert "DIFFER at new token 1" in table([row]) and "FAIL" in table([row])
