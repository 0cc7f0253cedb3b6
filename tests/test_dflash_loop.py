"""The DFlash pieces compose into lossless speculative decoding: a reference loop (tests/dflash_reference.py)
over an exported, trained DFlash drafter, the block verified as a chain or as a top-k tree with the base's
tree mask, gives exactly the base's greedy tokens, and its drafts are accepted."""

from __future__ import annotations

import pytest
from conftest import dflash_prompts
from dflash_reference import Graphs, autoregressive, dflash_generate

QUIET = dict(log=lambda *a, **k: None)


@pytest.fixture(scope="module")
def trained_export(trained_dflash):
    """A tiny base, a DFlash drafter (block 4) trained on its own distilled answers, exported (conftest)."""
    out, report = trained_dflash
    return Graphs(out), report


@pytest.mark.parametrize("size, topk", [(4, 1), (4, 3), (8, 3)])
def test_chain_and_trees_are_lossless_and_accepted(trained_export, size, topk):
    g, _ = trained_export
    accepted = []
    for prompt in dflash_prompts(3):  # prompts the drafter was trained on the answers of
        want = autoregressive(g, prompt, 24)
        got, stats = dflash_generate(g, prompt, 24, size=size, topk=topk)
        assert got == want
        accepted += stats.accepted
    assert sum(accepted) > 0, accepted  # the trained block drafts tokens the base accepts
