"""integration/ (the engine, in the workers) and trainer/ (the driver) never import each other's code.

The driver-to-worker plan format lives beside ``Plan`` (``augtree_verl.plan_field``), the replay trees and
their work model in ``augtree_verl.groups``; both layers import those. The trainer may still use the few
integration modules that only name things for verl (the engine's strategy name, the post-import hook, the
verl compatibility layer), none of which imports engine code.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "augtree_verl"
# integration modules that name verl things without importing the engine; the trainer may use them (and the
# package itself, verl's plugin entry point: the CPU platform and the engine's registration hook).
TRAINER_MAY_USE = {
    "augtree_verl.integration.strategy",
    "augtree_verl.integration.import_hooks",
    "augtree_verl.integration.verl_compat",
}
TRAINER_MAY_IMPORT_FROM = {"augtree_verl.integration"}


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` of the file names (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(layer: str, other: str, allowed=frozenset(), allowed_exactly=frozenset()) -> list[str]:
    found = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for name in imported_modules(path):
            if (
                (name == f"augtree_verl.{other}" or name.startswith(f"augtree_verl.{other}."))
                and not any(name == a or name.startswith(a + ".") for a in allowed)
                and name not in allowed_exactly
            ):
                found.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    return found


def test_integration_imports_nothing_from_trainer():
    assert violations("integration", "trainer") == []


def test_trainer_imports_no_engine_code_from_integration():
    assert violations("trainer", "integration", TRAINER_MAY_USE, TRAINER_MAY_IMPORT_FROM) == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from augtree_verl.trainer.plan_field import PLAN_FIELD\n", ["augtree_verl.trainer.plan_field"]),
        ("import augtree_verl.trainer.group_balance as gb\n", ["augtree_verl.trainer.group_balance"]),
        ("from augtree_verl.trainer import plan_field\n", ["augtree_verl.trainer", "augtree_verl.trainer.plan_field"]),
    ],
)
def test_the_scan_sees_every_import_form(tmp_path, source, expected):
    layer = tmp_path / "integration"
    layer.mkdir()
    (layer / "planted.py").write_text(source)
    names = imported_modules(layer / "planted.py")
    assert all(e in names for e in expected)
