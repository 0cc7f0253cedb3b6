"""The one-call EAGLE tree graph: export flag, manifest entries, load options, bad input.

Its trees are checked against the PyTorch drafting reference in tests/test_runtime.py
(test_drafts_equal_the_pytorch_reference, draft="one_call").
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from conftest import run_module

import graphs
from exporter.eagle_tree import check_tree, parse_tree
from exporter.loading import UserError
from graphs import contract as C
from graphs.trees import Tree


def test_parse_tree():
    assert parse_tree("2,3,6") == (2, 3, 6)
    for bad in ("2,3", "a,b,c", "0,3,6", "2,3,0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_tree(bad)
    check_tree(2, 1, 7)  # root + 2 + 2*2 drafted nodes
    with pytest.raises(UserError, match="at most 7"):
        check_tree(2, 1, 8)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_export_bakes_the_default_tree(exported, kind):
    out = exported(kind)
    m = json.loads((out / "manifest.json").read_text())
    role = C.eagle_tree_role(2, 3, 6)
    assert m["tree"]["eagle_trees"] == [{"topk": 2, "depth": 3, "total_tokens": 6, "graph": role}]
    spec = m["graphs"][role]
    assert spec["file"] in m["files"]
    names = [t["name"] for t in spec["outputs"]][:5]
    assert names == [C.TREE_TOKENS, C.TREE_PARENTS, C.TREE_DEPTH, C.TREE_SCORES, C.TREE_MASK]
    assert [t["dims"] for t in spec["outputs"][:5]] == [["batch", 6]] * 4 + [["batch", 6, 6]]
    feat = C.AUX_HIDDEN if kind == "eagle3" else C.HIDDEN
    assert spec["inputs"][0]["name"] == feat
    assert any(k.startswith(role + "/") for k in m["validation"]["max_abs"])  # checked against PyTorch


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_one_call_and_stepwise_agree_in_a_batch(exported, kind):
    out = exported(kind)
    one = graphs.load(out, provider="cpu", threads=1, eagle_draft="one_call", adaptive=False)
    step = graphs.load(out, provider="cpu", threads=1, eagle_draft="stepwise", adaptive=False)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3]]
    bound = graphs.load(out, provider="cpu", threads=1, eagle_draft="one_call")  # adaptive
    a, b = one.generate(prompts, max_new_tokens=10), step.generate(prompts, max_new_tokens=10)
    c = bound.generate(prompts, max_new_tokens=10)
    assert [r.token_ids for r in a] == [r.token_ids for r in b] == [r.token_ids for r in c]
    assert a[0].stats.draft_calls == a[0].stats.steps and b[0].stats.draft_calls == 4 * b[0].stats.steps


def test_load_options_bad_input(exported):
    out = exported("eagle")
    with pytest.raises(ValueError, match="unknown eagle_draft"):
        graphs.load(out, provider="cpu", eagle_draft="fast")
    dec = graphs.load(out, provider="cpu", eagle_draft="one_call")
    with pytest.raises(ValueError, match="--eagle-trees 3,2,8"):
        dec.generate([5, 6], max_new_tokens=4, tree={"topk": 3, "depth": 2, "total_tokens": 8})
    auto = graphs.load(out, provider="cpu", adaptive=False)  # auto: a tree not baked runs step-wise
    r = auto.generate([5, 6], max_new_tokens=4, tree={"topk": 3, "depth": 2, "total_tokens": 8})
    assert r.stats.draft_calls == 3 * r.stats.steps


def test_tree_outputs_are_consistent(exported):
    """parents < index, depth = parent's + 1, the mask is ancestor-or-self, scores fall along paths."""
    out = exported("eagle")
    dec = graphs.load(out, provider="cpu", adaptive=False, eagle_draft="one_call")
    with dec.watch_verify() as records:
        dec.generate([[5, 6, 7], [8, 9]], max_new_tokens=6)
    seen = [rec.tree for rec in records]
    assert seen
    for tree in seen:
        ref = Tree.from_parents(tree.parents)
        assert np.array_equal(tree.depth, ref.depth) and np.array_equal(tree.mask, ref.mask)
        assert np.all(tree.score[1:] <= tree.score[tree.parents[1:]] + 1e-6)


def test_cli_rejects_bad_trees_and_medusa(tiny_model_dir, tmp_path):
    r = run_module("exporter.export", tiny_model_dir("eagle"), tmp_path / "a", "--eagle-trees", "2,3")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "topk,depth,total_tokens" in r.stderr
    r = run_module("exporter.export", tiny_model_dir("medusa"), tmp_path / "b", "--eagle-trees", "2,3,6")
    assert r.returncode == 2 and "EAGLE drafter" in r.stderr and not (tmp_path / "b").exists()
