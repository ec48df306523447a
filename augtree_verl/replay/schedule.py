"""The replay schedule of one step on one rank, and its lock-step shape over an FSDP group.

Per tree: one prompt forward, the tree's response micro-batches (forward, and in training a backward
each), and in training one delayed prompt backward. FSDP2 (ZeRO-3) all-gathers a layer's parameters in
every model call and reduce-scatters its gradient in every backward, with collectives of the same size for
every layer: if two ranks issue different call sequences, layer i on one rank is paired with layer j on
another (silently wrong weights, not a hang). So the ranks of a group agree on one shape: slot j holds
the j-th largest tree of each rank (by micro-batch count) and ``shape[j]`` micro-batches, the largest
count any rank has there; a rank short of work pads with dummy calls (``Slot.tree is None``: a one-token
prompt; micro-batches beyond its own: one one-token row with a zero loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from augtree_verl.replay.microbatch import split_micro_batches
from augtree_verl.replay.tree import ReplayTree


@dataclass
class Slot:
    """One tree's place in the schedule: ``tree`` (an index, None for a dummy tree), its response
    micro-batches (lists of response indices), and ``calls`` >= len(micro_batches): how many response
    micro-batch calls the slot makes (the rest are dummies)."""

    tree: int | None
    micro_batches: list[list[int]]
    calls: int


def tree_schedule(trees: list[ReplayTree], budget_tokens: int, *, group=None,
                  device: torch.device | None = None) -> list[Slot]:
    """The slots of ``trees`` (responses split under ``budget_tokens``, see ``split_micro_batches``).

    With ``group`` (a process group), every rank of it gets the same number of slots and the same
    ``calls`` per slot (two small all-reduces of int64 tensors on ``device``, the model's); without, one
    slot per tree, in order.
    """
    batches = [split_micro_batches(tree.response_lens, budget_tokens) for tree in trees]
    if group is None:
        return [Slot(t, mbs, len(mbs)) for t, mbs in enumerate(batches)]
    order = sorted(range(len(trees)), key=lambda t: (-len(batches[t]), t))
    count = torch.tensor([len(trees)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=group)
    shape = torch.zeros(int(count), dtype=torch.int64, device=device)
    shape[: len(order)] = torch.tensor([len(batches[t]) for t in order], dtype=torch.int64)
    torch.distributed.all_reduce(shape, op=torch.distributed.ReduceOp.MAX, group=group)
    shape = shape.tolist()
    return [Slot(order[j], batches[order[j]], shape[j]) if j < len(order) else Slot(None, [], shape[j])
            for j in range(len(shape))]

