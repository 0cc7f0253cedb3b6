"""Issue 19, the command lines: bad input refused before any work, with one line naming the fix.

Every CLI that reads an export (generate, compare, bench, tune, optimize) refuses a ``--json`` /
``--png`` inside a directory it reads (the export, the model directory): ``generate OUT --json
OUT/manifest.json`` used to exit 0 and destroy the export. The work itself is replaced by a hook that
fails the test, so "before any work" is what is checked, and the export's bytes are compared after.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
from pathlib import Path

import pytest
from helpers import one_line


def _digest(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def _no_work(*a, **k):
    raise AssertionError("the work started before the output path was checked")


# (cli module, attribute holding its work, extra args before the flag)
WORK = {
    "exporter.generate": ("graphs", "load", ["--prompt", "hi"]),
    "exporter.compare": ("exporter.compare", "compare", []),
    "exporter.tune": ("exporter.tune", "tune", []),
    "exporter.optimize": ("exporter.optimize", "optimize_export", []),
    "exporter.bench": ("exporter.bench", "bench", []),
}


@pytest.fixture
def out(exported, tmp_path):
    d = tmp_path / "out"
    shutil.copytree(exported("medusa"), d)
    return d


@pytest.mark.parametrize("cli", sorted(WORK))
@pytest.mark.parametrize("inside", ["manifest.json", "new.json", "link/manifest.json"])
def test_json_inside_the_export_is_refused_before_any_work(cli, inside, out, tiny_model_dir, tmp_path,
                                                           monkeypatch, capsys):
    """``--json OUT/manifest.json`` (or any new file in OUT, or through a symlink to OUT): refused."""
    (tmp_path / "link").symlink_to(out)
    mod_name, attr, extra = WORK[cli]
    monkeypatch.setattr(importlib.import_module(mod_name), attr, _no_work)
    before = _digest(out)
    target = (tmp_path if inside.startswith("link") else out) / inside
    args = [str(out), *extra, "--json", str(target)]
    if cli == "exporter.compare":
        args = [str(tiny_model_dir("medusa")), *args]
    rc = importlib.import_module(cli).main(args)
    one_line(rc, capsys.readouterr().err, "--json", "which this command reads", "outside it")
    assert _digest(out) == before and not (out / "new.json").exists()


@pytest.mark.parametrize("cli", ["exporter.compare", "exporter.bench"])
def test_json_inside_the_model_dir_is_refused(cli, out, tiny_model_dir, tmp_path, monkeypatch, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("medusa"), model)
    mod_name, attr, _ = WORK[cli]
    monkeypatch.setattr(importlib.import_module(mod_name), attr, _no_work)
    args = [str(out), "--model-dir", str(model)] if cli == "exporter.bench" else [str(model), str(out)]
    rc = importlib.import_module(cli).main([*args, "--json", str(model / "config.json")])
    one_line(rc, capsys.readouterr().err, f"inside {model}")


def test_png_inside_the_export_is_refused(out, monkeypatch, capsys):
    import exporter.bench as b

    monkeypatch.setattr(b, "bench", _no_work)
    one_line(b.main([str(out), "--png", str(out / "r.png")]), capsys.readouterr().err, "--png", "outside it")


@pytest.mark.parametrize("cli", sorted(WORK))
def test_json_in_a_missing_directory_fails_before_the_run(cli, out, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Issue 19 (unclear messages): ``--json /nonexistent/x.json`` failed only after the run."""
    mod_name, attr, extra = WORK[cli]
    monkeypatch.setattr(importlib.import_module(mod_name), attr, _no_work)
    args = [str(out), *extra, "--json", str(tmp_path / "nonexistent" / "x.json")]
    if cli == "exporter.compare":
        args = [str(tiny_model_dir("medusa")), *args]
    one_line(importlib.import_module(cli).main(args), capsys.readouterr().err, "does not exist")


# ----------------------------------------------------------------------------- tune


@pytest.fixture
def no_tuning(monkeypatch):
    import exporter.tuning

    monkeypatch.setattr(exporter.tuning, "choose_tree", _no_work)


@pytest.mark.parametrize("content", ['["  ", "\\t"]', "[]", "\n  \n\t\n"])
def test_tune_with_only_empty_prompts_is_an_error(exported, tmp_path, capsys, no_tuning, content):
    """Only empty prompts silently tuned on the built-in prompts and wrote the result to the manifest."""
    import exporter.tune

    out = exported("medusa")
    before = _digest(out)
    f = tmp_path / "p.json"
    f.write_text(content)
    line = one_line(exporter.tune.main([str(out), "--prompts", str(f)]), capsys.readouterr().err)
    assert "no prompts" in line or "all empty" in line, line
    assert _digest(out) == before


