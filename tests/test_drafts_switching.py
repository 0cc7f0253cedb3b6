"""Drafts, not only tokens, under switching between plain and drafted steps (issue 37).

Greedy output is exact whatever the drafts are, and the drafting-reference test runs with the
adaptive policy off: a proposer that replaced a row's drafter context after plain steps instead of
extending it (``_Eagle.advance``), or kept a stale Medusa hidden state, passed every test. Here a
planner forces a fixed pattern of plain steps and full trees; every drafted tree must equal the
PyTorch reference's for its context (tests/draft_reference.py), for every proposer."""

from __future__ import annotations

import numpy as np
import pytest
from test_dflash_engine import dflash_export  # noqa: F401 (fixture)
from test_runtime import PROMPTS, references, trained  # noqa: F401 (fixtures)

import graphs
from graphs.adaptive import IDLE, SPEC_OFF, Planner

# 1: a plain step, 0: the full trees. Runs of 1, 2 and 3 plain steps between drafted ones, and drafted
# steps in a row, so the drafter's context grows across plain steps of every length
PATTERN = [0, 1, 0, 1, 1, 0, 0, 1, 1, 1, 0]

CASES = [("medusa", "auto"), ("eagle", "stepwise"), ("eagle", "one_call"), ("eagle3", "stepwise"),
         ("eagle3", "one_call")]


class Switching(Planner):
    """Full trees or plain steps in PATTERN's order, whatever the costs say."""

    def plan(self, modes, full, gains, ceilings=None):
        plain = PATTERN[len(self.history) % len(PATTERN)]
        sizes = np.ones_like(full) if plain else full.copy()
        sizes = np.where(modes == IDLE, 0, np.where(modes == SPEC_OFF, 1, sizes)).astype(np.int64)
        self.history.append(int(sizes.max()))
        self.last_width = int(sizes.max())
        return sizes


@pytest.mark.parametrize(("kind", "draft"), CASES)
@pytest.mark.parametrize("batch", [1, 3])
def test_drafts_equal_the_reference_under_forced_switching(trained, monkeypatch, kind, draft, batch):  # noqa: F811
    from draft_reference import captured_steps, check_drafts, torch_model

    t = trained(kind)
    model = torch_model(t.out_dir.parent / "model")
    decoder = graphs.load(t.out_dir, provider="cpu", threads=1, eagle_draft=draft, adaptive=True)
    made = []
    monkeypatch.setattr(decoder, "new_planner", lambda: made.append(Switching()) or made[-1])
    prompts = [PROMPTS[i] for i in ((2, 5, 9) if batch > 1 else (7,))]
    with captured_steps(decoder) as steps:
        results = decoder.generate(prompts, max_new_tokens=16, speculation="adaptive")
    refs = [t.refs[PROMPTS.index(p)][:16] for p in prompts]
    assert [r.token_ids for r in results] == refs  # (exact whatever the drafts: the test is below)
    widths = list(made[-1].history)
    assert widths.count(1) >= 3 and max(widths) > 1  # both kinds of step, switching
    drafted = [s for s in steps if s.tree.size > 1]
    cfg = None if kind == "medusa" else decoder.eagle_tree(None)
    assert check_drafts(model, prompts, results, drafted, eagle_cfg=cfg) >= 3 * batch


@pytest.mark.parametrize("tree", [{"topk": 1, "total_tokens": 4}, {"topk": 3, "total_tokens": 8}],
                         ids=["chain", "tree"])
def test_dflash_drafts_equal_the_reference_under_forced_switching(dflash_export, monkeypatch, tree):  # noqa: F811
    """DFlash's pending context rows accumulate across plain steps: every drafted block equals the one
    drafted from the whole context at once (tests/test_dflash_engine.py's reference_block), batch 3."""
    from test_dflash_engine import check_dflash_drafts, prompts

    out_dir, g = dflash_export
    decoder = graphs.load(out_dir, provider="cpu", threads=1, adaptive=True)
    made = []
    monkeypatch.setattr(decoder, "new_planner", lambda: made.append(Switching()) or made[-1])
    ps = prompts(3)
    refs = decoder.generate(ps, max_new_tokens=16, mode="autoregressive")
    with decoder.watch_verify() as steps:
        results = decoder.generate(ps, max_new_tokens=16, speculation="adaptive", tree=tree)
    assert [r.token_ids for r in results] == [r.token_ids for r in refs]
    widths = list(made[-1].history)
    assert widths.count(1) >= 3 and max(widths) > 1  # both kinds of step, switching
    drafted = [s for s in steps if s.tree.size > 1]
    assert check_dflash_drafts(g, ps, results, drafted, tree) >= 3 * 3
