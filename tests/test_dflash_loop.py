"""The DFlash pieces compose into lossless speculative decoding: a reference loop (tests/dflash_reference.py)
over an exported, trained DFlash drafter, the block verified as a chain or as a top-k tree with the base's
tree mask, gives exactly the base's greedy tokens, and its drafts are accepted."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model
from dflash_reference import Graphs, autoregressive, dflash_generate
from tiny import tiny_model

from exporter import pipeline
from exporter.speculative import enable_huggingface_checkpointing
from exporter.speculative import training as T

QUIET = dict(log=lambda *a, **k: None)


def _prompts(n, seed, length=6):
    g = torch.Generator().manual_seed(seed)
    return [(f"c{i % 2}", torch.randint(3, 250, (length,), generator=g).tolist()) for i in range(n)]


@pytest.fixture(scope="module")
def trained_export(tmp_path_factory):
    """A tiny base, a DFlash drafter (block 4) trained on its own distilled answers, exported."""
    d = tmp_path_factory.mktemp("dflash-loop")
    save_tiny_model(tiny_model(num_hidden_layers=6), d / "base")
    pipeline.export(d / "base", d / "ar", **QUIET)
    cfg = T.TrainingConfig(mode="dflash", max_new_tokens=32, distill_rows=8, seconds_budget=None, epochs=15,
                           batch_size=8, learning_rate=5e-3, heldout_fraction=0.1,
                           drafter_config={"dflash_block_size": 4})
    model = tiny_model(num_hidden_layers=6)
    report = T.run(model, d / "ar", _prompts(16, 0), cfg, d / "work", **QUIET)
    enable_huggingface_checkpointing()
    save_tiny_model(model, d / "model")
    pipeline.export(d / "model", d / "out", **QUIET)
    return Graphs(d / "out"), report


@pytest.mark.parametrize("size, topk", [(4, 1), (4, 3), (8, 3)])
def test_chain_and_trees_are_lossless_and_accepted(trained_export, size, topk):
    g, _ = trained_export
    accepted = []
    for _, prompt in _prompts(3, 0):  # prompts the drafter was trained on the answers of
        want = autoregressive(g, prompt, 24)
        got, stats = dflash_generate(g, prompt, 24, size=size, topk=topk)
        assert got == want
        accepted += stats.accepted
    assert sum(accepted) > 0, accepted  # the trained block drafts tokens the base accepts
