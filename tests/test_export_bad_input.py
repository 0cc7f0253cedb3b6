"""Every bad input to python -m exporter.export: one ``error:`` line on stderr, no traceback, a
non-zero exit, and nothing half-written left behind (nothing existing lost).

A few cases run the CLI in a subprocess (two at a time, once per session); the rest call
``exporter.export.main`` in-process, which is the same code without ~3 s of imports per case.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, run_module, save_tiny_model

import exporter.export as ex
import exporter.outdir
import exporter.trace
import exporter.validate
from exporter.loading import UserError


def assert_one_error_line(rc: int, stderr: str, *fragments: str) -> str:
    assert rc != 0
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert lines[0].startswith("error: "), lines[0]
    for f in fragments:
        assert f in lines[0], f"{f!r} not in {lines[0]!r}"
    return lines[0]


def run_main(capsys, *args) -> tuple[int, str, str]:
    """exporter.export.main in-process: (exit code, stdout, stderr); argparse's SystemExit too."""
    try:
        rc = ex.main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def snapshot(d: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(d)): (p.read_bytes(), p.stat().st_mtime_ns) for p in d.rglob("*") if p.is_file()}


# ----------------------------------------------------------------------------- broken model dirs


@pytest.fixture(scope="session")
def bad(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """Broken inputs, built once: {name: path}."""
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    from exporter.speculative import save_drafter

    root = tmp_path_factory.mktemp("bad")
    good = tiny_model_dir("medusa", "llama")
    d = {"good": good, "missing": root / "missing"}

    d["no_config"] = root / "no_config"
    shutil.copytree(good, d["no_config"])
    (d["no_config"] / "config.json").unlink()

    d["bad_json"] = root / "bad_json"
    shutil.copytree(good, d["bad_json"])
    (d["bad_json"] / "config.json").write_text("{not json")

    d["bert"] = root / "bert"
    tiny = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100)
    BertModel(BertConfig(**tiny)).save_pretrained(d["bert"])

    d["gpt2"] = root / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100)).save_pretrained(d["gpt2"])

    d["no_weights"] = root / "no_weights"
    shutil.copytree(good, d["no_weights"])
    (d["no_weights"] / "model.safetensors").unlink()

    d["corrupt"] = root / "corrupt"
    shutil.copytree(good, d["corrupt"])
    w = d["corrupt"] / "model.safetensors"
    w.write_bytes(os.urandom(w.stat().st_size))

    d["truncated"] = root / "truncated"
    shutil.copytree(good, d["truncated"])
    w = d["truncated"] / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])

    # a drafter trained for another base (hidden_size 32, not 64)
    d["plain"] = save_tiny_model(build_tiny_model("llama", "base"), root / "plain")
    other = build_tiny_model("llama", "medusa", hidden_size=32, intermediate_size=64)
    d["drafter32"] = save_drafter(other, root / "drafter32")

    # a model_dir whose drafter weights come from that other base
    from safetensors.torch import load_file, save_file

    d["mismatched"] = root / "mismatched"
    shutil.copytree(good, d["mismatched"])
    state = load_file(str(good / "model.safetensors"))
    state.update({k: v.contiguous() for k, v in other.state_dict().items() if k.startswith("medusa_heads.")})
    save_file(state, str(d["mismatched"] / "model.safetensors"), metadata={"format": "pt"})

    # a model_dir whose config asks for more heads than its weights hold
    d["heads3"] = root / "heads3"
    shutil.copytree(good, d["heads3"])
    cfg = json.loads((good / "config.json").read_text())
    cfg["speculative_decoding"]["config"]["medusa_num_heads"] = 3
    (d["heads3"] / "config.json").write_text(json.dumps(cfg))

    d["a_file"] = root / "a_file"
    d["a_file"].write_text("not a directory\n")
    return d