def test_tune_library_call_with_empty_prompts_is_an_error(exported, no_tuning):
    from exporter.loading import UserError
    from exporter.pipeline import tune_export

    with pytest.raises(UserError, match="all empty"):
        tune_export(exported("medusa"), prompts=["", " "])


def test_tune_prompts_file_not_utf8(exported, tmp_path, capsys, no_tuning):
    import exporter.tune

    f = tmp_path / "p.txt"
    f.write_bytes(b"def main(\n\xff\xfe caf\xe9\n")
    one_line(exporter.tune.main([str(exported("medusa")), "--prompts", str(f)]), capsys.readouterr().err,
             "is not UTF-8 text", "save it as UTF-8")


def test_tune_model_dir_of_the_wrong_kind_is_checked_first(exported, tiny_model_dir, capsys, no_tuning):
    """``tune --model-dir`` with the wrong drafter failed only after the whole tuning run."""
    import exporter.tune

    rc = exporter.tune.main([str(exported("eagle")), "--model-dir", str(tiny_model_dir("medusa"))])
    one_line(rc, capsys.readouterr().err, "holds a medusa drafter", "an eagle drafter", "exported from")
    rc = exporter.tune.main([str(exported("medusa")), "--model-dir", str(tiny_model_dir("medusa"))])
    one_line(rc, capsys.readouterr().err, "bakes EAGLE trees", "has a medusa drafter", "drop --model-dir")


# ----------------------------------------------------------------------------- bench

BENCH_TINY = ["--repeats", "1", "--prompts", "1", "--max-new-tokens", "4", "--threads", "1", "--peers", ""]


