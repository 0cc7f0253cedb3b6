"""Export + compare + decode, one model per architecture: the subset CI also runs on transformers 4.57.

``python -m pytest -m crossversion`` (``.ci/run`` runs it in a second environment with
transformers 4.57.6; the full suite runs on the newest 5.x). Each case exports a tiny random model
with a drafter (export validates against PyTorch before it writes), compares the graphs with
PyTorch again from the saved model, and decodes: PyTorch's greedy tokens must equal the runtime's,
speculative and autoregressive.
"""

from __future__ import annotations

import pytest
import transformers

import graphs
from exporter.e2e import compare_tokens
from exporter.loading import load_model
from exporter.validate import compare_model
from graphs.manifest import Manifest

# every architecture, each drafter kind at least once
CASES = [("llama", "medusa"), ("mistral", "eagle"), ("qwen2", "eagle3"), ("qwen3", "medusa")]
PROMPTS = [[5, 9, 3, 17], [40, 41], [7] * 6]


@pytest.mark.crossversion
@pytest.mark.parametrize(("model_type", "kind"), CASES, ids=["-".join(c) for c in CASES])
def test_export_compare_decode(tiny_model_dir, exported, model_type, kind):
    out = exported(kind, model_type)
    manifest = Manifest.read(out)
    assert manifest.validation["ok"] is True
    assert manifest.versions["transformers"] == transformers.__version__
    model = load_model(tiny_model_dir(kind, model_type))
    report = compare_model(model, out)
    assert report.ok, report.table()
    rows = compare_tokens(model, graphs.load(out, provider="cpu"), PROMPTS, max_new_tokens=12)
    for row in rows:
        assert row.ok, f"{row.prompt}: tokens differ at {row.first_mismatch}"
        assert len(row.torch_tokens) == 12 or row.torch_tokens[-1] == 2