# (name, model_dir key, extra args, fragments the error line must hold)
SUBPROCESS_CASES = [
    ("missing", "missing", [], ["does not exist"]),
    ("bert", "bert", [], ["not a causal language model"]),
    ("corrupt", "corrupt", [], ["cannot load the weights", "corrupt or truncated"]),
    ("non_empty_out", "good", [], ["is not empty", "--overwrite"]),
    ("under_a_file", "good", [], ["is a file, not a directory"]),
]


@pytest.fixture(scope="session")
def subprocess_results(bad, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-out")
    jobs = {}
    for name, key, extra, _ in SUBPROCESS_CASES:
        out = root / name / "onnx"
        if name == "non_empty_out":
            out.mkdir(parents=True)
            (out / "keep.txt").write_text("precious\n")
        elif name == "under_a_file":
            out = bad["a_file"] / "onnx"
        else:
            out.parent.mkdir(parents=True)
        jobs[name] = (bad[key], out, extra)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {n: pool.submit(run_module, "exporter.export", m, o, *e) for n, (m, o, e) in jobs.items()}
        return {n: (jobs[n][1], f.result()) for n, f in futures.items()}


@pytest.mark.parametrize(("name", "key", "extra", "fragments"), SUBPROCESS_CASES, ids=[c[0] for c in SUBPROCESS_CASES])
def test_cli_subprocess_bad_input(subprocess_results, name, key, extra, fragments):
    out, proc = subprocess_results[name]
    assert proc.returncode == 2, proc.stderr
    assert_one_error_line(proc.returncode, proc.stderr, *fragments)
    if name == "non_empty_out":
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
        assert (out / "keep.txt").read_text() == "precious\n"
    elif name != "under_a_file":
        assert not out.exists()
        assert leftovers(out.parent) == []


# (name, model_dir key, extra args, fragments)
IN_PROCESS_CASES = [
    ("not_a_directory", "a_file", [], ["is not a directory"]),
    ("no_config", "no_config", [], ["no config.json", "not a Hugging Face model directory"]),
    ("config_not_json", "bad_json", [], ["not valid JSON"]),
    ("unsupported_architecture", "gpt2", [], ["unsupported architecture 'gpt2'", "llama, mistral, qwen2, qwen3"]),
    ("no_weights", "no_weights", [], ["has no weights"]),
    ("truncated", "truncated", [], ["cannot load the weights", "corrupt or truncated"]),
    ("drafter_in_dir_wrong_base", "mismatched", [], ["different base model"]),
    ("drafter_in_dir_wrong_config", "heads3", [], ["do not fit this drafter"]),
    ("drafter_flag_on_converted_dir", "good", ["--drafter", "{drafter32}"], ["already holds a drafter"]),
    ("drafter_missing", "plain", ["--drafter", "{missing}"], ["does not exist"]),
    ("bad_dtype", "good", ["--dtype", "int8"], ["invalid choice: 'int8'"]),
    ("unknown_option", "good", ["--bogus"], ["unrecognized arguments: --bogus"]),
]


@pytest.mark.parametrize(("name", "key", "extra", "fragments"), IN_PROCESS_CASES, ids=[c[0] for c in IN_PROCESS_CASES])
def test_bad_input(bad, tmp_path, capsys, name, key, extra, fragments):
    out = tmp_path / "onnx"
    args = [a.format(**{k: str(v) for k, v in bad.items()}) for a in extra]
    rc, _, err = run_main(capsys, bad[key], out, *args)
    assert rc == 2
    assert_one_error_line(rc, err, *fragments)
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_drafter_for_another_base(bad, tmp_path, capsys):
    """--drafter saved (save_drafter) from a base with hidden_size 32, paired with a 64-wide base."""
    pytest.importorskip("exporter.speculative.importers", reason="load_external_drafter is not written yet")
    out = tmp_path / "onnx"
    rc, _, err = run_main(capsys, bad["plain"], out, "--drafter", bad["drafter32"])
    assert_one_error_line(rc, err, "does not fit", "hidden_size")
    assert not out.exists() and leftovers(tmp_path) == []


def test_corrupt_drafter_file(bad, tmp_path, capsys):
    pytest.importorskip("exporter.speculative.importers", reason="load_external_drafter is not written yet")
    out = tmp_path / "onnx"
    rc, _, err = run_main(capsys, bad["plain"], out, "--drafter", bad["corrupt"] / "model.safetensors")
    assert rc == 2
    assert_one_error_line(rc, err, "cannot read the drafter", "corrupt or truncated")


def test_unreadable_model_dir(bad, tmp_path, capsys, monkeypatch):
    """chmod 000 does not stop root, so deny access through os.access for that directory only."""
    model_dir = bad["good"]
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != model_dir and real_access(p, mode, **kw))
    rc, _, err = run_main(capsys, model_dir, tmp_path / "onnx")
    assert rc == 2
    assert_one_error_line(rc, err, "is not readable", "permissions")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores chmod 000 (the os.access test covers this case)")
