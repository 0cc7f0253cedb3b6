"""compare is the gate for every pass, so it must not share a bug with what it checks (issue 7).

Regression tests for the two mutations that used to pass the whole suite: the EAGLE-3 auxiliary
hidden states traced from the wrong layers, and a case whose ONNX Runtime run raised being skipped.
Plus: the independent reference (HF's own forward and cache) runs none of the exporter's modelling
code, and the e2e CLI refuses an empty prompt with one line (issue 10).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import DRAFTERS, build_tiny_model

import exporter.compare as cmp
import exporter.modeling
import exporter.trace
import exporter.validate
from exporter.export import export
from exporter.hf_reference import configured_aux_layers, hf_base_cases
from exporter.loading import UserError
from exporter.plan import graph_specs
from exporter.trace import BaseGraph
from graphs import contract as C

HF_CASES = {"hf_prefill_b2", "hf_step1_b2", "hf_step2_b2", "hf_step3_b2", "hf_chunk4_b2"}
QUIET = dict(log=lambda *a, **k: None)


def run_compare(capsys, *args) -> tuple[int, str, str]:
    try:
        rc = cmp.main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def eagle3_model(aux_ids=None):
    """The fixtures' tiny EAGLE-3 model, or the same with other aux layer ids."""
    if aux_ids is None:
        return build_tiny_model("llama", "eagle3")
    from tiny import tiny_model

    from exporter.speculative import convert

    kind, cfg = DRAFTERS["eagle3"]
    model = tiny_model("llama", seed=0)
    torch.manual_seed(1)
    return convert(model, [(kind, {**cfg, "eagle_aux_hidden_state_layer_ids": aux_ids})]).eval()


# ----------------------------------------------------------------------------- the reference itself


def test_hf_reference_runs_none_of_the_exporters_modelling_code(monkeypatch):
    """With every exporter forward path broken, the HF reference still runs: it shares no code with the trace."""
    model = eagle3_model()
    spec = graph_specs(model, "float32")["base"]

    def broken(*a, **k):
        raise AssertionError("the independent reference called the exporter's modelling code")

    monkeypatch.setattr(exporter.modeling, "base_forward", broken)
    monkeypatch.setattr(exporter.modeling, "run_layers", broken)
    monkeypatch.setattr(exporter.modeling.NewRowsCache, "update", broken)
    monkeypatch.setattr(exporter.trace.BaseGraph, "forward", broken)
    monkeypatch.setattr(exporter.trace, "aux_layer_ids", broken)
    cases = hf_base_cases(model, spec)
    assert [c.name for c in cases] == ["hf_prefill_b2", "hf_step1_b2", "hf_step2_b2", "hf_step3_b2", "hf_chunk4_b2"]
    n_layers = model.config.num_hidden_layers
    kv = {f(i) for i in range(n_layers) for f in (C.present_key, C.present_value)}
    want = {C.LOGITS, C.HIDDEN, C.AUX_HIDDEN} | kv
    for c in cases:
        assert set(c.ref) == want
        assert [tuple(x.shape) for x in c.inputs[:3]] == [
            tuple(c.ref[C.LOGITS].shape[:2]), tuple(c.ref[C.LOGITS].shape[:2]),
            (2, 1, c.ref[C.LOGITS].shape[1], c.inputs[3].shape[2] + c.ref[C.LOGITS].shape[1])]
    assert [c.inputs[3].shape[2] for c in cases] == [0, 7, 8, 9, 10]  # the past grows: prefill, 3 steps, chunk


@pytest.mark.parametrize("aux_ids", [None, [0, 2, 3]], ids=["default-layers", "with-last-layer"])
def test_hf_reference_agrees_with_the_traced_reference_on_causal_input(aux_ids):
    """Unmutated, both references agree, including an aux id on the last layer (HF's tuple holds it normed)."""
    model = eagle3_model(aux_ids)
    if aux_ids is not None:
        assert configured_aux_layers(model) == (0, 2, 3)
    spec = graph_specs(model, "float32")["base"]
    traced = BaseGraph(model)
    for c in hf_base_cases(model, spec):
        with torch.no_grad():
            out = dict(zip(spec.output_names, (t.numpy() for t in traced(*c.inputs))))
        for name, ref in c.ref.items():
            np.testing.assert_allclose(out[name], ref, atol=2e-5, rtol=1e-4, err_msg=f"{c.name}/{name}")


# ----------------------------------------------------------------------------- mutation 1: aux layers


