"""The command lines as a new user meets them: every option documents its default, the README's main
command can be run twice, a hub id is read from the local HF cache (never downloaded), remote code
runs only when asked, and the export directory is one that HF tools read."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import subprocess

import pytest
from conftest import run_module

from exporter.cli import HelpFormatter
from exporter.loading import UserError

CLIS = ["exporter.export", "exporter.generate", "exporter.compare", "exporter.bench", "exporter.optimize",
        "exporter.tune", "graphs.serve.__main__", "graphs.serve.loadgen"]


class _ParsedError(Exception):
    pass


def _parser_of(module: str, monkeypatch) -> argparse.ArgumentParser:
    """The ArgumentParser a CLI's main() builds, captured when it parses."""
    import importlib

    seen = []

    def capture(self, *a, **k):
        seen.append(self)
        raise _ParsedError

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_intermixed_args", capture)
    with pytest.raises(_ParsedError):
        importlib.import_module(module).main([])
    return seen[0]


@pytest.mark.parametrize("module", CLIS)
def test_every_option_has_help_with_its_default(module, monkeypatch):
    ap = _parser_of(module, monkeypatch)
    shows_defaults = issubclass(ap.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    for action in ap._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"{module} {name} has no help text"
        if action.option_strings and action.default not in (None, False):
            assert shows_defaults or "default" in action.help, f"{module} {name}: default not shown"
        if action.option_strings and action.default is None and action.required is False:
            # None shows nothing: the help itself must say what happens when it is left out
            assert "default" in action.help or action.nargs == 0, f"{module} {name}: say what unset means"


def test_help_formatter_adds_defaults():
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter)
    ap.add_argument("--n", type=int, default=3, help="how many")
    ap.add_argument("--x", help="thing (default: the manifest's)")
    text = ap.format_help()
    assert "how many (default: 3)" in text and "(default: None)" not in text


# ------------------------------------------------------------------------------------------
# the README's main command, twice


def test_main_command_twice_reuses_the_demo_and_replaces_its_own_export(tmp_path, monkeypatch):
    import exporter.demo
    from exporter.demo_model import DemoSpec, build_demo_model
    from exporter.export import main

    built = []
    monkeypatch.setattr(exporter.demo, "build_demo_model",
                        lambda d: built.append(d) or build_demo_model(d, spec=DemoSpec.tiny(), log=lambda *a: None))
    monkeypatch.chdir(tmp_path)

    def run():
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()) as err:
            rc = main(["--tiny"])
        return rc, out.getvalue(), err.getvalue()

    rc, out, err = run()
    assert rc == 0, err
    assert "building the demo model in spec-demo-tiny/model" in out and len(built) == 1
    first = json.loads((tmp_path / "spec-demo-tiny/onnx/manifest.json").read_text())
    rc, out, err = run()
    assert rc == 0, err
    assert len(built) == 1, "the second run must reuse the demo model"
    assert "reusing the demo model in spec-demo-tiny/model" in out
    assert "replacing the earlier demo export in spec-demo-tiny/onnx" in out
    assert json.loads((tmp_path / "spec-demo-tiny/onnx/manifest.json").read_text())["files"] == first["files"]
    assert sorted(p.name for p in (tmp_path / "spec-demo-tiny").iterdir()) == ["model", "onnx"]  # no temporaries left
    # something that is not an export of ours is never replaced without --overwrite
    shutil.rmtree(tmp_path / "spec-demo-tiny/onnx")
    (tmp_path / "spec-demo-tiny/onnx").mkdir()
    (tmp_path / "spec-demo-tiny/onnx/notes.txt").write_text("mine")
    rc, out, err = run()
    assert rc == 2 and "is not empty; pass --overwrite" in err
    assert (tmp_path / "spec-demo-tiny/onnx/notes.txt").read_text() == "mine"


