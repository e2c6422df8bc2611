"""The engine side's import layers: no cycle, no import inside a function to dodge one."""

from __future__ import annotations

import ast
from pathlib import Path

import kvevents

ROOT = Path(kvevents.__file__).parent
# Imports inside functions that load an optional dependency (torch) on first use.
OPTIONAL = {
    ("kvevents.publishers.offload", "kvevents.publishers.offload"),  # lazy transfer names
    ("kvevents.sim.offload", "kvevents.publishers.offload.transfer"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(packages: list[str]) -> tuple[dict[str, set[str]], list[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    nested: list[str] = []
    for name, path in modules.items():
        if not any(name == p or name.startswith(p + ".") for p in packages):
            continue
        tree = ast.parse(path.read_text())
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvevents"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in modules else str(node.module))
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    module = node.module if isinstance(node, ast.ImportFrom) else None
                    if (module or "").startswith("kvevents") and (name, module) not in OPTIONAL:
                        nested.append(f"{name}.{fn.name} imports {module}")
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph, nested


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_engine_side_and_codec_have_no_import_cycle_and_no_nested_imports() -> None:
    graph, nested = _graph(["kvevents.publishers", "kvevents.codec", "kvevents.sim.offload"])
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"
    assert nested == []