def test_unreadable_model_dir_chmod(bad, tmp_path):
    model_dir = tmp_path / "locked"
    shutil.copytree(bad["good"], model_dir)
    model_dir.chmod(0)
    try:
        proc = run_module("exporter.export", model_dir, tmp_path / "onnx")
    finally:
        model_dir.chmod(0o755)
    assert_one_error_line(proc.returncode, proc.stderr, "is not readable")


@pytest.mark.parametrize("where", ["/proc/onnx-out", "/proc/self/onnx-out/x"])
def test_unwritable_out_dir(bad, capsys, where):
    rc, _, err = run_main(capsys, bad["good"], where)
    assert rc == 2
    assert_one_error_line(rc, err, "out_dir", where)


def test_out_dir_is_a_file(bad, capsys):
    before = bad["a_file"].read_text()
    rc, _, err = run_main(capsys, bad["good"], bad["a_file"])
    assert_one_error_line(rc, err, "exists and is not a directory")
    assert bad["a_file"].read_text() == before


def test_out_dir_holding_the_model_is_refused_even_with_overwrite(bad, tmp_path, capsys):
    parent = tmp_path / "models"
    shutil.copytree(bad["good"], parent / "m")
    before = snapshot(parent)
    rc, _, err = run_main(capsys, parent / "m", parent, "--overwrite")
    assert_one_error_line(rc, err, "an input of this export")
    assert snapshot(parent) == before
    rc, _, err = run_main(capsys, parent / "m", parent / "m", "--overwrite")
    assert_one_error_line(rc, err, "an input of this export")
    assert snapshot(parent) == before


def test_non_empty_out_dir_refused_then_replaced_with_overwrite_non_export(bad, tmp_path, capsys):
    """A directory of the user's own files: refused without --overwrite, refused with --overwrite (it is
    not an export), replaced only with --overwrite-non-export OUT_DIR (the path repeated)."""
    out = tmp_path / "onnx"
    out.mkdir()
    (out / "old.txt").write_text("old export\n")
    (out / "sub").mkdir()
    (out / "sub" / "x.bin").write_bytes(b"\x00" * 10)
    before = snapshot(out)
    rc, _, err = run_main(capsys, bad["good"], out)
    assert_one_error_line(rc, err, "is not empty", "--overwrite")
    assert snapshot(out) == before
    rc, _, err = run_main(capsys, bad["good"], out, "--overwrite")
    assert_one_error_line(rc, err, "holds old.txt and 1 more", "not part of an export", "--overwrite-non-export")
    assert snapshot(out) == before
    rc, _, err = run_main(capsys, bad["good"], out, "--overwrite-non-export", tmp_path / "elsewhere")
    assert_one_error_line(rc, err, "--overwrite-non-export must repeat out_dir")
    assert snapshot(out) == before

    rc, _, err = run_main(capsys, bad["good"], out, "--overwrite-non-export", out)
    assert rc == 0, err
    assert err == ""
    assert not (out / "old.txt").exists() and not (out / "sub").exists()
    assert {"manifest.json", "base.onnx", "draft.onnx"} <= {p.name for p in out.iterdir()}
    assert leftovers(tmp_path) == []


