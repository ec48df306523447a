"""The CP mesh's checks (the placement policy is the step plan's: tests/replay/test_step_plan.py)."""

from __future__ import annotations

import pytest

from augtree_verl.cp.mesh import CPLayout, CPMesh


def test_mesh_needs_the_largest_degree_to_divide_the_world(single_process_group):
    mesh = CPMesh.build([1])
    assert (mesh.cp_size, mesh.dp_size, mesh.dp_rank, mesh.cp_rank, mesh.cp_group) == (1, 1, 0, 0, None)
    with pytest.raises(ValueError, match="largest degree 2 must divide the world size 1"):
        CPMesh.build([1, 2])


def test_layout_facts_without_process_groups():
    layout = CPLayout.of([2, 1, 4, 2], world=8, rank=6)
    assert layout.degrees == (1, 2, 4)
    assert (layout.cp_size, layout.dp_size, layout.dp_rank, layout.cp_rank) == (4, 2, 1, 2)
    assert (layout.subgroup_index(2), layout.subgroup_rank(2)) == (1, 0)
    with pytest.raises(ValueError, match="degree 3 does not divide the largest, 4"):
        CPLayout.of([1, 3, 4], world=8, rank=0)
    with pytest.raises(ValueError, match="rank 8 is outside the world of 8 ranks"):
        CPLayout.of([1, 2], world=8, rank=8)
    planning = CPMesh.for_planning((1, 2, 4), 3)
    assert (planning.cp_rank, planning.subgroup_index(2), planning.group_of(2), planning.dp_group) == (3, 1, None, None)
