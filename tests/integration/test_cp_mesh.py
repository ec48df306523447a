"""Which ranks of a CP group replay which tree (``place_trees``), and the mesh's checks."""

from __future__ import annotations

import pytest

from tests.integration import verl_harness as H
from augtree_verl.integration.cp_mesh import CPMesh, place_trees  # noqa: I001


def test_heaviest_first_onto_the_least_loaded_subgroup():
    # Group of 4 ranks, by weight: 8 (degree 4) loads [2, 2, 2, 2]; 6 (degree 2) -> subgroup {0, 1}: [5, 5, 2, 2];
    # 3 -> rank 2: [5, 5, 5, 2]; 2 (degree 2) ties at 5 -> subgroup {0, 1}: [6, 6, 5, 2]; 1 and 1 -> rank 3.
    works = [8.0, 6.0, 2.0, 3.0, 1.0, 1.0]
    degrees = [4, 2, 2, 1, 1, 1]
    assert place_trees(works, degrees, 4) == [0, 0, 0, 2, 3, 3]


def test_every_tree_is_placed_once_and_ties_go_low():
    assert place_trees([1.0] * 5, [1] * 5, 2) == [0, 1, 0, 1, 0]
    assert place_trees([], [], 8) == []
    assert place_trees([5.0, 5.0], [1, 1], 1) == [0, 0]


def test_a_degree_that_does_not_divide_the_group_names_the_tree():
    with pytest.raises(ValueError, match="tree 1: degree 3 does not divide the CP group size 4"):
        place_trees([1.0, 2.0], [2, 3], 4)


def test_mesh_needs_the_largest_degree_to_divide_the_world():
    H.init_process_group()
    mesh = CPMesh([1])
    assert (mesh.cp_size, mesh.dp_size, mesh.dp_rank, mesh.cp_rank, mesh.cp_group) == (1, 1, 0, 0, None)
    with pytest.raises(ValueError, match="largest degree 2 must divide the world size 1"):
        CPMesh([1, 2])
