"""The augtree_plan batch field: one entry per sample, regrouped by tree in any order."""

import random

import pytest

from augtree_verl.groups import find_trees
from augtree_verl.plan import Plan
from augtree_verl.plan_field import group_plan_entries, plan_entries

UIDS = ["b", "a", "b", "a", "a", "b", "c"]
PROMPTS = [700, 300, 700, 300, 300, 700, 50]
RESPONSES = [11, 12, 13, 14, 15, 16, 17]
PLANS = {
    "a|300": Plan(degree=2, primitive="move_q", rounds=1, lanes=2, placement=((0, 0), (0, 1), (0, 0)),
                  est_time_s=0.25, est_parts={"prefill": 0.1, "replay": 0.15}),
    "b|700": Plan(degree=4, primitive="tree_move_kv", rounds=3, lanes=1, placement=((0, 0), (1, 0), (2, 0))),
    "c|50": Plan(),
}


def test_entries_round_trip_through_any_order():
    trees = find_trees(UIDS, PROMPTS, RESPONSES)
    entries = plan_entries(trees, PLANS, len(UIDS))
    assert entries[3] == {**PLANS["a|300"].to_dict(), "tree_id": "a|300", "response_index": 1, "num_responses": 3}
    order = list(range(len(UIDS)))
    random.Random(0).shuffle(order)
    grouped = group_plan_entries([entries[i] for i in order])
    assert set(grouped) == set(PLANS)
    for tree in trees:
        planned = grouped[tree.tree_id]
        assert planned.plan == PLANS[tree.tree_id]
        assert planned.complete
        # positions are rows of the shuffled batch, in the planner's response order
        assert [order[p] for p in planned.positions] == list(tree.samples)
        assert planned.plan.est_parts == PLANS[tree.tree_id].est_parts


def test_part_of_a_tree_is_reported_incomplete():
    entries = plan_entries(find_trees(UIDS, PROMPTS, RESPONSES), PLANS, len(UIDS))
    grouped = group_plan_entries([entries[4], entries[0], entries[5]])
    assert not grouped["a|300"].complete and grouped["a|300"].response_indices == (2,)
    assert grouped["b|700"].response_indices == (0, 2) and grouped["b|700"].positions == (1, 2)


def test_bad_plans_and_entries_are_clear_errors():
    trees = find_trees(UIDS, PROMPTS, RESPONSES)
    with pytest.raises(ValueError, match="no plan for tree 'c\\|50'"):
        plan_entries(trees, {k: v for k, v in PLANS.items() if k != "c|50"}, len(UIDS))
    short = dict(PLANS, **{"b|700": Plan(degree=2, primitive="tree_move_kv", rounds=1, lanes=2,
                                          placement=((0, 0), (0, 1)))})
    with pytest.raises(ValueError, match="for tree b\\|700 has 2 cells but the tree has 3 responses"):
        plan_entries(trees, short, len(UIDS))
    with pytest.raises(ValueError, match="samples \\[7\\] belong to no tree"):
        plan_entries(trees, PLANS, len(UIDS) + 1)
    entries = plan_entries(trees, PLANS, len(UIDS))
    with pytest.raises(ValueError, match="samples of tree 'a\\|300' carry different plans"):
        group_plan_entries([entries[1], {**entries[3], "degree": 8}])
    with pytest.raises(ValueError, match="tree 'a\\|300' has response indices \\[1, 1\\]"):
        group_plan_entries([entries[3], entries[3]])
