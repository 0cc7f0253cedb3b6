"""Regression: a sliding-window model (Mistral) is exact only within its window, so the runtime's
context limit is the window (the graphs attend every unmasked column)."""

from __future__ import annotations

import pytest
from conftest import build_tiny_model, save_tiny_model

import graphs
from exporter.export import export


def test_sliding_window_caps_the_context(tmp_path):
    model = build_tiny_model("mistral", "base", sliding_window=24)
    save_tiny_model(model, tmp_path / "model")
    manifest = export(tmp_path / "model", tmp_path / "onnx", log=lambda *a, **k: None)
    assert manifest.source["sliding_window"] == 24
    decoder = graphs.load(tmp_path / "onnx", provider="cpu")
    assert decoder.max_positions == 24
    with pytest.raises(ValueError, match="context limit of 24"):
        decoder.generate(list(range(3, 30)), max_new_tokens=4)
    r = decoder.generate(list(range(3, 13)), max_new_tokens=40)
    assert r.finish_reason in ("length", "eos") and 10 + len(r.token_ids) <= 24
