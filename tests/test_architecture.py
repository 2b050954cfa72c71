"""The layout is the architecture: every import (module level or inside a function) goes down the
layers or stays in its own, and no set of modules imports itself in a circle."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
# Lowest first. A module may import its own layer and any layer below, never one above.
LAYERS = (
    ("fibquant._json", "fibquant._extras", "fibquant._numba", "fibquant.paths", "fibquant.canonical", "fibquant.data"),
    ("fibquant.codebook",),
    ("fibquant.codecs",),
    ("fibquant.archive", "fibquant.peers"),
    ("fibquant.kv",),
    ("fibquant.eval", "fibquant.integrations"),
    ("fibquant.cli",),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the fibquant modules it imports anywhere in its source (relative imports resolved)."""
    paths = {_module_name(p): p for p in (SRC / "fibquant").rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def layer_of(module: str) -> int | None:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None  # the top-level package (lazy public API)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1
        stack.append(root); on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1
                    stack.append(child); on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop(); on_stack.discard(member); component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    for module in sorted(graph):
        if module not in index:
            visit(module)
    return out


def test_every_module_has_a_layer():
    assert [m for m in import_graph() if m != "fibquant" and layer_of(m) is None] == []


def test_no_import_runs_up_the_layers():
    graph = import_graph()
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    if m != "fibquant" and layer_of(t) is not None and layer_of(t) > layer_of(m))
    assert upward == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_checks_can_fail():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert layer_of("fibquant.kv.cache") > layer_of("fibquant.codecs.base")
    assert layer_of("fibquant.cli.archive") > layer_of("fibquant.eval.report")

