"""python -m exporter.tune: measured trees become the export's default, the manifest stays valid."""

from __future__ import annotations

import json
import shutil

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
    role = f"draft_tree.{cfg['topk']}-{cfg['depth']}-{cfg['total_tokens']}"
    assert role in m["graphs"] and any(e["graph"] == role for e in m["tree"]["eagle_trees"])
    dec = graphs.load(out, provider="cpu", threads=1, eagle_draft="one_call", adaptive=False)  # baked
    r = dec.generate([5, 6, 7], max_new_tokens=12)
    assert r.token_ids == before and r.stats.draft_calls == r.stats.steps


def test_tune_cli_bad_input(tmp_path):
    r = run_module("exporter.tune", tmp_path / "missing")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "error:" in r.stderr