def test_readme_outputs_are_git_ignored():
    """What the README's commands write (the demo, --json/--png/--out files, build outputs) is ignored."""
    import re

    from conftest import REPO

    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    written = re.findall(r"--(?:json|png|out)\s+([^\s\]]+)", "\n".join(blocks))
    assert len(written) >= 2, "the README's commands changed: update this test"
    names = [*written, "spec-demo-tiny/model/config.json", "spec-demo-tiny/onnx/base.onnx", "build/lib/x.py",
             "specexport.egg-info/PKG-INFO"]
    proc = subprocess.run(["git", "check-ignore", "--no-index", *names], cwd=REPO, capture_output=True, text=True)
    assert sorted(proc.stdout.split()) == sorted(names), f"not ignored: {set(names) - set(proc.stdout.split())}"


# ------------------------------------------------------------------------------------------
# the export directory other tools read


def test_export_dir_is_read_by_hf_tools(exported, tiny_model_dir, tmp_path):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out = exported("eagle")
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "llama" and not hasattr(config, "speculative_decoding")
    assert config.num_hidden_layers == AutoConfig.from_pretrained(tiny_model_dir("eagle")).num_hidden_layers
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("hello")["input_ids"] == AutoTokenizer.from_pretrained(tiny_model_dir("eagle"))("hello")["input_ids"]
    assert GenerationConfig.from_pretrained(out).eos_token_id == 2


def test_chat_template_files_are_copied(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from exporter.export import export

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("base"), model_dir)
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                                                   "{% endfor %}")
    (model_dir / "special_tokens_map.json").write_text('{"eos_token": "</s>"}')
    export(model_dir, tmp_path / "onnx", validate=False, log=lambda *a, **k: None)
    for name in ("chat_template.jinja", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "onnx" / name).read_bytes() == (model_dir / name).read_bytes()
    tok = AutoTokenizer.from_pretrained(tmp_path / "onnx")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<user>hi"


# ------------------------------------------------------------------------------------------
# hub ids from the local cache


def _fake_cache(root, model_dir, repo_id="acme/tiny-medusa", commit="0123456789abcdef0123456789abcdef01234567"):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    return repo / "snapshots" / commit


def test_resolve_model_reads_the_local_cache_only(tiny_model_dir, tmp_path, monkeypatch):
    from exporter.hub import resolve_model

    snap = _fake_cache(tmp_path / "cache", tiny_model_dir("medusa"))
    assert resolve_model("acme/tiny-medusa", cache_dir=tmp_path / "cache") == snap
    local = tmp_path / "acme" / "dir"  # a local path that looks like an id wins
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("acme/dir", cache_dir=tmp_path / "cache") == local.relative_to(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(UserError, match=r"acme/absent is neither a directory nor a model in the local Hugging Face "
                                        r"cache .*; download it first \(hf download acme/absent\)"):
        resolve_model("acme/absent", cache_dir=tmp_path / "cache")


def test_export_cli_takes_a_hub_id(tiny_model_dir, tmp_path):
    cache = tmp_path / "hub"
    _fake_cache(cache, tiny_model_dir("medusa"))
    env = {"HF_HUB_CACHE": str(cache)}
    proc = run_module("exporter.export", "acme/tiny-medusa", tmp_path / "onnx", "--no-validate", env=env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "onnx" / "draft.onnx").is_file() and (tmp_path / "onnx" / "config.json").is_file()
    proc = run_module("exporter.export", "acme/absent", tmp_path / "onnx2", env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: acme/absent is neither a directory nor a model in the local Hugging Face cache ({cache}); "
        f"download it first (hf download acme/absent) or pass a model directory"]


def test_remote_code_only_when_asked(tiny_model_dir, tmp_path, monkeypatch):
    import exporter.export as ex
    import exporter.loading

    seen = []
    monkeypatch.setattr(exporter.loading, "load_model", lambda *a, **k: seen.append(k.get("trust_remote_code")) or
                        (_ for _ in ()).throw(UserError("stop here")))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert ex.main([str(tiny_model_dir("medusa")), str(tmp_path / "a")]) == 2
        assert ex.main([str(tiny_model_dir("medusa")), str(tmp_path / "b"), "--trust-remote-code"]) == 2
    assert seen == [False, True]
