import dataclasses
import math

import numpy as np
import pytest

from augtree_verl import Plan
from augtree_verl.groups import GroupLengths
from augtree_verl.planner import ClusterProfile, plan_tree
from augtree_verl.planner.cost import cost_model
from augtree_verl.planner.search import _Search

NODE = (1, 2, 4, 8)
CLUSTER = (1, 2, 4, 8, 16, 32, 64, 128)
REL = 1e-12  # the same float64 formulas evaluated in a different order


def check_valid(plan: Plan, G: int):
    plan.check_responses(G)
    assert set(plan.est_parts) == {"prefill", "replay", "comm"}
    assert plan.est_time_s == pytest.approx(sum(plan.est_parts.values()), rel=REL)
    assert all(v >= 0 for v in plan.est_parts.values())
    if plan.primitive == "ring":
        assert (plan.rounds, plan.lanes, plan.placement) == (0, 1, ())
    else:
        assert len(set(plan.placement)) == G, "one response per (round, lane) cell"
        assert plan.degree % plan.lanes == 0
    assert Plan.from_dict(plan.to_dict()) == plan


def test_prompt_dominated_group_gets_move_q():
    plan = plan_tree(131072, [256] * 8, degrees=NODE)
    check_valid(plan, 8)
    assert plan.primitive == "move_q" and plan.degree > 1


def test_response_dominated_group_gets_tree_move_kv():
    plan = plan_tree(512, [16384] * 8, degrees=NODE)
    check_valid(plan, 8)
    assert plan.primitive == "tree_move_kv" and plan.degree > 1


@pytest.mark.parametrize("prompt_len, response_lens", [(64, [32] * 8), (16, [16] * 8), (300, [40])])
def test_short_group_gets_ring_or_one_rank(prompt_len, response_lens):
    plan = plan_tree(prompt_len, response_lens, degrees=NODE)
    check_valid(plan, len(response_lens))
    assert plan.primitive == "ring" or plan.degree == 1


@pytest.mark.parametrize("primitive", ["ring", "tree_move_kv", "move_q"])
def test_force_primitive(primitive):
    plan = plan_tree(4096, [100, 3000, 800, 50, 1200, 7000, 20, 400], degrees=NODE, force_primitive=primitive)
    check_valid(plan, 8)
    assert plan.primitive == primitive


def test_tree_move_kv_lanes_are_balanced_and_longest_first():
    lens = [100, 3000, 800, 50, 1200, 7000, 20, 400, 2500]
    plan = plan_tree(256, lens, degrees=(4,), force_primitive="tree_move_kv")
    check_valid(plan, len(lens))
    by_lane = {}
    for i, (r, s) in enumerate(plan.placement):
        by_lane.setdefault(s, []).append((r, lens[i]))
    for cells in by_lane.values():
        assert [n for _, n in sorted(cells)] == sorted((n for _, n in cells), reverse=True)
    assert plan.rounds == max(len(c) for c in by_lane.values())


def exhaustive_choice(P, lens, degrees, profile):
    """Every candidate evaluated exactly, then the documented rule applied without pruning."""
    search = _Search(cost_model(profile), GroupLengths(P, lens))
    cands = [c for c in search.candidates(degrees, None) if c.memory <= profile.memory_per_rank_bytes]
    for c in cands:
        if c.parts is None:
            search.exact(c)
    least = min(c.degree * c.time for c in cands)
    eff = profile.min_parallel_efficiency
    admissible = [c for c in cands if eff == 0 or c.degree * c.time <= least / eff]
    best = min(admissible, key=lambda c: c.key())
    return best.degree, best.primitive, best.lanes, best.time


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("efficiency", [0.0, 0.8])
def test_pruned_search_equals_exhaustive(seed, efficiency):
    rng = np.random.default_rng(seed)
    G = int(rng.integers(1, 12))
    P = int(rng.choice([64, 2048, 32768, 200000]))
    lens = rng.integers(1, int(rng.choice([256, 8192, 65536])), G).tolist()
    profile = dataclasses.replace(ClusterProfile.default(), min_parallel_efficiency=efficiency)
    plan = plan_tree(P, lens, degrees=CLUSTER, profile=profile)
    check_valid(plan, G)
    d, primitive, lanes, time = exhaustive_choice(P, lens, CLUSTER, profile)
    assert (plan.degree, plan.primitive, plan.lanes) == (d, primitive, lanes)
    assert plan.est_time_s == pytest.approx(time, rel=REL)


