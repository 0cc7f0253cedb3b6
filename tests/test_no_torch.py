"""The runtime needs neither torch nor transformers (nor optimum): proven with them made unimportable.

A ``sitecustomize.py`` in a temporary directory on ``PYTHONPATH`` puts an import finder first on
``sys.meta_path`` that raises ``ModuleNotFoundError`` for those packages, so a subprocess behaves as
if they were not installed. In it, ``import graphs``, ``graphs.load`` and full ``generate`` /
``stream`` runs (speculative Medusa, EAGLE, EAGLE-3, and a base-only export) must work and leave no
torch/transformers module in ``sys.modules``; their tokens must equal those of the same calls made
here, with torch importable. A static check parses every file in ``graphs/`` for such imports.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, run_module

import graphs

BLOCKED = ("torch", "transformers", "optimum")
KINDS = ("medusa", "eagle", "eagle3", "base")

SITECUSTOMIZE = f"""
import importlib.abc
import sys

BLOCKED = {BLOCKED!r}


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by test_no_torch)", name=name)
        return None


sys.meta_path.insert(0, _Blocker())
"""

# The calls made in both processes; prints {kind: {call: token ids}} as JSON.
CALLS = """
import json
import sys

import graphs


def calls(out_dir):
    # adaptive=False: the policy follows measured times, so how a stream is cut into steps could
    # differ between the two processes (the tokens could not)
    dec = graphs.load(out_dir, provider="cpu", threads=1, adaptive=False)
    res = {
        "auto": dec.generate([5, 9, 3], max_new_tokens=12).token_ids,
        "autoregressive": dec.generate([5, 9, 3], max_new_tokens=12, mode="autoregressive").token_ids,
        "batch": [r.token_ids for r in dec.generate([[5, 9, 3], [7], [4, 4, 4, 4, 4, 4]], max_new_tokens=9)],
        "text": dec.generate("hello", max_new_tokens=6).token_ids,
        "sampled": dec.generate([5, 9, 3], max_new_tokens=10, temperature=0.8, top_p=0.9, top_k=50,
                                seed=0).token_ids,
        "stream": [e.token_ids for e in dec.stream([8, 6], max_new_tokens=7)],
    }
    if dec.kind:
        res["mean_accepted_length"] = dec.generate([5, 9, 3], max_new_tokens=12).stats.mean_accepted_length > 0
        res["speculative"] = dec.generate([5, 9, 3], max_new_tokens=12, mode="speculative").token_ids
    return res
"""


@pytest.fixture(scope="module")
def export_dirs(exported):
    return {kind: exported(kind) for kind in KINDS}


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory):
    """Environment for a subprocess in which torch, transformers and optimum cannot be imported."""
    d = tmp_path_factory.mktemp("no_torch")
    (d / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(filter(None, [str(d), str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def _run(code: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_blocker_blocks(blocked_env):
    code = textwrap.dedent("""
        for name in ("torch", "transformers", "optimum", "torch.nn"):
            try:
                __import__(name)
            except ImportError:
                continue
            raise SystemExit(f"{name} imported")
        import numpy, onnxruntime, tokenizers  # what the runtime does need
        print("ok")
    """)
    proc = _run(code, blocked_env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_generate_without_torch(export_dirs, blocked_env):
    code = CALLS + textwrap.dedent(f"""
        dirs = {json.dumps({k: str(v) for k, v in export_dirs.items()})}
        out = {{kind: calls(d) for kind, d in dirs.items()}}
        leaked = sorted(m for m in sys.modules if m.partition(".")[0] in {BLOCKED!r})
        print(json.dumps({{"results": out, "leaked": leaked}}))
    """)
    proc = _run(code, blocked_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["leaked"] == []
    # the same calls here, with torch importable (and imported by the exporter): identical tokens
    ns: dict = {}
    exec(CALLS, ns)
    for kind, d in export_dirs.items():
        want = json.loads(json.dumps(ns["calls"](d)))
        assert got["results"][kind] == want, kind
        if kind != "base":
            assert want["speculative"] == want["autoregressive"]  # greedy is lossless
        streamed = [t for step in want["stream"] for t in step]
        assert streamed == graphs.load(d, provider="cpu").generate([8, 6], max_new_tokens=7).token_ids


def test_generate_cli_without_torch(export_dirs, blocked_env):
    proc = subprocess.run([sys.executable, "-m", "exporter.generate", str(export_dirs["eagle"]), "--prompt", "hi",
                           "--max-new-tokens", "5", "--provider", "cpu"], cwd=REPO, env=blocked_env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("hi") and "mean accepted length" in proc.stderr


def test_generate_cli(export_dirs):
    """The same command with torch installed (what a user runs today)."""
    proc = run_module("exporter.generate", export_dirs["eagle"], "--prompt", "hi", "--max-new-tokens", "5",
                      "--provider", "cpu", timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("hi") and "mean accepted length" in proc.stderr


def _imports(path: Path) -> list[tuple[str, int]]:
    """(top-level module, line) of every import in a file, including __import__/import_module calls."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name.partition(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.partition(".")[0], node.lineno))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("__import__", "import_module")):
            found.append((node.args[0].value.partition(".")[0], node.lineno))
    return found


def test_graphs_never_imports_torch_statically():
    files = sorted((REPO / "graphs").rglob("*.py"))
    assert len(files) >= 5
    bad = [f"{f.relative_to(REPO)}:{line} imports {mod}" for f in files for mod, line in _imports(f)
           if mod in BLOCKED or mod == "exporter"]
    assert not bad, "graphs/ must stay torch-free (and must not import exporter): " + "; ".join(bad)