def test_aux_layers_shifted_by_one_fail_compare_and_export(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The mutation from issue 7: the traced graph's aux states taken one layer too deep.

    The traced reference shares the bug (its tree-mask rows still pass, which is why the mutation was
    invisible); the HF reference fails every causal case on aux_hidden_states, so export refuses
    to write the graphs and compare exits 1.
    """
    model_dir = tiny_model_dir("eagle3")
    original = exporter.trace.aux_layer_ids
    monkeypatch.setattr(exporter.trace, "aux_layer_ids", lambda model: tuple(i + 1 for i in original(model)))

    with pytest.raises(UserError, match=r"aux_hidden_states in case hf_"):
        export(model_dir, tmp_path / "refused", **QUIET)
    assert not (tmp_path / "refused").exists()

    out = tmp_path / "mutant"
    export(model_dir, out, validate=False, **QUIET)
    report = cmp.compare(model_dir, out)
    assert not report.ok
    failed = {(r.graph, r.case, r.output) for r in report.failures()}
    assert {case for _, case, _ in failed} == HF_CASES
    assert {(g, o) for g, _, o in failed} == {("base", C.AUX_HIDDEN)}
    assert all(r.ok for r in report.rows if not r.case.startswith("hf_"))  # the shared-code reference is blind

    rc, stdout, err = run_compare(capsys, model_dir, out)
    assert rc == 1 and err == ""
    assert any("hf_step1_b2" in line and "aux_hidden_states" in line and "FAIL" in line
               for line in stdout.splitlines())


# ----------------------------------------------------------------------------- mutation 2: errors


def _int32_ids(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same case with int32 token ids: PyTorch runs it, ONNX Runtime refuses it (the contract says int64)."""
    return [inputs[0].to(torch.int32), *inputs[1:]]


@pytest.mark.parametrize("target", ["tree_b2_past6", "hf_step2_b2"])
def test_case_whose_onnx_run_raises_is_a_failure_not_a_skip(exported, tiny_model_dir, tmp_path, monkeypatch,
                                                             capsys, target):
    model_dir, out_dir = tiny_model_dir("eagle3"), exported("eagle3")  # exported before the patch
    base_cases, hf_cases = exporter.validate.base_cases, exporter.validate.hf_base_cases

    def patched_base_cases(*a, **k):
        return [(name, _int32_ids(x) if name == target else x) for name, x in base_cases(*a, **k)]

    def patched_hf_cases(*a, **k):
        cases = hf_cases(*a, **k)
        for c in cases:
            if c.name == target:
                c.inputs = _int32_ids(c.inputs)
        return cases

    monkeypatch.setattr(exporter.validate, "base_cases", patched_base_cases)
    monkeypatch.setattr(exporter.validate, "hf_base_cases", patched_hf_cases)
    report_file = tmp_path / "report.json"
    rc, out, err = run_compare(capsys, model_dir, out_dir, "--json", report_file)
    assert rc == 1, out + err
    assert err == ""
    error_lines = [line for line in out.splitlines() if "ERROR:" in line]
    assert len(error_lines) == 1 and error_lines[0].split()[:2] == ["base", target], out
    assert "FAIL" in error_lines[0] and out.strip().splitlines()[-1].startswith("FAIL: 1 output(s)")
    report = json.loads(report_file.read_text())
    assert report["ok"] is False
    bad = [r for r in report["rows"] if not r["ok"]]
    assert len(bad) == 1 and bad[0]["case"] == target and bad[0]["check"] == "error"
    assert "int32" in bad[0]["error"] or "tensor(int" in bad[0]["error"], bad[0]["error"]
    # every other case still ran and was reported
    cases = {r["case"] for r in report["rows"] if r["graph"] == "base"}
    assert cases == {"prefill", "decode", "tree_b2_past6", "batch2_holes"} | HF_CASES


def test_reference_that_raises_is_a_failure(exported, tiny_model_dir, monkeypatch):
    model_dir, out_dir = tiny_model_dir("medusa"), exported("medusa")  # exported before the patch

    def boom(*a, **k):
        raise RuntimeError("HF changed its cache API")

    monkeypatch.setattr(exporter.validate, "hf_base_cases", boom)
    report = cmp.compare(model_dir, out_dir)
    assert not report.ok
    (bad,) = report.failures()
    assert (bad.graph, bad.case, bad.check) == ("base", "hf_reference", "error")
    assert bad.error == "RuntimeError: HF changed its cache API"
    assert "ERROR: RuntimeError: HF changed its cache API" in report.table()


# ----------------------------------------------------------------------------- e2e (issue 10)


def test_e2e_empty_prompt_is_one_line_error(exported, tiny_model_dir, capsys):
    rc, out, err = run_compare(capsys, tiny_model_dir("medusa"), exported("medusa"), "--e2e", "--prompt", "")
    assert rc == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0] == "error: --prompt #1 is empty; give each prompt at least one token of text"
    assert "Traceback" not in err and out == ""


def test_e2e_library_refuses_empty_prompts():
    from exporter.e2e import check_prompts

    check_prompts(None)
    check_prompts(["a", [3, 4]])
    for bad in ([""], ["ok", []]):
        with pytest.raises(UserError, match="is empty"):
            check_prompts(bad)

