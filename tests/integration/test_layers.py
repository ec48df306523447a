"""Each folder of ``augtree_verl`` is one layer and its imports only point down.

    ops  <-  cp  <-  replay  <-  planner  <-  integration  <-  rollout / trainer  <-  bench / cli / testing
(``plan.py``, ``groups.py`` and ``plan_field.py`` are small shared modules at the bottom.) Every import
of our own modules counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import augtree_verl

PACKAGE = Path(augtree_verl.__file__).parent
BASE = {"plan", "groups"}
# package -> the packages (and top-level modules) of ours it may import
ALLOWED = {
    "ops": set(),
    "plan": set(),
    "groups": set(),
    "plan_field": BASE,
    "models": set(),
    "cp": {"ops"} | BASE,
    "replay": {"ops", "cp"} | BASE,
    "planner": {"ops", "cp", "replay"} | BASE,
    "integration": {"ops", "cp", "replay", "planner", "plan_field"} | BASE,
    "rollout": {"integration", "planner", "plan_field"} | BASE,
    "trainer": {"integration", "rollout", "planner", "replay", "cp", "plan_field"} | BASE,
    "cpu_loop": {"integration", "rollout", "trainer", "planner", "replay", "plan_field", "models"} | BASE,
    "testing": {"integration", "replay", "cp", "planner", "models", "plan_field"} | BASE,
    "bench": {"replay", "cp", "planner", "models", "testing", "integration"} | BASE,
    "cli": {"bench", "models", "planner", "replay", "trainer", "cpu_loop"} | BASE,
    "__init__": {"plan", "planner", "replay"},
}
# A named exception: registration tells verl where our rollout backend lives (verl imports it by name).
EXCEPTIONS = {("integration/registration.py", "rollout")}


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
            if target not in ALLOWED[layer] and (rel.as_posix(), target) not in EXCEPTIONS:
                wrong.append(f"{rel} imports augtree_verl.{target}")
    assert not wrong, "imports pointing up or sideways:\n" + "\n".join(wrong)


def test_the_scan_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from augtree_verl.replay.engine import replay\n")
    assert _our_imports(module) == {"replay"}
