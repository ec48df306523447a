"""The per-sample batch field that carries the planner's plans from the trainer to the engine workers.

The trainer writes one entry per sample into verl's TransferQueue under ``PLAN_FIELD``; verl hands it
to the workers with the rest of the batch (a ``NonTensorStack`` of dicts in the worker's TensorDict,
kept through verl's mini-batch and micro-batch slicing). Each entry is the sample's tree's plan
(``Plan.to_dict()``) plus where the sample sits in that tree::

    {"degree", "primitive", "rounds", "lanes", "placement", "est_time_s", "est_parts", "est_single_s",  # Plan.to_dict()
     "tree_id": str,          # "<uid>|<prompt_len>": one prompt and its responses
     "response_index": int,   # this sample is response i of the tree; placement[i] is its (round, lane)
     "num_responses": int}    # G, the tree's size when it was planned

``Plan.from_dict(entry)`` reads the plan part and ignores the rest. ``group_plan_entries`` is the one
decoder of a batch's entries; ``tree_plans`` matches them to the engine's trees. A worker may hold only part
of a tree (a group split across ranks or mini-batches); a split plan only applies to the complete tree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from augtree_verl.groups import Tree
from augtree_verl.plan import Plan

PLAN_FIELD = "augtree_plan"


def plan_entries(trees: Sequence[Tree], plans: Mapping[str, Plan], num_samples: int) -> list[dict]:
    """One ``PLAN_FIELD`` entry per batch sample (batch order), from each tree's plan."""
    entries: list[dict | None] = [None] * num_samples
    for tree in trees:
        if tree.tree_id not in plans:
            raise ValueError(f"no plan for tree {tree.tree_id!r} (group {tree.uid!r})")
        plan = plans[tree.tree_id]
        plan.check_responses(len(tree.samples), tree=tree.tree_id)
        plan_dict = plan.to_dict()
        for i, sample in enumerate(tree.samples):
            entries[sample] = {
                **plan_dict,
                "tree_id": tree.tree_id,
                "response_index": i,
                "num_responses": len(tree.samples),
            }
    missing = [i for i, e in enumerate(entries) if e is None]
    if missing:
        raise ValueError(f"samples {missing[:8]} belong to no tree; every sample needs a plan entry")
    return entries


@dataclass(frozen=True)
class PlannedTree:
    """The samples of one planned tree present in a (micro-)batch, in the planner's response order.

    ``positions[k]`` is the row in the batch of the tree's response ``response_indices[k]``;
    ``complete`` is True when all ``num_responses`` responses are present (a split plan needs that).
    """

    tree_id: str
    plan: Plan
    positions: tuple[int, ...]
    response_indices: tuple[int, ...]
    num_responses: int

    @property
    def complete(self) -> bool:
        return len(self.positions) == self.num_responses


def group_plan_entries(entries: Sequence[Mapping]) -> dict[str, PlannedTree]:
    """Regroup the ``PLAN_FIELD`` entries of a batch (any order) into trees; ValueError on inconsistency."""
    rows: dict[str, list[tuple[int, int]]] = {}
    first: dict[str, Mapping] = {}
    for pos, entry in enumerate(entries):
        tree_id = entry["tree_id"]
        ref = first.setdefault(tree_id, entry)
        if {k: v for k, v in entry.items() if k != "response_index"} != {
            k: v for k, v in ref.items() if k != "response_index"
        }:
            raise ValueError(
                f"samples of tree {tree_id!r} carry different plans (batch rows {rows[tree_id][0][1]} and {pos})"
            )
        rows.setdefault(tree_id, []).append((int(entry["response_index"]), pos))
    trees = {}
    for tree_id, members in rows.items():
        members.sort()
        indices = [i for i, _ in members]
        n = int(first[tree_id]["num_responses"])
        if len(set(indices)) != len(indices) or not all(0 <= i < n for i in indices):
            raise ValueError(f"tree {tree_id!r} has response indices {indices}; expected distinct values in [0, {n})")
        trees[tree_id] = PlannedTree(
            tree_id=tree_id,
            plan=Plan.from_dict(first[tree_id]),
            positions=tuple(p for _, p in members),
            response_indices=tuple(indices),
            num_responses=n,
        )
    return trees


def tree_plans(
    trees: Sequence[Tree],
    entries: Sequence[Mapping] | None,
    cp_degrees: Sequence[int] = (1,),
    *,
    min_cp_tokens: int = 0,
) -> tuple[list[Plan | None], int]:
    """(one plan per tree, number of trees whose plan could not apply here) for the engine's ``trees``
    (``Tree.samples``: rows of the batch) from the batch's entries (``entries[row]``; None: no plans, every
    tree gets None).

    Every sample of a tree must carry that tree's ``tree_id`` (ValueError naming the row otherwise). A ring
    plan (no split) applies to any part of its tree; a split plan only when the tree holds all its planned
    responses (its placement is then reordered to the tree's responses). A context-parallel plan (degree
    d > 1) applies when d is one of ``cp_degrees``. A plan that cannot apply is replaced by the one-device
    plan (``Plan()``: ring, degree 1) carrying the planner's one-rank estimate ``est_single_s`` as its time,
    and counted. A context-parallel plan of a tree whose prompt plus longest response is shorter than
    ``min_cp_tokens`` becomes the one-device plan too, by configuration (not counted).
    """
    if entries is None:
        return [None] * len(trees), 0
    planned = group_plan_entries(entries)
    plans: list[Plan | None] = []
    fallbacks = 0
    for t, tree in enumerate(trees):
        for row in tree.samples:
            if entries[row]["tree_id"] != tree.tree_id:
                raise ValueError(
                    f"batch row {row} of tree {t} ({tree.tree_id!r}) carries the plan of tree "
                    f"{entries[row]['tree_id']!r}"
                )
        entry = planned[tree.tree_id]
        plan = entry.plan
        one_device = Plan(est_time_s=plan.est_single_s)
        if plan.degree > 1 and tree.prompt_len + max(tree.response_lens) < min_cp_tokens:
            plans.append(one_device)
        elif plan.degree not in cp_degrees:
            plans.append(one_device)
            fallbacks += 1
        elif plan.primitive == "ring":
            plans.append(plan)
        elif len(tree.samples) == entry.num_responses:
            # Our response i is the planner's response ``response_index``: reorder the placement to match.
            placement = tuple(plan.placement[int(entries[row]["response_index"])] for row in tree.samples)
            plans.append(dataclasses.replace(plan, placement=placement))
        else:
            plans.append(one_device)
            fallbacks += 1
    return plans, fallbacks
