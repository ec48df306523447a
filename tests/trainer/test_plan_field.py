"""The augtree_plan batch field: one entry per sample, regrouped by tree in any order, and matched to the
engine's trees (which carry the trainer's tree id)."""

import random

import pytest
import torch

from augtree_verl.groups import find_trees
from augtree_verl.plan import Plan
from augtree_verl.plan_field import group_plan_entries, plan_entries, tree_plans

UIDS = ["b", "a", "b", "a", "a", "b", "c"]
PROMPTS = [700, 300, 700, 300, 300, 700, 50]
RESPONSES = [11, 12, 13, 14, 15, 16, 17]
PLANS = {
    "a|300": Plan(
        degree=2,
        primitive="move_q",
        rounds=1,
        lanes=2,
        placement=((0, 0), (0, 1), (0, 0)),
        est_time_s=0.25,
        est_parts={"prefill": 0.1, "replay": 0.15},
    ),
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
    short = dict(
        PLANS, **{"b|700": Plan(degree=2, primitive="tree_move_kv", rounds=1, lanes=2, placement=((0, 0), (0, 1)))}
    )
    with pytest.raises(ValueError, match="for tree b\\|700 has 2 cells but the tree has 3 responses"):
        plan_entries(trees, short, len(UIDS))
    with pytest.raises(ValueError, match="samples \\[7\\] belong to no tree"):
        plan_entries(trees, PLANS, len(UIDS) + 1)
    entries = plan_entries(trees, PLANS, len(UIDS))
    with pytest.raises(ValueError, match="samples of tree 'a\\|300' carry different plans"):
        group_plan_entries([entries[1], {**entries[3], "degree": 8}])
    with pytest.raises(ValueError, match="tree 'a\\|300' has response indices \\[1, 1\\]"):
        group_plan_entries([entries[3], entries[3]])


def _engine_trees(order, prompt_of=lambda row: 0):
    """The engine's trees of the batch rows ``order`` (the trainer's sample indices, in the worker's order):
    token ids with the trainer's lengths; ``prompt_of(sample)`` seeds the prompt's tokens."""
    sequences = [torch.cat([torch.full((PROMPTS[i],), prompt_of(i)), torch.arange(RESPONSES[i])]) for i in order]
    return find_trees([UIDS[i] for i in order], [PROMPTS[i] for i in order], [RESPONSES[i] for i in order], sequences)


def test_the_engine_finds_the_trainers_plans_under_the_trainers_tree_ids():
    entries = plan_entries(find_trees(UIDS, PROMPTS, RESPONSES), PLANS, len(UIDS))
    # the worker's rows: tree "a" arrives as the trainer's responses 2, 1, 0, tree "b" as 0, 2, 1
    order = [4, 6, 0, 3, 5, 1, 2]
    trees = _engine_trees(order)
    assert [t.tree_id for t in trees] == ["a|300", "c|50", "b|700"]
    plans, fallbacks = tree_plans(trees, [entries[i] for i in order], (1, 2, 4))
    a = PLANS["a|300"].placement
    assert plans[0].placement == (a[2], a[1], a[0]) and plans[0].degree == 2
    b = PLANS["b|700"].placement
    assert (plans[1], plans[2].placement, fallbacks) == (PLANS["c|50"], (b[0], b[2], b[1]), 0)
    # without subgroups of 4 ranks, tree "b" runs on one device with the planner's one-rank estimate
    plans, fallbacks = tree_plans(trees, [entries[i] for i in order], (1, 2))
    assert (plans[2], fallbacks) == (Plan(est_time_s=PLANS["b|700"].est_single_s), 1)
    assert tree_plans(trees, None) == ([None] * 3, 0)


def test_a_row_planned_as_another_tree_is_refused_by_name():
    entries = plan_entries(find_trees(UIDS, PROMPTS, RESPONSES), PLANS, len(UIDS))
    entries[3] = {**entries[3], "tree_id": "z|300"}  # sample 3 (of tree "a|300") says it belongs to "z|300"
    with pytest.raises(ValueError, match=r"batch row 3 of tree 1 \('a\|300'\) carries the plan of tree 'z\|300'"):
        tree_plans(_engine_trees(range(len(UIDS))), entries)


def test_prompts_that_differ_under_one_tree_id_replay_apart_on_one_device():
    entries = plan_entries(find_trees(UIDS, PROMPTS, RESPONSES), PLANS, len(UIDS))
    trees = _engine_trees(range(len(UIDS)), prompt_of=lambda i: int(i == 4))  # sample 4's prompt differs
    assert [(t.tree_id, t.samples) for t in trees] == [
        ("b|700", (0, 2, 5)),
        ("a|300", (1, 3)),
        ("a|300", (4,)),
        ("c|50", (6,)),
    ]
    plans, fallbacks = tree_plans(trees, entries, (1, 2, 4))
    assert plans[1] == plans[2] == Plan(est_time_s=PLANS["a|300"].est_single_s)  # part of a split plan: no plan
    assert fallbacks == 2
