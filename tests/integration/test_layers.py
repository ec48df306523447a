"""Each folder of ``augtree_verl`` is one layer and its imports only point down.

    ops  <-  cp  <-  replay  <-  planner  <-  integration  <-  rollout / trainer  <-  bench / cli / testing
(``plan.py``, ``groups.py``, ``plan_field.py`` and ``model_shape.py`` are small shared modules at the bottom.)
Every import of our own modules counts, at module level or inside a function; there are no exceptions. Inside a layer,
no module imports itself back through others (no import cycle), and the oracle (``replay/baseline.py``)
imports nothing of the engine it checks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import augtree_verl

PACKAGE = Path(augtree_verl.__file__).parent
BASE = {"plan", "groups", "plan_field", "model_shape"}
# package -> the packages (and top-level modules) of ours it may import
ALLOWED = {
    "ops": set(),
    "plan": set(),
    "groups": set(),
    "plan_field": {"plan", "groups"},
    "model_shape": set(),
    "models": set(),
    "cp": {"ops"} | BASE,
    "replay": {"ops", "cp"} | BASE,
    "planner": {"ops", "cp", "replay"} | BASE,
    "integration": {"ops", "cp", "replay", "planner"} | BASE,
    "rollout": {"integration", "planner"} | BASE,
    "trainer": {"integration", "rollout", "planner", "replay", "cp"} | BASE,
    "cpu_loop": {"integration", "rollout", "trainer", "planner", "replay", "models"} | BASE,
    "testing": {"integration", "replay", "cp", "planner", "models"} | BASE,
    "bench": {"replay", "cp", "planner", "models", "testing", "integration"} | BASE,
    "cli": {"bench", "models", "planner", "replay", "trainer", "cpu_loop"} | BASE,
    "__init__": {"plan", "planner", "replay"},
}


def _our_imports(path: Path) -> set[str]:
    """The first component under ``augtree_verl`` of every import of ours in ``path``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        modules = [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        for module in modules:
            parts = module.split(".")
            if parts[0] == "augtree_verl":
                found.add(parts[1] if len(parts) > 1 else "__init__")
    return found


def test_imports_point_down():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        layer = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        assert layer in ALLOWED, f"{rel}: layer {layer!r} has no entry in ALLOWED"
        for target in sorted(_our_imports(path) - {layer}):
            if target not in ALLOWED[layer]:
                wrong.append(f"{rel} imports augtree_verl.{target}")
    assert not wrong, "imports pointing up or sideways:\n" + "\n".join(wrong)


def test_the_scan_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from augtree_verl.replay.run import replay\n")
    assert _our_imports(module) == {"replay"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported_modules(path: Path) -> set[str]:
    """Our modules ``path`` imports: ``from a.b import c`` is ``a.b.c`` where that is a module, else ``a.b``
    (the packages a dotted name passes through are not counted: they are not what the code asked for)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
            if len(component) > 1 or v in graph.get(v, ()):
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    graph = {name: _imported_modules(path) - {name} for name, path in MODULES.items()}
    assert not _cycles(graph), "modules that import each other (directly or through others):\n" + "\n".join(
        " <-> ".join(c) for c in _cycles(graph)
    )


def test_the_cycle_scan_sees_a_cycle_through_a_function_level_import(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("from augtree_verl.integration.strategy import STRATEGY\n")
    b = tmp_path / "b.py"
    b.write_text("def f():\n    from augtree_verl.integration import config\n")
    graph = {
        "augtree_verl.integration.config": _imported_modules(a) | {"augtree_verl.integration.registration"},
        "augtree_verl.integration.registration": _imported_modules(b),
        "augtree_verl.integration.strategy": set(),
    }
    assert _imported_modules(b) == {"augtree_verl.integration.config"}
    assert _cycles(graph) == [["augtree_verl.integration.config", "augtree_verl.integration.registration"]]


@pytest.mark.parametrize("oracle", ["augtree_verl.replay.baseline"])
def test_the_oracle_imports_nothing_of_the_engine_it_checks(oracle):
    # the tree type is data; everything else (model calls, scoring, losses) is the oracle's own
    assert _imported_modules(MODULES[oracle]) <= {"augtree_verl.groups"}
