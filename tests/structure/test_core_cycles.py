"""No import cycles between core modules, counting imports made only for type checking."""

from __future__ import annotations

import ast
import os

import execrt
from tests.structure.test_layering import CORE_MODULES

ROOT = os.path.dirname(execrt.__file__)


def core_imports(module: str) -> set[str]:
    """The core modules ``module`` imports anywhere in its source (TYPE_CHECKING blocks and
    function bodies included)."""
    path = os.path.join(ROOT, *module.split(".")[1:]) + ".py"
    if not os.path.exists(path):
        path = os.path.join(path[:-3], "__init__.py")
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n in CORE_MODULES and n != module}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_core_modules_import_each_other_without_cycles() -> None:
    graph = {m: core_imports(m) for m in CORE_MODULES}
    assert graph["execrt.core.model_runner"], "the import scan found nothing"
    found = cycles(graph)
    assert not found, "import cycles between core modules: " + "; ".join(
        " <-> ".join(c) for c in found
    )
