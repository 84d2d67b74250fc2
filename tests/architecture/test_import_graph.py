"""The package structure docs/ARCHITECTURE.md documents is the one the imports have.

Reads every module of ``megatron_adacc`` with ``ast`` (module- and function-level imports alike: a lazy import
is still a dependency) and checks each import between packages against the layer order written in
docs/ARCHITECTURE.md: a package imports only packages on lower layers. Strict layering also rules out import
cycles between packages. The same holds for the parts of Adacc (``adacc.policy`` < ``adacc.runtime`` <
``adacc.integration``).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_adacc"
DOC = REPO / "docs" / "ARCHITECTURE.md"


def documented_layers(block: str) -> list[list[str]]:
    """The fenced block after ``<!-- layers: NAME -->`` in the doc, top layer first, one layer a line."""
    text = DOC.read_text()
    match = re.search(rf"<!-- layers: {block} -->\s*```text\n(.*?)```", text, re.S)
    assert match, f"docs/ARCHITECTURE.md has no `<!-- layers: {block} -->` block"
    return [line.split() for line in match.group(1).strip().splitlines()]


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = REPO) -> set[str]:
    """Every ``megatron_adacc`` module ``path`` imports (``from pkg import submodule`` counts the submodule)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}", root))
    return {m for m in found if m.split(".")[0] == "megatron_adacc"}


def _is_module(dotted: str, root: Path) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def registry_entries(path: Path = PACKAGE / "features.py") -> set[str]:
    """The modules the plugin registry imports by name (its ``ENTRIES``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ENTRIES" for t in node.targets):
            return {elt.value for elt in node.value.elts}
    raise AssertionError("megatron_adacc/features.py has no ENTRIES")


def graph() -> dict[str, set[str]]:
    edges = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}
    edges["megatron_adacc.features"] |= registry_entries()
    return edges


def unit(module: str, prefix: str, units: set[str]) -> str | None:
    """The unit (a package or a top-level module under ``prefix``) that ``module`` belongs to."""
    if not module.startswith(prefix + "."):
        return None
    head = module[len(prefix) + 1:].split(".")[0]
    return head if head in units else None


def violations(edges: dict[str, set[str]], prefix: str, layers: list[list[str]],
               exempt: frozenset[str] = frozenset()) -> list[str]:
    rank = {u: len(layers) - i for i, layer in enumerate(layers) for u in layer}
    bad = []
    for source, targets in sorted(edges.items()):
        a = unit(source, prefix, set(rank))
        if a is None or a in exempt:
            continue
        for target in sorted(targets):
            b = unit(target, prefix, set(rank))
            if b is None or b == a:
                continue
            if rank[b] >= rank[a]:
                bad.append(f"{source} imports {target}: {a} may not import {b}")
    return bad


def test_every_package_is_on_a_documented_layer():
    layers = documented_layers("megatron_adacc")
    named = {u for layer in layers for u in layer}
    present = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
               if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert present - named == set(), "packages missing from docs/ARCHITECTURE.md's layers"
    assert named - present == set(), "docs/ARCHITECTURE.md names packages that do not exist"


def test_packages_import_only_lower_layers():
    assert violations(graph(), "megatron_adacc", documented_layers("megatron_adacc")) == []


def test_the_parts_of_adacc_import_only_lower_parts():
    layers = documented_layers("megatron_adacc.adacc")
    present = {p.stem if p.is_file() else p.name for p in (PACKAGE / "adacc").iterdir()
               if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert present == {u for layer in layers for u in layer}
    assert violations(graph(), "megatron_adacc.adacc", layers) == []


def test_the_registry_names_each_features_entry_module():
    entries = registry_entries()
    assert entries == {f"megatron_adacc.{pkg}.feature" for pkg in ("adacc", "comm", "gact", "optim")}
    assert all(_is_module(entry, REPO) for entry in entries)


def test_core_imports_no_other_package():
    edges = graph()
    outside = {f"{m} imports {t}" for m, ts in edges.items() if m.startswith("megatron_adacc.core")
               for t in ts if not t.startswith("megatron_adacc.core")}
    assert outside == set()


@pytest.mark.parametrize("edge, layers, expected", [
    ({"megatron_adacc.core.x": {"megatron_adacc.adacc.y"}}, [["adacc"], ["core"]], 1),   # upward
    ({"megatron_adacc.comm.x": {"megatron_adacc.gact.y"}}, [["comm", "gact"], ["core"]], 1),  # peer
    ({"megatron_adacc.adacc.x": {"megatron_adacc.core.y"}}, [["adacc"], ["core"]], 0),   # downward
    ({"megatron_adacc.adacc.x": {"megatron_adacc.adacc.y"}}, [["adacc"], ["core"]], 0),  # inside
])
def test_the_check_catches_upward_and_peer_imports(edge, layers, expected):
    assert len(violations(edge, "megatron_adacc", layers)) == expected


def test_function_level_and_submodule_imports_count(tmp_path):
    (tmp_path / "megatron_adacc" / "training").mkdir(parents=True)
    (tmp_path / "megatron_adacc" / "training" / "__init__.py").write_text("")
    (tmp_path / "megatron_adacc" / "training" / "loop.py").write_text("")
    source = tmp_path / "megatron_adacc" / "core" / "m.py"
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    from megatron_adacc.training import loop\n")
    assert imports_of(source, tmp_path) == {"megatron_adacc.training", "megatron_adacc.training.loop"}


def test_no_import_cycle_between_packages():
    """Implied by the layering, and checked on its own so that a failure names the cycle. The root face
    (``megatron_adacc/__init__.py``: the version, the compiled ``_C`` and two forwarding functions) is no unit."""
    edges = graph()
    units = defaultdict(set)
    for source, targets in edges.items():
        for target in targets:
            if "." in source and "." in target and source.split(".")[1] != target.split(".")[1]:
                units[source.split(".")[1]].add(target.split(".")[1])
    seen, stack = set(), set()

    def visit(node: str) -> None:
        assert node not in stack, f"import cycle through {node}"
        if node in seen:
            return
        stack.add(node)
        for nxt in units.get(node, ()):
            visit(nxt)
        stack.discard(node)
        seen.add(node)

    for node in list(units):
        visit(node)
