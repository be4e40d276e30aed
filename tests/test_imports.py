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


@pytest.mark.parametrize(("public", "internal"), [("offload", "_offload"), ("tiling", "_tiling")])
def test_a_public_module_only_re_exports_its_public_names(public, internal):
    pub = importlib.import_module(f"memscale.{public}")
    impl = importlib.import_module(f"memscale.{internal}")
    own = {n for n in vars(pub) if not n.startswith("__")}
    assert own == set(pub.__all__)
    assert all(getattr(pub, n) is getattr(impl, n) for n in pub.__all__)


def _private_reaches(path: pathlib.Path, module: str, mods: set[str]) -> list[str]:
    """``mod._name``, ``Class._name`` and ``from mod import _name`` where
    ``mod`` is another memscale module (``Class`` a name imported from one)
    and ``_name`` is not a module of its own."""
    package = module.rpartition(".")[0]

    def absolute(node: ast.ImportFrom) -> str:
        base = node.module or ""
        if not node.level:
            return base
        up = package
        for _ in range(node.level - 1):
            up = up.rpartition(".")[0]
        return f"{up}.{base}" if base else up

    def is_module(name: str) -> bool:
        return name in mods or name == "memscale._core"

    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # local name -> memscale module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = absolute(node)
            if not base.startswith("memscale"):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if is_module(full) or not alias.name.startswith("_"):
                    # a module, or a public name of one (a class, say)
                    bound[alias.asname or alias.name] = full
                elif not alias.name.startswith("__"):
                    found.append(f"from {base} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("memscale.") and alias.asname:
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not is_module(f"{bound[node.value.id]}.{node.attr}")
        ):
            found.append(f"{bound[node.value.id]}.{node.attr}")
    return sorted(set(found))


def test_no_module_reaches_into_another_modules_private_names(checker):
    mods = checker.modules()
    names = set(mods)
    wrong = {}
    for m, path in mods.items():
        module = m if path.name != "__init__.py" else m + ".__init__"
        hits = _private_reaches(path, module, names)
        if hits:
            wrong[m] = hits
    assert not wrong, f"private names used across modules: {wrong}"


def test_the_private_name_check_sees_a_reach(tmp_path):
    path = tmp_path / "x.py"
    path.write_text(
        "from . import _verify, api\nfrom ._verify import _diff\nfrom .optim import Adam\n"
        "def f():\n    return _verify._named(api._select(Adam._bits()))\n"
    )
    mods = {"memscale._verify", "memscale.api", "memscale.optim"}
    assert _private_reaches(path, "memscale.x", mods) == [
        "from memscale._verify import _diff",
        "memscale._verify._named",
        "memscale.api._select",
        "memscale.optim.Adam._bits",
    ]


# ---- one caller of the C planner (memscale/_solve.py) ----------------------


def _calls_build_plan(path: pathlib.Path) -> list[int]:
    """Lines of ``path`` that name ``build_plan`` in code (an attribute, a
    name, an import or a string such as getattr's), not in docstrings."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            (isinstance(node, ast.Attribute) and node.attr == "build_plan")
            or (isinstance(node, ast.Name) and node.id == "build_plan")
            or (isinstance(node, ast.Constant) and node.value == "build_plan")
            or (
                isinstance(node, ast.ImportFrom)
                and any(alias.name == "build_plan" for alias in node.names)
            )
        ):
            lines.append(node.lineno)
    return lines


def test_only_the_solve_module_calls_the_c_planner():
    callers = {}
    for path in sorted((ROOT / "memscale").rglob("*.py")):
        lines = _calls_build_plan(path)
        if lines:
            callers[str(path.relative_to(ROOT))] = lines
    assert list(callers) == ["memscale/_solve.py"], callers


def test_the_check_finds_a_call(tmp_path):
    # The test above can fail: a call through an alias or getattr is seen.
    probe = tmp_path / "probe.py"
    for source in (
        "from . import _core\nplan = _core.build_plan([], **kw)\n",
        "import memscale._core as c\nf = getattr(c, 'build_plan')\n",
        "from ._core import build_plan\n",
    ):
        probe.write_text(source)
        assert _calls_build_plan(probe), source
    probe.write_text('"""Nothing here calls _core.build_plan."""\n')
    assert not _calls_build_plan(probe)