def test_empty_out_dir_is_used_without_overwrite(bad, tmp_path, capsys):
    out = tmp_path / "onnx"
    out.mkdir()
    rc, _, err = run_main(capsys, bad["good"], out)
    assert rc == 0, err
    assert (out / "manifest.json").is_file()


# ----------------------------------------------------------------------------- failures half-way


def _boom(*args, **kwargs):
    raise RuntimeError("boom: simulated failure")


def _half_written_trace(model, role, spec, path, opset=17):
    Path(path).write_bytes(b"half a graph")  # something on disk, then the failure
    raise RuntimeError("boom: tracer died")


def _patch_failure(monkeypatch, how: str):
    if how == "compare":
        monkeypatch.setattr(exporter.validate, "compare_model", _boom)
    elif how == "tracer":
        monkeypatch.setattr(exporter.trace, "export_graph", _half_written_trace)
    elif how == "interrupt":
        def interrupt(*a, **k):
            raise KeyboardInterrupt
        monkeypatch.setattr(exporter.validate, "compare_model", interrupt)
    elif how == "manifest":
        monkeypatch.setattr(exporter.outdir, "write_manifest", _boom)


@pytest.mark.parametrize("how", ["compare", "tracer", "manifest"])
def test_failure_half_way_leaves_nothing(bad, tmp_path, monkeypatch, how):
    _patch_failure(monkeypatch, how)
    out = tmp_path / "onnx"
    with pytest.raises(RuntimeError, match="boom"):
        ex.export(bad["good"], out, log=lambda *a, **k: None)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("how", ["compare", "tracer", "interrupt"])
def test_failure_half_way_keeps_existing_out_dir(bad, tmp_path, monkeypatch, capsys, how):
    out = tmp_path / "onnx"
    out.mkdir()
    (out / "manifest.json").write_text('{"format_version": 1, "files": {}}\n')  # an (empty) earlier export
    before = snapshot(out)
    _patch_failure(monkeypatch, how)
    rc, _, err = run_main(capsys, bad["good"], out, "--overwrite")
    if how == "interrupt":
        assert rc == 130
        assert_one_error_line(rc, err, "interrupted")
    else:  # not bad input: a bug, shown with its traceback
        assert rc == 1
        assert "Traceback" in err
        assert err.strip().splitlines()[-1].startswith("error: internal error RuntimeError: boom")
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx"]


def test_graphs_that_disagree_with_pytorch_are_not_written(bad, tmp_path, monkeypatch, capsys):
    """The export's own check: a graph traced with a perturbed lm_head fails it, and nothing is written."""
    real = exporter.trace.export_graph

    def traced_with_noise(model, role, spec, path, opset=17):
        with torch.no_grad():
            model.lm_head.weight.add_(0.05)
        try:
            return real(model, role, spec, path, opset=opset)
        finally:
            with torch.no_grad():
                model.lm_head.weight.sub_(0.05)

    monkeypatch.setattr(exporter.trace, "export_graph", traced_with_noise)
    out = tmp_path / "onnx"
    rc, stdout, err = run_main(capsys, bad["good"], out)
    assert rc == 2
    line = assert_one_error_line(rc, err, "disagrees with PyTorch", "logits", "nothing was written")
    assert "base graph" in line
    assert "FAIL" in stdout  # the compare table is printed
    assert not out.exists() and leftovers(tmp_path) == []


def test_debug_flag_shows_the_traceback(bad, tmp_path, capsys):
    rc, _, err = run_main(capsys, bad["missing"], tmp_path / "onnx", "--debug")
    assert rc == 2
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: model_dir")


def test_library_raises_user_error(bad, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ex.export(bad["missing"], tmp_path / "onnx")
    with pytest.raises(UserError, match="unknown --dtype"):
        ex.export(bad["good"], tmp_path / "onnx", dtype="float64")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
