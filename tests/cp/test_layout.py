"""Zigzag sharding and lanes: every token owned exactly once, balanced, owner() consistent."""

import pytest
import torch

from augtree_verl.cp.layout import ZigzagLayout, lane_members


@pytest.mark.parametrize("length", [0, 1, 5, 8, 37, 64])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_zigzag_covers_each_position_once(length, parts):
    layout = ZigzagLayout(length, parts)
    everything = torch.cat([layout.positions(r) for r in range(parts)])
    assert sorted(everything.tolist()) == list(range(length))
    sizes = layout.sizes()
    assert max(sizes) - min(sizes) <= 2  # two chunks each, chunk sizes differ by at most one
    for r in range(parts):
        for local, pos in enumerate(layout.positions(r).tolist()):
            assert layout.owner(pos) == (r, local)


def test_zigzag_pairs_early_and_late_chunks():
    layout = ZigzagLayout(16, 4)
    assert layout.positions(0).tolist() == [0, 1, 14, 15]
    assert layout.positions(3).tolist() == [6, 7, 8, 9]
    assert [c.index for c in layout.chunks(1)] == [1, 6]


def test_lanes_are_contiguous_blocks():
    assert [lane_members(4, 2, lane) for lane in range(2)] == [(0, 1), (2, 3)]
    assert [lane_members(4, 3, lane) for lane in range(3)] == [(0,), (1,), (2, 3)]
    with pytest.raises(ValueError, match="lanes must be in"):
        lane_members(2, 3, 0)
    with pytest.raises(ValueError, match="parts must be >= 1"):
        ZigzagLayout(4, 0)