def test_more_ranks_never_slower_when_efficiency_is_ignored():
    profile = dataclasses.replace(ClusterProfile.default(), min_parallel_efficiency=0.0)
    times = [
        plan_tree(65536, [4096] * 8, degrees=CLUSTER[:k], profile=profile).est_time_s
        for k in range(1, len(CLUSTER) + 1)
    ]
    assert all(a >= b for a, b in zip(times, times[1:]))


def test_plans_report_the_best_one_rank_time():
    """``est_single_s``: the tree's best one-rank plan time (what a CP group weighs CP against)."""
    for prompt_len, response_lens in ((65536, [256] * 8), (4096, [64] * 8), (64, [32] * 8)):
        plan = plan_tree(prompt_len, response_lens, degrees=CLUSTER)
        alone = plan_tree(
            prompt_len,
            response_lens,
            degrees=(1,),
            profile=dataclasses.replace(ClusterProfile.default(), min_parallel_efficiency=0.0),
        )
        assert plan.est_single_s == pytest.approx(alone.est_time_s)
        assert plan.est_single_s >= plan.est_time_s
        assert Plan.from_dict(plan.to_dict()) == plan
    assert plan_tree(4096, [64] * 8, degrees=(2, 4)).est_single_s is None  # no one-rank plan allowed
    assert plan_tree(400_000, [1000] * 8, degrees=CLUSTER).est_single_s is None  # none fits in memory


def test_memory_error_says_what_the_smallest_plan_needs():
    with pytest.raises(
        ValueError,
        match=r"no plan fits in memory: the smallest plan \(.*\) needs "
        r"[0-9.]+ GiB per rank but a rank has 46.57 GiB",
    ):
        plan_tree(1_000_000, [1000] * 8, degrees=(1, 2))


def test_topology_rules_drop_straddling_groups():
    with pytest.raises(ValueError, match="every degree breaks the topology rules"):
        plan_tree(100, [10, 10], degrees=(3, 12))  # 3 does not tile an 8-rank node, 12 is not whole nodes
    assert plan_tree(100, [10, 10], degrees=(3, 2)).degree in (1, 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt_len=0, response_lens=[5]), "prompt_len must be a positive int, got 0"),
        (dict(prompt_len=-3, response_lens=[5]), "prompt_len must be a positive int, got -3"),
        (dict(prompt_len=2.5, response_lens=[5]), "prompt_len must be a positive int, got 2.5"),
        (dict(prompt_len=10, response_lens=[]), "response_lens is empty"),
        (dict(prompt_len=10, response_lens=[5, 0]), r"response_lens\[1\] must be a positive int, got 0"),
        (dict(prompt_len=10, response_lens=[5, -1, 3]), r"response_lens\[1\] must be a positive int, got -1"),
        (dict(prompt_len=10, response_lens=[5], degrees=()), "degrees is empty"),
        (dict(prompt_len=10, response_lens=[5], degrees=(2, 0)), r"degrees\[1\] must be a positive int"),
        (dict(prompt_len=10, response_lens=[5], force_primitive="zigzag"), "force_primitive must be one of"),
        (dict(prompt_len=10, response_lens=[5], profile="h100"), "profile must be a ClusterProfile"),
    ],
)
def test_bad_input_names_the_problem(kwargs, message):
    kwargs.setdefault("degrees", NODE)
    with pytest.raises(ValueError, match=message):
        plan_tree(**kwargs)


def test_numpy_lengths_are_accepted():
    plan = plan_tree(np.int64(512), np.array([100, 200], dtype=np.int32), degrees=[np.int64(2)])
    check_valid(plan, 2)
    assert math.isfinite(plan.est_time_s)
