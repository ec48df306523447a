"""NCCL hardening that gloo can test: zero-element sends/receives are never posted (on either side), and
every CP subgroup the mesh creates is warmed up with a collective before any P2P runs on it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from augtree_verl.cp.comm import Meter, Ring, all_gather_sum, finish
from augtree_verl.cp.mesh import CPMesh
from augtree_verl.replay.stats import ReplayStats
from tests.cp.distributed import run_distributed

pytestmark = pytest.mark.slow  # spawns processes


def _record_p2p(posted: list):
    real = dist.batch_isend_irecv

    def spy(ops):
        posted.extend((op.op.__name__, op.tensor.numel()) for op in ops)
        return real(ops)

    dist.batch_isend_irecv = spy


def _zero_element_shift(rank, world):
    posted = []
    _record_p2p(posted)
    ring = Ring(None, (0, 1), rank)
    meter = Meter(ReplayStats(), "ring")
    # rank 0's block is empty, rank 1's holds 5 elements: rank 0 only receives, rank 1 only sends
    send = torch.arange(5.0) if rank == 1 else torch.empty(0)
    recv = torch.empty(5) if rank == 0 else torch.empty(0)
    finish(ring.start_shift(send, recv, meter, "fwd", tag=0))
    if rank == 0:
        assert recv.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert posted == [("irecv", 5)], posted
    else:
        assert posted == [("isend", 5)], posted
    assert meter.stats.total_comm_bytes == (20 if rank == 1 else 0)
    # both empty: nothing posted at all, nothing to wait for
    assert ring.start_shift(torch.empty(0), torch.empty(0), meter, "fwd", tag=0) == []
    assert all_gather_sum(torch.empty(0, 3), (0, 1), None, meter).shape == (0, 3)
    assert len(posted) == 1
    # a non-empty exchange still runs
    total = all_gather_sum(torch.full((2,), float(rank + 1)), (0, 1), None, meter)
    assert total.tolist() == [3.0, 3.0]


@pytest.mark.timeout(180)
def test_zero_element_sends_and_receives_are_skipped_on_both_sides():
    run_distributed(_zero_element_shift, 2)


def _mesh_warm_up(rank, world):
    warmed = []
    real = dist.all_reduce

    def spy(tensor, *args, group=None, **kwargs):
        warmed.append(group)
        return real(tensor, *args, group=group, **kwargs)

    dist.all_reduce = spy
    mesh = CPMesh.build([1, 2, 4])
    assert warmed == [mesh.dp_group, mesh.groups[2], mesh.groups[4]], warmed
    assert all(dist.get_world_size(g) == n for g, n in zip(warmed, (1, 2, 4)))


@pytest.mark.timeout(180)
def test_every_cp_subgroup_is_warmed_up_when_created():
    run_distributed(_mesh_warm_up, 4)
