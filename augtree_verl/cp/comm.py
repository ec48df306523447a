"""Communication for the CP primitives, all through ``torch.distributed`` (gloo on CPU, NCCL on GPU).

- ``Ring``: a ring over some members of a process group; one step sends a buffer to the next member and
  receives one from the previous, as a ``dist.P2POp`` batch (``batch_isend_irecv``), started before the
  step's compute and waited after it.
- ``all_to_all_rows``: MoveQ's query / partial-state exchange, ``dist.all_to_all_single`` on row splits.
- ``all_gather_sum``: exchange of small buffers (log-probs) among some members by P2P, summed.
- ``warm_up``: one tiny all-reduce on a new group, so that NCCL builds its communicator with every member
  present (a first ``batch_isend_irecv`` on a group must involve all its ranks).
Every function records the bytes *this rank sends* (never what it keeps for itself) in a ``Meter``.
Zero-element sends and receives are never posted (both sides know every size, so they skip the same
pairs); NCCL ignores P2P tags, so every rank posts its operations in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# P2P tags: a ring step may have a K/V buffer and a gradient buffer in flight between the same two ranks.
TAG_KV, TAG_GRAD, TAG_GATHER = 0, 1, 2


@dataclass
class Meter:
    """Adds bytes sent by this rank to ``stats.comm_bytes["<primitive>/<fwd|bwd>"]`` (``stats``: anything
    with ``add_bytes(primitive, direction, nbytes)``, e.g. ``replay.ReplayStats``)."""

    stats: Any
    primitive: str

    def add(self, direction: str, nbytes: int) -> None:
        if nbytes:
            self.stats.add_bytes(self.primitive, direction, nbytes)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def resolve(group):
    return group if group is not None else dist.group.WORLD


@dataclass(frozen=True)
class Ring:
    """Members (ranks *within* ``group``) in ring order; this rank is ``members[index]``."""

    group: object
    members: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def next(self) -> int:
        return self.members[(self.index + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.members[(self.index - 1) % self.size]

    def start_shift(self, send: torch.Tensor, recv: torch.Tensor, meter: Meter, direction: str, tag: int):
        """Send ``send`` to the next member and receive the previous member's into ``recv``; returns the
        pending requests (wait on them with ``finish``). Both buffers are contiguous 1-D."""
        group = resolve(self.group)
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, group=group, tag=tag, group_peer=self.next))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, group=group, tag=tag, group_peer=self.prev))
        meter.add(direction, nbytes(send))
        return dist.batch_isend_irecv(ops) if ops else []


def finish(requests) -> None:
    for r in requests:
        r.wait()


def warm_up(group) -> None:
    """One all-reduce of a single element over ``group`` (on the current CUDA device under NCCL)."""
    group = resolve(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    dist.all_reduce(torch.zeros(1, device=device), group=group)


def all_to_all_rows(
    rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group, meter: Meter, direction: str
) -> torch.Tensor:
    """``rows`` [sum(send_counts), ...] sent in consecutive slices to group ranks 0..n-1; returns the
    received rows [sum(recv_counts), ...] in sender order. The slice a rank keeps for itself is not counted."""
    group = resolve(group)
    me = dist.get_rank(group)
    row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
    meter.add(direction, row_bytes * (sum(send_counts) - send_counts[me]))
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=group)
    return out


def all_gather_sum(buffer: torch.Tensor, members: tuple[int, ...], group, meter: Meter) -> torch.Tensor:
    """Sum of ``buffer`` (same shape on every member) over ``members`` (group ranks, this rank included),
    by P2P. Used for buffers where each entry is non-zero on exactly one member, so the sum is exact."""
    group = resolve(group)
    me = dist.get_rank(group)
    others = [r for r in members if r != me]
    if not others or buffer.numel() == 0:  # same shape on every member: all of them skip
        return buffer.clone()
    received = [torch.empty_like(buffer) for _ in others]
    ops = [dist.P2POp(dist.isend, buffer.contiguous(), group=group, tag=TAG_GATHER, group_peer=r) for r in others]
    ops += [dist.P2POp(dist.irecv, b, group=group, tag=TAG_GATHER, group_peer=r) for b, r in zip(received, others)]
    meter.add("fwd", nbytes(buffer) * len(others))
    finish(dist.batch_isend_irecv(ops))
    total = buffer.clone()
    for b in received:
        total += b
    return total
