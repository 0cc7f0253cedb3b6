"""The rows gate of optimize and what the runtime does with it (issue: fast int4 that stays lossless).

Greedy speculative == autoregressive needs a row's logits to be the same whatever the call's row count.
optimize measures it (exporter.passes.parity.row_consistency) for calls of 1 and of every tree size,
records the bound, and decides: calls of 2+ rows that disagree are refused; a one-row call alone
that disagrees (MLAS's M == 1 int8 kernel on VNNI CPUs) makes the runtime call one token as two rows.
The measurement is scripted here (monkeypatch) to put each decision just below / above its limit.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import graphs
from exporter.loading import UserError
from exporter.optimize import optimize_export
from exporter.passes import parity
from graphs.manifest import Manifest

QUIET = dict(progress=None, time_gain=False, tune=False)


def _scripted(monkeypatch, single: float, multi: float, tree: float = 0.0):
    def fake(*_a, **_k):
        return {"single": single, "multi": multi, "tree": tree, "sizes": list(parity.ROW_SIZES)}

    monkeypatch.setattr(parity, "row_consistency", fake)


def _copy(exported, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(exported("medusa"), out)
    return out


@pytest.mark.parametrize(("single", "min_rows"), [(0.9e-4, 1), (1.0e-4, 1), (1.1e-4, 2)])
def test_a_one_row_call_that_rounds_otherwise_makes_one_token_two_rows(exported, tmp_path, monkeypatch, single,
                                                                       min_rows):
    _scripted(monkeypatch, single=single, multi=0.0)
    out = _copy(exported, tmp_path)
    optimize_export(out, **QUIET)  # float32: limit 1e-4 (compare's float32 CPU atol)
    m = Manifest.read(out)
    rows = m.validation["optimize"]["rows"]
    assert rows["limit"] == 1e-4 and rows["single_max_abs"] == single and rows["multi_max_abs"] == 0.0
    assert m.optimization["base"]["min_rows"] == min_rows
    # the bound: the one-row figure only where one-token steps run alone (the real one-sequence graph's
    # float32 figures, ~1e-6, add to it)
    assert m.optimization["base"]["rows_max_abs"] == pytest.approx(single if min_rows == 1 else 0.0, abs=2e-5)


@pytest.mark.parametrize(("tree", "min_rows"), [(1.0e-4, 2), (1.1e-4, 1)])
def test_a_one_row_call_stays_one_row_where_trees_differ_anyway(exported, tmp_path, monkeypatch, tree, min_rows):
    """Padding a one-token step buys exactness only where a tree's path equals the chain: where it does
    not (int8 activations: ~1e-3 at 19M int4, 0.16 at 1.1B), two rows would cost 1.3-1.5x a step for
    nothing, so the step stays one row, it says why, and the bound adds the two figures (an
    autoregressive step's logits within the one-row figure of the chain's, a verify's within the tree's)."""
    single = 3e-4
    _scripted(monkeypatch, single=single, multi=0.0, tree=tree)
    out = _copy(exported, tmp_path)
    lines = []
    optimize_export(out, **{**QUIET, "progress": lambda *a, **k: lines.append(" ".join(map(str, a)))})
    base = Manifest.read(out).optimization["base"]
    assert base["min_rows"] == min_rows
    assert any("stay one row" in x for x in lines) is (min_rows == 1)
    want = tree + single if min_rows == 1 else tree
    assert base["rows_max_abs"] == pytest.approx(want, abs=2e-5)


@pytest.mark.parametrize(("multi", "refused"), [(1.0e-4, False), (1.1e-4, True)])
def test_calls_of_several_rows_that_disagree_are_refused(exported, tmp_path, monkeypatch, multi, refused):
    _scripted(monkeypatch, single=0.0, multi=multi)
    out = _copy(exported, tmp_path)
    if refused:
        with pytest.raises(UserError, match="calls of different sizes"):
            optimize_export(out, **QUIET)
        assert not Manifest.read(out).optimization  # untouched
    else:
        optimize_export(out, **QUIET)
        assert Manifest.read(out).optimization["base"]["min_rows"] == 1


def test_the_int4_refusal_names_accuracy_level_0(exported, tmp_path, monkeypatch):
    _scripted(monkeypatch, single=0.0, multi=1.0)
    out = _copy(exported, tmp_path)
    with pytest.raises(UserError, match="--accuracy-level 0"):
        optimize_export(out, quantize="int4", **QUIET)


def test_padded_one_token_calls_decode_the_same_tokens(exported, tmp_path, monkeypatch):
    """min_rows 2: every base call the runtime makes has 2+ tokens per row (a one-token step gets a
    padding row), whichever of the base and its one-sequence graph runs it, and the tokens are those
    of the same graphs called with one row (float32 graphs: rows agree to ~1e-6)."""
    _scripted(monkeypatch, single=1.0, multi=0.0)
    out = _copy(exported, tmp_path)
    optimize_export(out, **QUIET)
    assert Manifest.read(out).optimization["base"]["min_rows"] == 2
    padded = graphs.load(out, provider="cpu", threads=1)
    plain = graphs.load(out, provider="cpu", threads=1)
    plain.min_rows = 1  # the same graphs, one-row calls
    shapes = []
    for graph in (padded._in_place, padded._one_sequence):
        def spy(feed, buffers, cache=None, key=None, run=graph.run):
            shapes.append(feed["input_ids"].shape)
            return run(feed, buffers, cache, key)

        graph.run = spy
    for prompts in ([[5, 9, 3], [7, 1, 4, 4, 2, 8], [11]], [[7, 1, 4]]):
        for mode in ("autoregressive", "speculative"):
            want = plain.generate(prompts, max_new_tokens=12, mode="autoregressive")
            got = padded.generate(prompts, max_new_tokens=12, mode=mode)
            assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert shapes and min(s for _, s in shapes) >= 2
    assert np.mean([s == 2 for _, s in shapes]) > 0.3  # the autoregressive steps were padded, not skipped