def test_bench_unknown_load_option_is_a_user_error_and_its_log_is_kept(exported, tmp_path, capsys):
    """An unknown --load-option made every system fail and bench exit 0; its log was deleted with the
    work directory. Now: one line naming the system, the reason and the log, which exists after exit."""
    import exporter.bench as b

    logs = tmp_path / "logs"
    rc = b.main([str(exported("medusa")), *BENCH_TINY, "--load-option", "no_such_option=1", "--logs", str(logs)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: ours-ar could not start: "), err
    assert "no_such_option" in err[-1] and f"worker log: {logs / 'ours-ar.log'}" in err[-1], err[-1]
    assert (logs / "ours-ar.log").is_file()


def test_bench_failing_system_is_a_non_zero_exit_naming_the_logs(exported, tmp_path, capsys, monkeypatch):
    """A system that fails during the run (hooked: its worker's reply) is exit 1, its logs kept and named."""
    import exporter.bench as b
    from exporter.benchmark import systems as S

    real = S.run

    def run(system, request):
        if system.name == "ours-spec" and request["max_new_tokens"] != 8:  # after the warm-up
            system.skip("run failed: hooked", "failed")
            return None
        return real(system, request)

    monkeypatch.setattr(S, "run", run)
    rc = b.main([str(exported("medusa")), *BENCH_TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1].startswith("error: 1 system(s) failed: ours-spec (their logs: "), err
    logs = err[-1].rpartition("their logs: ")[2].rstrip(")")
    assert (Path(logs) / "ours-spec.log").is_file()
    shutil.rmtree(logs)


def test_bench_tampered_tokenizer_config_refused_before_it_is_rendered(exported, tmp_path, capsys, monkeypatch):
    """A tampered tokenizer_config.json (chat template) was rendered before the export was verified."""
    import exporter.bench as b
    from exporter.benchmark import prompts as P
    from exporter.benchmark import systems as S

    out = tmp_path / "out"
    shutil.copytree(exported("medusa"), out)
    cfg = out / "tokenizer_config.json"
    if not cfg.exists():
        pytest.skip("the tiny export has no tokenizer_config.json")
    cfg.write_text(cfg.read_text().rstrip()[:-1] + ', "chat_template": "{{ 7 * 7 }}"}')
    monkeypatch.setattr(P, "load_chat_template", _no_work)
    monkeypatch.setattr(S, "start", _no_work)
    f = tmp_path / "p.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    one_line(b.main([str(out), *BENCH_TINY, "--prompts-file", str(f)]), capsys.readouterr().err,
             "tokenizer_config.json", "sha256")


def test_bench_paths_are_resolved_before_the_workers(tiny_model_dir, tmp_path, monkeypatch):
    """A relative --model-dir was resolved against the repository (the workers' cwd): another model, or a
    hub id and the network. Resolved here; one that is not a directory is refused."""
    from exporter.bench import BenchOptions
    from exporter.loading import UserError

    shutil.copytree(tiny_model_dir("base"), tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    opts = BenchOptions(model_dir="model", prompts_file="p.txt", logs="logs")
    assert opts.model_dir == str(tmp_path / "model") and opts.prompts_file == str(tmp_path / "p.txt")
    assert opts.logs == str(tmp_path / "logs")
    with pytest.raises(UserError, match="--model-dir org/model is not a directory; pass a local"):
        BenchOptions(model_dir="org/model")


def test_bench_bad_tree_is_a_user_error(exported, tmp_path, capsys):
    """A --tree the runtime refuses (rank past the vocabulary) left ours-spec skipped and bench exit 0."""
    import exporter.bench as b

    t = tmp_path / "tree.json"
    t.write_text("[[999]]")
    rc = b.main([str(exported("medusa")), *BENCH_TINY, "--tree", str(t)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: ours-spec could not start: "), err
    assert "rank 999" in err[-1] and "worker log: " in err[-1], err[-1]


# ----------------------------------------------------------------------------- unclear messages (issue 19)


@pytest.mark.parametrize("content", ['{"prompt": "a\\ud800b"}\n', '["ok", "x\\udc00"]'])
def test_prompt_with_an_escaped_lone_surrogate_is_one_clear_line(tmp_path, content):
    from exporter.loading import UserError
    from exporter.prompts import read_prompt_file

    f = tmp_path / ("p.jsonl" if content.startswith("{") else "p.json")
    f.write_text(content)
    with pytest.raises(UserError, match=r"unpaired surrogate .* fix the escape"):
        read_prompt_file(f)


def test_compare_e2e_with_zero_new_tokens_is_refused_before_loading(exported, tiny_model_dir, capsys, monkeypatch):
    import exporter.compare
    import exporter.loading

    model, out = tiny_model_dir("medusa"), exported("medusa")
    monkeypatch.setattr(exporter.loading, "load_model", _no_work)
    rc = exporter.compare.main([str(model), str(out), "--e2e",
                                "--max-new-tokens", "0"])
    one_line(rc, capsys.readouterr().err, "--max-new-tokens must be >= 1 for --e2e, got 0")


def test_remote_code_refusal_names_the_flag(tiny_model_dir, tmp_path, capsys):
    from helpers import run_export_main

    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir("base"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="my-custom-lm", auto_map={"AutoConfig": "configuration_x.XConfig",
                                                    "AutoModelForCausalLM": "modeling_x.XModel"})
    (d / "config.json").write_text(json.dumps(cfg))
    rc, err = run_export_main(capsys, d, tmp_path / "onnx")
    one_line(rc, err, "needs its own Python code", "pass --trust-remote-code")
    assert not (tmp_path / "onnx").exists()


@pytest.mark.parametrize("cli", ["exporter.tune", "exporter.optimize"])
def test_read_only_export_is_refused_before_any_work(cli, out, monkeypatch, capsys):
    """optimize and tune on a read-only file system failed with a raw error (tune only after its run).
    The read-only mount is stood in for by ``os.access`` (tests run as root, for whom chmod is no barrier)."""
    import os

    import exporter.tuning

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m, *a, **k: False if str(p) == str(out) and m & os.W_OK
                        else real(p, m, *a, **k))
    monkeypatch.setattr(exporter.tuning, "choose_tree", _no_work)
    before = _digest(out)
    rc = importlib.import_module(cli).main([str(out)])
    one_line(rc, capsys.readouterr().err, f"{out} is not writable", "copy the export to a writable place")
    assert _digest(out) == before


def test_bench_our_variant_failing_to_start_is_a_user_error_at_any_precision(exported, tmp_path, capsys,
                                                                              monkeypatch):
    """--precisions int8 with an unknown --load-option: ours-ar-int8 and ours-spec-int8 were skipped and
    bench exited 0 (only fp32 systems were checked). The variant is stood in for by the export itself."""
    import exporter.bench as b
    from exporter.benchmark import systems as S

    out = exported("medusa")
    monkeypatch.setattr(S, "ours_variant", lambda *a, **k: (out, ""))
    logs = tmp_path / "logs"
    rc = b.main([str(out), *BENCH_TINY, "--precisions", "int8", "--load-option", "no_such_option=1",
                 "--logs", str(logs)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: ours-ar-int8 could not start: "), err
    assert f"worker log: {logs / 'ours-ar-int8.log'}" in err[-1] and (logs / "ours-ar-int8.log").is_file()


def test_bench_variant_the_optimize_stage_refuses_is_a_user_error(exported, capsys, monkeypatch):
    import exporter.bench as b
    from exporter.benchmark import systems as S

    monkeypatch.setattr(S, "ours_variant", lambda *a, **k: (None, "optimize_export(quantize='int4') failed: "
                                                                  "UserError: OUT is already optimized"))
    rc = b.main([str(exported("medusa")), *BENCH_TINY, "--precisions", "int4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: ours-ar-int4 could not start: optimize_export"), err
    assert "already optimized" in err[-1] and "no worker was started" in err[-1], err[-1]


@pytest.fixture
def no_variants(monkeypatch):
    """Fail the test if bench --variants prepares a variant (the checks must come first)."""
    from exporter.benchmark import variants

    monkeypatch.setattr(variants, "prepare", _no_work)


def test_bench_variants_bad_tree_is_refused_before_any_variant(exported, tmp_path, capsys, no_variants):
    """--variants ignored --tree (and --load-option, --prompts-file, --logs) silently; a bad one is now
    refused before the optimize runs."""
    import exporter.bench as b

    t = tmp_path / "tree.json"
    t.write_text("[[999]]")
    rc = b.main([str(exported("medusa")), "--variants", "raw,int8", "--tree", str(t)])
    one_line(rc, capsys.readouterr().err, "--tree: ", "rank 999")


def test_bench_variants_unknown_load_option_is_refused_before_any_variant(exported, capsys, no_variants):
    import exporter.bench as b

    rc = b.main([str(exported("medusa")), "--variants", "raw", "--load-option", "no_such_option=1"])
    one_line(rc, capsys.readouterr().err, "--load-option no_such_option", "graphs.load() takes no no_such_option",
             "drop it")


@pytest.mark.parametrize("flag", ["--model-dir", "--precisions"])
def test_bench_variants_refuses_flags_it_would_ignore(exported, tiny_model_dir, capsys, no_variants, flag):
    import exporter.bench as b

    value = str(tiny_model_dir("medusa")) if flag == "--model-dir" else "int4"
    rc = b.main([str(exported("medusa")), "--variants", "raw", flag, value])
    one_line(rc, capsys.readouterr().err, f"{flag} does not apply to --variants", "drop it")


def test_bench_variants_tampered_export_is_refused_naming_its_file(exported, tmp_path, capsys, no_variants):
    """A tampered file was found only in a variant's copy (a path in a deleted work directory)."""
    import exporter.bench as b

    out = tmp_path / "out"
    shutil.copytree(exported("medusa"), out)
    cfg = out / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().rstrip()[:-1] + ', "chat_template": "{{ 7 * 7 }}"}')
    rc = b.main([str(out), "--variants", "raw"])
    one_line(rc, capsys.readouterr().err, str(cfg), "sha256")


def test_bench_variants_end_to_end_failure_names_the_kept_logs(exported, tmp_path, monkeypatch):
    """A variant whose end-to-end bench fails: the error names the workers' logs, which are kept."""
    from exporter.benchmark import run as R
    from exporter.benchmark import variants
    from exporter.loading import UserError

    logs = tmp_path / "logs"
    seen = {}

    def bench(d, opts, log=None):
        seen["opts"] = opts
        return {"systems": [{"name": "ours-ar", "status": "ok"},
                            {"name": "ours-spec", "status": "failed", "reason": "run failed: hooked"}],
                "logs": opts.logs, "failed": ["ours-spec"]}

    monkeypatch.setattr(R, "bench", bench)
    with pytest.raises(UserError, match=rf"variant raw: the bench did not run \(run failed: hooked; worker logs: "
                                        rf"{logs / 'raw'}\)"):
        variants.end_to_end({"raw": exported("medusa")}, 4, 1, 1, 1, False, lambda *a, **k: None,
                            tree=[[0]], load_options={"adaptive": False}, logs=str(logs))
    assert seen["opts"].tree == [[0]] and seen["opts"].load_options == {"adaptive": False}
