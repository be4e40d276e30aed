"""The package's import graph: no cycles, and the library does not import
its own benchmark suite (scripts/import_graph.py; reads the source, a
fraction of a second)."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "import_graph.py"


def _checker():
    spec = importlib.util.spec_from_file_location("memscale_import_graph", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checker():
    return _checker()


def test_no_import_cycles(checker):
    loops = checker.cycles(checker.graph())
    assert not loops, "import cycles in memscale/: " + "; ".join(" <-> ".join(c) for c in loops)


def test_the_script_exits_0_without_cycles():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cycles"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "no import cycles"


def test_the_checker_sees_a_cycle_through_a_function_level_import(checker, tmp_path):
    # A package whose two modules import each other, one of them inside a
    # function and one under TYPE_CHECKING (which never runs): the first
    # pair is a cycle, the second is not.
    pkg = tmp_path / "memscale"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("from . import d\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
    )
    assert checker.cycles(checker.graph(pkg)) == [["memscale.a", "memscale.b"]]


def _benchmark_imports(path: pathlib.Path, module: str) -> list[str]:
    """The ``memscale.benchmarks`` modules ``path`` imports, at any level."""
    package = module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package
                for _ in range(node.level - 1):
                    up = up.rpartition(".")[0]
                base = f"{up}.{base}" if base else up
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [
            n for n in names if n == "memscale.benchmarks" or n.startswith("memscale.benchmarks.")
        ]
    return found


def test_the_library_does_not_import_the_benchmark_suite(checker):
    # Through the checker's graph (every import statement, resolved) and
    # through the source itself (also what the graph folds into a parent).
    mods = checker.modules()
    edges = checker.graph()
    outside = {
        m for m in mods if m != "memscale.benchmarks" and not m.startswith("memscale.benchmarks.")
    }
    assert outside and "memscale.api" in outside
    wrong = {
        m: sorted(
            t
            for t in edges[m]
            if t == "memscale.benchmarks" or t.startswith("memscale.benchmarks.")
        )
        for m in outside
    }
    wrong = {m: t for m, t in wrong.items() if t}
    for m in outside:
        path = mods[m]
        module = m if path.name != "__init__.py" else m + ".__init__"
        hits = _benchmark_imports(path, module)
        if hits:
            wrong.setdefault(m, sorted(set(hits)))
    assert not wrong, f"library modules import memscale.benchmarks: {wrong}"


def test_the_benchmark_check_sees_an_import(checker, tmp_path):
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from .benchmarks import measure\n")
    assert _benchmark_imports(path, "memscale.x") == [
        "memscale.benchmarks",
        "memscale.benchmarks.measure",
    ]
