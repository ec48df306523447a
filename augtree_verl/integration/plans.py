"""The plans the trainer hook put in the batch (``augtree_plan``, one entry per sample), matched to our trees.

A ring plan (no split) applies to any part of its tree. A split plan places each response of the whole
tree, so it applies only when this replay holds the complete tree. A context-parallel plan (degree > 1)
applies when the engine has subgroups of that many ranks (``cp_degrees``). A plan that cannot apply is
replaced by the one-device plan (``Plan()``: ring, degree 1, no split) carrying the planner's one-rank
estimate ``est_single_s`` as its time, and the step counts a planner fallback. A context-parallel plan of a
tree whose prompt plus longest response is shorter than ``min_cp_tokens`` (the engine's
``fallback_threshold_tokens``) becomes the one-device plan too, by configuration (not counted).
"""

from __future__ import annotations

import dataclasses

from tensordict import TensorDict

from augtree_verl.integration.batch_trees import BatchTrees
from augtree_verl.plan import Plan
from augtree_verl.plan_field import PLAN_FIELD


def plans_for_trees(micro_batches: list[TensorDict], grouped: BatchTrees,
                    cp_degrees: tuple[int, ...] = (1,), min_cp_tokens: int = 0) -> tuple[list[Plan | None], int]:
    """(one plan per tree, or None for all without plans in the batch; number of trees whose plan could not
    apply here)."""
    if PLAN_FIELD not in micro_batches[0].keys():
        return [None] * len(grouped.trees), 0
    entries = [list(mb[PLAN_FIELD]) for mb in micro_batches]
    plans: list[Plan] = []
    fallbacks = 0
    for t, rows in enumerate(grouped.rows):
        tree_entries = [entries[m][k] for m, k in rows]
        tree_ids = {e["tree_id"] for e in tree_entries}
        if len(tree_ids) != 1:
            raise ValueError(
                f"tree {t} (uid {grouped.uids[t]!r}) has samples planned as different trees {sorted(tree_ids)}")
        plan = Plan.from_dict(tree_entries[0])
        tree = grouped.trees[t]
        one_device = Plan(est_time_s=plan.est_single_s)
        if plan.degree > 1 and tree.prompt_len + max(tree.response_lens) < min_cp_tokens:
            plans.append(one_device)
        elif plan.degree not in cp_degrees:
            plans.append(one_device)
            fallbacks += 1
        elif plan.primitive == "ring":
            plans.append(plan)
        elif len(rows) == int(tree_entries[0]["num_responses"]):
            # Our response i is the planner's response ``response_index``: reorder the placement to match.
            placement = tuple(plan.placement[int(e["response_index"])] for e in tree_entries)
            plans.append(dataclasses.replace(plan, placement=placement))
        else:
            plans.append(one_device)
            fallbacks += 1
    return plans, fallbacks
