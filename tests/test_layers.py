"""The layers of docs/DESIGN.md, enforced: imports flow CLIs -> pipeline -> stages -> graphs, one way.

Scans every module of ``exporter`` and ``graphs`` with ``ast``, function-local imports included
(what linters skip), and fails on

- an import cycle (a strongly connected component of more than one module);
- ``graphs`` importing ``exporter`` (the runtime ships without the exporter);
- a stage (any exporter module that is neither a CLI, the pipeline nor the benchmark) importing the
  pipeline, a CLI or the benchmark; the pipeline importing a CLI or the benchmark;
- ``from x import _name`` or ``module._name`` across modules (tests aside).

``python tests/test_layers.py`` prints the graph: modules, arrows, cycles, private imports.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("exporter", "graphs")

# python -m exporter.<verb>: thin command lines, the top layer
CLIS = {"exporter.export", "exporter.optimize", "exporter.tune", "exporter.compare", "exporter.bench",
        "exporter.generate"}
PIPELINE = {"exporter.pipeline", "exporter.mainjob"}  # mainjob: the main job, a pipeline of pipelines
BENCHMARK_PREFIX = "exporter.benchmark"  # the benchmark and bench --variants: above the pipeline

# Known exceptions: none. (Until the runtime rewrite landed, graphs.eagle_draft <-> graphs.runtime was
# a cycle and graphs.adaptive / graphs.eagle_draft took private names from graphs.trees / graphs.runtime.)
# An entry here is a frozenset of the modules of a cycle, or (importer, imported, name).
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()


def modules(root: Path = REPO) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _resolve(name: str | None, current: str, is_pkg: bool, level: int) -> str:
    if level == 0:
        return name or ""
    base = current.split(".") if is_pkg else current.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _owner(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def scan(root: Path = REPO):
    """(modules, {module: set of modules it imports}, [(importer, imported, private name)])."""
    mods = modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private: list[tuple[str, str, str]] = []
    for m, f in mods.items():
        tree = ast.parse(f.read_text(), str(f))
        is_pkg = f.name == "__init__.py"
        aliases: dict[str, str] = {}  # local name -> module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    tgt = _owner(a.name, mods)
                    if tgt and tgt != m:
                        edges[m].add(tgt)
                    if a.asname:
                        if tgt:
                            aliases[a.asname] = tgt
                    elif a.name.split(".")[0] in mods:
                        aliases[a.name.split(".")[0]] = a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(node.module, m, is_pkg, node.level)
                for a in node.names:
                    full = f"{src}.{a.name}" if src else a.name
                    tgt = _owner(full, mods)
                    if not tgt or tgt == m:
                        continue
                    edges[m].add(tgt)
                    if full in mods:
                        aliases[a.asname or a.name] = full
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        private.append((m, tgt, a.name))
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                tgt = aliases.get(node.value.id)
                if tgt and tgt != m and node.attr.startswith("_") and not node.attr.startswith("__"):
                    private.append((m, tgt, node.attr))
    return mods, edges, sorted(set(private))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(out)


def layer(m: str) -> str:
    if m.startswith("graphs"):
        return "graphs"
    if m in CLIS:
        return "cli"
    if m in PIPELINE:
        return "pipeline"
    if m == BENCHMARK_PREFIX or m.startswith(BENCHMARK_PREFIX + "."):
        return "benchmark"
    return "stage"


# what each layer may not import
FORBIDDEN = {
    "graphs": {"cli", "pipeline", "benchmark", "stage"},  # graphs imports graphs only
    "stage": {"cli", "pipeline", "benchmark"},
    "pipeline": {"cli", "benchmark"},
    "benchmark": {"cli"},
    "cli": set(),
}


def layer_violations(edges) -> list[str]:
    return sorted(f"{m} ({layer(m)}) imports {t} ({layer(t)})"
                  for m, ts in edges.items() for t in ts if layer(t) in FORBIDDEN[layer(m)])


def summary(root: Path = REPO) -> str:
    mods, edges, private = scan(root)
    lines = [f"{len(mods)} modules, {sum(map(len, edges.values()))} import arrows (function-local included)"]
    found = cycles(edges)
    for c in found:
        known = " (known exception)" if frozenset(c) in KNOWN_CYCLES else ""
        lines.append(f"cycle of {len(c)}: {', '.join(c)}{known}")
    for m, t, name in private:
        known = " (known exception)" if (m, t, name) in KNOWN_PRIVATE else ""
        lines.append(f"private across modules: {m} takes {name} from {t}{known}")
    for v in layer_violations(edges):
        lines.append(f"layer violation: {v}")
    lines.append(f"{len(found)} cycles, {len(private)} private imports across modules")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the tests


def test_no_import_cycles():
    print(summary())  # pytest -s tests/test_layers.py shows the graph
    _, edges, _ = scan()
    found = [c for c in cycles(edges) if frozenset(c) not in KNOWN_CYCLES]
    assert not found, "import cycles (function-local imports count): " + "; ".join(" <-> ".join(c) for c in found)


def test_graphs_never_imports_exporter():
    _, edges, _ = scan()
    bad = sorted(f"{m} imports {t}" for m, ts in edges.items() if m.startswith("graphs")
                 for t in ts if t.startswith("exporter"))
    assert not bad, "graphs/ must not import exporter/: " + "; ".join(bad)


def test_imports_flow_down_the_layers():
    """CLIs -> benchmark -> pipeline -> stages -> graphs: a stage never imports the pipeline, a CLI or the
    benchmark, and the pipeline neither a CLI nor the benchmark."""
    _, edges, _ = scan()
    bad = layer_violations(edges)
    assert not bad, "imports against the layers (docs/DESIGN.md): " + "; ".join(bad)


def test_no_private_names_across_modules():
    _, _, private = scan()
    bad = [p for p in private if p not in KNOWN_PRIVATE]
    assert not bad, "private names used across modules (make them public API): " + "; ".join(
        f"{m} takes {name} from {t}" for m, t, name in bad)


def test_the_scan_sees_function_local_imports_and_private_names(tmp_path):
    """The scanner itself: a cycle through a function-local import, a private name, a stage above a CLI."""
    pkg = tmp_path / "exporter"
    pkg.mkdir()
    (tmp_path / "graphs").mkdir()
    (pkg / "__init__.py").write_text("")
    (tmp_path / "graphs" / "__init__.py").write_text("")
    (pkg / "plan.py").write_text("def f():\n    from exporter.trace import _helper\n    return _helper\n")
    (pkg / "trace.py").write_text("import exporter.plan as p\n\ndef _helper():\n    return p._x\n")
    (pkg / "export.py").write_text("from exporter import plan\n")
    (pkg / "validate.py").write_text("def g():\n    import exporter.export\n")
    (tmp_path / "graphs" / "runtime.py").write_text("from exporter import plan\n")
    _, edges, private = scan(tmp_path)
    assert cycles(edges) == [["exporter.plan", "exporter.trace"]]
    assert ("exporter.plan", "exporter.trace", "_helper") in private
    assert ("exporter.trace", "exporter.plan", "_x") in private
    assert layer_violations(edges) == ["exporter.validate (stage) imports exporter.export (cli)",
                                       "graphs.runtime (graphs) imports exporter.plan (stage)"]


if __name__ == "__main__":
    print(summary(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO))
