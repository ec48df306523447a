"""The lock-step shape of one step on one rank: its slots, agreed over an FSDP group.

A slot is one tree's three parts: one prompt forward, ``calls`` response calls (one decoder call and one
LM-head call each, and in training a backward each), and in training one delayed prompt backward. FSDP2
(ZeRO-3) all-gathers a layer's parameters in every model call and reduce-scatters its gradient in every
backward, with collectives of the same size for every layer: if two ranks issue different call sequences,
layer i on one rank is paired with layer j on another (silently wrong weights, not a hang). So the ranks
of a group agree on one shape and pad with one-token dummy calls.

Phases by CP degree, largest first (C, ..., 2, then 1). Phase d > 1 holds the context-parallel trees of
degree d: slot j of phase d holds, on every member of a d-subgroup, that subgroup's j-th tree (ordered by
(most CP steps over its members, index), which every member computes identically from the shared trees and
plans); its calls are the steps of the tree's CP schedule (``cp.schedule``). Phase 1 holds each rank's own trees, the
largest (by micro-batch count) first; its calls are the tree's response micro-batches. Per phase the
number of slots is the most any rank has, and ``calls`` per slot the most any rank has there (two small
all-reduces); a rank short of work pads with dummy slots (``Slot.tree is None``) and dummy calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from augtree_verl.cp.schedule import CPTreeSchedule, cp_tree_schedule
from augtree_verl.groups import Tree
from augtree_verl.replay.microbatch import split_micro_batches


@dataclass
class Slot:
    """One tree's place in the lock-step sequence: ``tree`` (an index, None for a dummy slot), ``degree`` (its
    phase), its work (one device: ``micro_batches``, lists of response indices; CP: ``cp``, this rank's
    CP schedule of the tree) and ``calls`` >= that work's call count (the rest are dummy calls)."""

    tree: int | None
    degree: int
    calls: int
    micro_batches: list[list[int]]
    cp: CPTreeSchedule | None = None

    @property
    def own_calls(self) -> int:
        return len(self.cp.steps) if self.cp is not None else len(self.micro_batches)


def lockstep_slots(trees: list[Tree], plans: list, budget_tokens: int, *, mesh=None, subgroups=None,
                   group=None, device: torch.device | None = None) -> list[Slot]:
    """This rank's slots, in execution order (see the module docstring).

    ``plans[t]``: a ``Plan`` or None; ``mesh`` (``cp.mesh.CPMesh``) and ``subgroups[t]`` (the subgroup
    index of tree t, a CP rank for degree 1; see ``step_plan.assign_subgroups``) when any tree runs
    context-parallel, else every tree is this rank's and runs on one device. With ``group`` (a process
    group) the shape is agreed over it (int64 all-reduces on ``device``, the model's); without, no padding.
    """
    degrees = [plan.degree if plan is not None else 1 for plan in plans]
    phases: list[tuple[int, list[Slot]]] = []
    for d in sorted(mesh.degrees if mesh is not None else (1,), reverse=True):
        if d == 1:
            mine = [t for t in range(len(trees)) if degrees[t] == 1 and (mesh is None or subgroups[t] == mesh.cp_rank)]
            slots = [Slot(t, 1, 0, split_micro_batches(list(trees[t].response_lens), budget_tokens)) for t in mine]
            key = {s.tree: len(s.micro_batches) for s in slots}
        else:
            mine = [t for t in range(len(trees)) if degrees[t] == d and subgroups[t] == mesh.subgroup_index(d)]
            slots = [Slot(t, d, 0, [], cp_tree_schedule(plans[t], trees[t].prompt_len, list(trees[t].response_lens),
                                                        mesh.subgroup_rank(d))) for t in mine]
            key = {t: max(len(cp_tree_schedule(plans[t], trees[t].prompt_len, list(trees[t].response_lens), r).steps)
                          for r in range(d)) for t in mine}
        slots.sort(key=lambda s: (-key[s.tree], s.tree))
        phases.append((d, slots))
    if group is None:
        for _, slots in phases:
            for s in slots:
                s.calls = s.own_calls
        return [s for _, slots in phases for s in slots]
    agreed = torch.tensor([len(slots) for _, slots in phases], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=group)
    counts: list[int] = agreed.tolist()
    agreed = torch.zeros(sum(counts), dtype=torch.int64, device=device)
    start = 0
    for (_, slots), n in zip(phases, counts):
        agreed[start: start + len(slots)] = torch.tensor([s.own_calls for s in slots], dtype=torch.int64)
        start += n
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=group)
    shape: list[int] = agreed.tolist()
    out: list[Slot] = []
    start = 0
    for (d, slots), n in zip(phases, counts):
        for j in range(n):
            slot = slots[j] if j < len(slots) else Slot(None, d, 0, [])
            slot.calls = shape[start + j]
            out.append(slot)
        start += n
    return out
