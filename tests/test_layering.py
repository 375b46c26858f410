"""The package's imports point down: each package imports only those on floors below it.

Every import counts, with no exception: a deferred one inside a function, and one in a
module's ``if __name__ == "__main__":`` block too (a tool that needs a floor above its
package is an entry point of the top floor, as ``tlab-check``, ``check.py``, is above the
kernel check of ``attention`` and the layer check of ``nn``). Run this file to print the
package graph::

    python tests/test_layering.py
"""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "transformers_lab"

# the floors, lowest first; a package may import the floors below its own, never its own
# floor's other packages nor any floor above
FLOORS: list[set[str]] = [
    {"errors", "files"},
    {"config"},
    {"attention"},
    {"nn"},
    {"models", "data"},
    {"tasks", "hf"},
    {"analysis"},
    {"run"},
    {"sweeps"},
    {"cli"},
    {"bench", "train", "eval", "sample", "translate", "prepare", "check", "export"},
]
FLOOR = {name: i for i, floor in enumerate(FLOORS) for name in floor}


def unit(module: str) -> str:
    """The package (or top-level module) a dotted module name of ours belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> list[tuple[str, int]]:
    """The modules of ours that ``path`` imports, with their line numbers."""
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                names = [node.module] if node.module else [a.name for a in node.names]
                found += [(".".join([*base, name]), node.lineno) for name in names]
            elif node.module:
                found.append((node.module, node.lineno))
    return [(name, line) for name, line in found if name.startswith("transformers_lab.")]


@cache
def arrows() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) between two of our packages -> where, as ``file:line``."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        source = unit(module_name(path))
        for name, line in imported(path):
            target = unit(name)
            if target and target != source:
                edges[source, target].append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return edges


def test_every_package_has_a_floor():
    units = {unit(module_name(p)) for p in PACKAGE.rglob("*.py")} - {""}
    assert units <= set(FLOOR), f"give these a floor in FLOORS: {sorted(units - set(FLOOR))}"


@pytest.mark.parametrize("edge", sorted(arrows()), ids="->".join)
def test_imports_point_down(edge):
    source, target = edge
    where = ", ".join(arrows()[edge])
    assert FLOOR[target] < FLOOR[source], f"{source} imports {target}, a floor up or level: {where}"


def test_the_rule_catches_an_arrow_up(tmp_path):
    """The walk sees a deferred import inside a function, a relative one, and one in a
    module's ``__main__`` block: a module run as a script is no exception."""
    package = tmp_path / "transformers_lab" / "attention"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    module = package / "kernel.py"
    module.write_text("def f():\n    from transformers_lab.nn import multihead\n")
    relative = package / "other.py"
    relative.write_text("from ..run import fit\n")
    script = package / "script.py"
    script.write_text(
        'import os\nif __name__ == "__main__":\n    from transformers_lab.nn import x\n'
    )
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "transformers_lab"
    try:
        assert [unit(n) for n, _ in imported(module)] == ["nn"]
        assert [unit(n) for n, _ in imported(relative)] == ["run"]
        assert [unit(n) for n, _ in imported(script)] == ["nn"]
        up = arrows.__wrapped__()["attention", "nn"]  # the walk, not the cached real one
        assert "transformers_lab/attention/script.py:3" in up  # test_imports_point_down's
    finally:
        PACKAGE = saved


if __name__ == "__main__":
    graph = defaultdict(set)
    for source, target in arrows():
        graph[source].add(target)
    for source in sorted(graph, key=lambda s: (FLOOR.get(s, -1), s)):
        ups = [t for t in graph[source] if FLOOR.get(t, 99) >= FLOOR.get(source, -1)]
        line = f"{FLOOR.get(source, '?')!s:>2} {source:10} -> {', '.join(sorted(graph[source]))}"
        print(line + (f"   UP: {', '.join(sorted(ups))}" if ups else ""))
