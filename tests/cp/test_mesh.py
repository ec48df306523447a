"""The CP mesh's checks (the placement policy is the step plan's: tests/replay/test_step_plan.py)."""

from __future__ import annotations

import pytest

from augtree_verl.cp.mesh import CPMesh


def test_mesh_needs_the_largest_degree_to_divide_the_world(single_process_group):
    mesh = CPMesh([1])
    assert (mesh.cp_size, mesh.dp_size, mesh.dp_rank, mesh.cp_rank, mesh.cp_group) == (1, 1, 0, 0, None)
    with pytest.raises(ValueError, match="largest degree 2 must divide the world size 1"):
        CPMesh([1, 2])
