"""python -m exporter.tune: measured trees become the export's default, the manifest stays valid."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
from conftest import run_module

import graphs
from exporter.tune import tune


def _copy(src, tmp_path):
    dst = tmp_path / "out"
    shutil.copytree(src, dst)
    return dst


def test_tune_medusa_records_a_grown_tree(exported, tmp_path):
    out = _copy(exported("medusa"), tmp_path)
    before = graphs.load(out, provider="cpu", threads=1).generate([5, 6, 7], max_new_tokens=12).token_ids
    report = tune(out, prompts=["abc", "xyz"], threads=1, max_new_tokens=12, log=lambda *a, **k: None)
    m = json.loads((out / "manifest.json").read_text())
    assert m["tree"]["medusa_paths"] == report["best"]["medusa_paths"]
    tuned = m["tree"]["tuned"]
    assert tuned["predicted_tokens_per_s"] > 0 and tuned["measured_tokens_per_s"] > 0
    # the manifest records what was predicted and measured, exactly: the best candidate's rate, the
    # confirming run's tokens/s (report["confirmed"] is the record confirm() built from that run)
    assert tuned == json.loads(json.dumps(report["confirmed"]))
    assert tuned["predicted_tokens_per_s"] == report["best"]["predicted_tokens_per_s"] == max(
        c["predicted_tokens_per_s"] for c in report["candidates"])
    assert tuned["autoregressive_tokens_per_s"] == report["autoregressive"]["tokens_per_s"]
    acc = report["medusa_acceptance"]
    assert len(acc) == 2 and all(0 <= a <= 1 for row in acc for a in row)
    dec = graphs.load(out, provider="cpu", threads=1)  # sha256 of every file checked: rehashed
    assert dec.generate([5, 6, 7], max_new_tokens=12).token_ids == before


def test_tune_eagle_bakes_a_new_winner(exported, tiny_model_dir, tmp_path):
    out = _copy(exported("eagle"), tmp_path)
    before = graphs.load(out, provider="cpu", threads=1).generate([5, 6, 7], max_new_tokens=12).token_ids
    report = tune(out, prompts=["abc", "xyz"], threads=1, max_new_tokens=8, budget_s=0.1,
                  model_dir=tiny_model_dir("eagle"), log=lambda *a, **k: None)
    m = json.loads((out / "manifest.json").read_text())
    best = report["best"]
    cfg = {k: best[k] for k in ("topk", "depth", "total_tokens")}
    assert m["tree"]["eagle"] == cfg
    assert best["predicted_tokens_per_s"] == max(c["predicted_tokens_per_s"] for c in report["candidates"])
    assert m["tree"]["tuned"] == json.loads(json.dumps(report["confirmed"]))
    assert m["tree"]["tuned"]["predicted_tokens_per_s"] == best["predicted_tokens_per_s"]
    role = f"draft_tree.{cfg['topk']}-{cfg['depth']}-{cfg['total_tokens']}"
    assert role in m["graphs"] and any(e["graph"] == role for e in m["tree"]["eagle_trees"])
    dec = graphs.load(out, provider="cpu", threads=1, eagle_draft="one_call", adaptive=False)  # baked
    r = dec.generate([5, 6, 7], max_new_tokens=12)
    assert r.token_ids == before and r.stats.draft_calls == r.stats.steps


def test_tune_cli_bad_input(tmp_path):
    r = run_module("exporter.tune", tmp_path / "missing")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "error:" in r.stderr


def test_optimize_retunes_the_tree_for_its_graphs(exported, tmp_path):
    """exporter.optimize re-tunes the default tree on the optimized graphs and records which graphs."""
    from exporter.optimize import optimize_export

    out = _copy(exported("medusa"), tmp_path)
    summary = optimize_export(out, quantize="int4", progress=None, time_gain=False, tune=True,
                              tune_prompts=["abc", "xyz"], tune_threads=1)
    m = json.loads((out / "manifest.json").read_text())
    tuned = m["tree"]["tuned"]
    assert tuned["graphs"]["quantization"] == "int4" and m["optimization"]["base"]["quantization"]["bits"] == 4
    assert tuned["graphs"]["passes"] == m["optimization"]["base"]["passes"]
    assert summary["tune"]["tree"] == m["tree"]["medusa_paths"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tuned on these graphs: no staleness warning
        dec = graphs.load(out, provider="cpu", threads=1)
    r = dec.generate([5, 6, 7], max_new_tokens=12)
    assert r.token_ids == dec.generate([5, 6, 7], max_new_tokens=12, mode="autoregressive").token_ids


def test_a_tree_tuned_on_other_graphs_warns(exported, tmp_path):
    from exporter.optimize import optimize_export

    out = _copy(exported("medusa"), tmp_path)
    tune(out, prompts=["abc"], threads=1, max_new_tokens=8, log=lambda *a, **k: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphs.load(out, provider="cpu", threads=1)  # tuned on these raw graphs: silent
    optimize_export(out, quantize="int8", progress=None, time_gain=False, tune=False)
    passes = "+".join(json.loads((out / "manifest.json").read_text())["optimization"]["base"]["passes"])
    with pytest.warns(RuntimeWarning) as w:
        graphs.load(out, provider="cpu", threads=1)
    (msg,) = [str(x.message) for x in w if "default tree" in str(x.message)]
    assert f"tuned on other base graphs (quantization: none, now int8; optimize passes: none, now {passes})" in msg
    assert "dtype" not in msg and msg.endswith(f"re-tune with python -m exporter.tune {out}"), msg


@pytest.mark.parametrize("was, now, says", [
    # issue 19: after optimize (same dtype, new passes) the warning named the dtype ("tuned on float32 base
    # graphs, these are float32"): it names the passes that changed
    ({"passes": []}, {"passes": ["attention", "rotary", "norms"]}, "optimize passes: none, now attention+rotary+norms"),
    ({"passes": ["attention"]}, {"passes": ["attention", "norms"]}, "optimize passes: attention, now attention+norms"),
    ({"dtype": "float32", "passes": []}, {"dtype": "float16", "passes": ["fp16"]},
     "dtype: float32, now float16; optimize passes: none, now fp16"),
    ({}, {"passes": ["attention"]}, None),  # a record from before passes were recorded proves nothing
    ({"passes": ["norms"]}, {"passes": ["norms"]}, None),
])
def test_the_stale_tree_warning_names_the_real_difference(was, now, says):
    from graphs.sessions import warn_if_tree_stale

    def record(d):
        return {"dtype": d.get("dtype", "float32"), "quantization": None, "passes": d.get("passes", [])}

    tree = {"tuned": {"graphs": {k: v for k, v in record(was).items() if k in was or k == "dtype"}}}
    opt = {"base": {"dtype": now.get("dtype", "float32"), "passes": now.get("passes", [])}}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert warn_if_tree_stale(tree, opt, "float32", "OUT") is (says is not None)
    if says:
        assert f"tuned on other base graphs ({says})" in str(w[0].message), str(w[0].message)


def test_optimize_without_a_drafter_skips_tuning(exported, tmp_path):
    from exporter.optimize import optimize_export

    out = _copy(exported("base"), tmp_path)
    lines = []
    summary = optimize_export(out, progress=lambda *a, **k: lines.append(" ".join(map(str, a))), time_gain=False,
                              tune=True)
    assert summary["tune"] == {"skipped": "no drafter"} and any("no drafter" in x for x in lines)


def test_bench_variants_end_to_end_with_retuned_trees(exported, tmp_path):
    """bench --variants raw,int4 --tune: each variant's tree re-tuned for its graphs, run end to end
    through the bench's own systems (regression: this path imported helpers the bench no longer had)."""
    from exporter.benchmark.variants import run_variants

    out = _copy(exported("medusa"), tmp_path)
    rep = run_variants(out, ["raw", "int4"], tree_tokens=(1, 4), past=8, max_new_tokens=6, repeats=1, prompts=1,
                       threads=1, tune=True, log=lambda *a, **k: None)
    assert set(rep["verify_latency"]) == {"raw", "int4"}
    for name in ("raw", "int4"):
        row = rep["end_to_end"][name]
        assert row["greedy_mismatches"] == 0
        assert row["autoregressive_tokens_per_s"] > 0 and row["speculative_tokens_per_s"] > 0
        assert row["tree"]["tuned"]["graphs"]["quantization"] == (None if name == "raw" else "int4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the variant copies are cleaned up
