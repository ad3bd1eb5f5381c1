"""The package's imports point one way: no module of fusetune imports, directly or through
others, a module that imports it back. Imports inside functions count: one that is made late
still closes a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import fusetune

ROOT = Path(fusetune.__file__).parent


def _modules() -> dict[str, Path]:
    """fusetune's modules by dotted name (a package by its own name)."""
    out: dict[str, Path] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The fusetune modules that module `name` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in modules:  # `import fusetune.x.y as z`
                    target = target.rpartition(".")[0]
                if target:
                    out.add(target)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"  # `from fusetune.kernels import ffn`: the module
                if sub in modules:
                    out.add(sub)
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    modules = _modules()
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert "fusetune.runtime" in graph["fusetune.kernels.ffn"]  # the scan sees late imports
    assert _cycles(graph) == []


def test_cycle_detection_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
