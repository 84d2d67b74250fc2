"""GACT's module layout: no import cycle inside the package, and the plain-PyTorch controller reaches no Megatron
code (every import counted, function-level ones included)."""

from __future__ import annotations

import ast
import pathlib

import megatron_adacc.gact as gact_package

PACKAGE = "megatron_adacc.gact"
ROOT = pathlib.Path(gact_package.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


def _graph() -> dict[str, set[str]]:
    modules = {f"{PACKAGE}.{p.stem}": p for p in ROOT.glob("*.py") if p.stem != "__init__"}
    return {name: _imports(path) for name, path in modules.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph.get(name, ()))
    return seen


def test_no_import_cycle_between_gact_modules():
    graph = _graph()
    for name in graph:
        back = [dep for dep in graph[name] if dep in graph and name in _reachable(graph, dep)]
        assert not back, f"{name} is in an import cycle through {back}"


def test_the_controller_never_reaches_megatron_code():
    reached = _reachable(_graph(), f"{PACKAGE}.controller")
    assert f"{PACKAGE}.megatron" not in reached and f"{PACKAGE}.extension" not in reached
    assert not [n for n in reached if n == "megatron" or n.startswith("megatron.")]
