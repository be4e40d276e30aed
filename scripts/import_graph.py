"""Print the import graph of the ``memscale`` package and its cycles.

Every ``import`` statement counts, at module level or inside a function
(``if TYPE_CHECKING:`` blocks excepted: they never run).  An edge from a
module to one of its own parent packages is left out: Python imports the
parents first anyway, so it cannot close a loop of its own.

    python scripts/import_graph.py            # edges, then cycles
    python scripts/import_graph.py --cycles   # cycles only; exit 1 if any

Standard library only; reads the source, imports nothing.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "memscale"


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    out: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_only(node):
            stack.extend(node.orelse)  # type: ignore[attr-defined]
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return out


def graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package
                    for _ in range(node.level - 1):
                        up = up.rpartition(".")[0]
                    base = up + ("." + base if base else "")
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                if target.split(".")[0] != "memscale":
                    continue
                hit = resolve(target)
                if hit and hit != mod and not mod.startswith(hit + "."):
                    edges[mod].add(hit)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges) + 100))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", action="store_true", help="print only the cycles")
    args = parser.parse_args(argv)
    edges = graph()
    if not args.cycles:
        for mod in sorted(edges):
            print(f"{mod} -> {', '.join(sorted(edges[mod])) or '(nothing in memscale)'}")
    loops = cycles(edges)
    for loop in loops:
        print("cycle:", " <-> ".join(loop))
    if not loops:
        print("no import cycles")
    return 1 if loops else 0


if __name__ == "__main__":
    sys.exit(main())
