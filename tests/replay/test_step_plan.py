"""The step plan: what it decides without a CP group, and its CP placement policy (which subgroup of a CP
group replays which tree, at which degree: ``assign_subgroups``, ``pack_subgroups``)."""

from __future__ import annotations

import pytest
import torch
import transformers

from augtree_verl.cp.mesh import CPMesh
from augtree_verl.groups import Tree, find_trees
from augtree_verl.plan import Plan
from augtree_verl.plan_field import plan_entries
from augtree_verl.planner import ClusterProfile
from augtree_verl.planner.cost import cost_model
from augtree_verl.replay import trie
from augtree_verl.replay.step_plan import StepPlan, assign_subgroups, pack_subgroups
from augtree_verl.replay.trie import MIN_SHARED_TOKENS
from tests.parity import random_trees


def test_without_a_cp_group_every_tree_is_a_slot_here_most_micro_batches_first():
    trees = random_trees([4, 4, 4], [[2], [3, 3, 3], [2, 2]])
    plan = StepPlan.build(trees, micro_batch_tokens=3)  # rows x longest row <= 3: [3] [3] [3], [2] [2], [2]
    assert [(s.trees[0], s.degree, s.shape.calls, s.node.micro_batches) for s in plan.slots] == [
        (1, 1, 3, [[0], [1], [2]]),
        (2, 1, 2, [[0], [1]]),
        (0, 1, 1, [[0]]),
    ]
    assert (plan.plans, plan.mesh, plan.subgroups, plan.fallbacks) == ([None] * 3, None, None, 0)


def test_from_batch_decodes_the_trainers_plans_and_counts_what_cannot_apply_here():
    uids, prompt_lens, response_lens = ["a", "b", "a"], [4, 3, 4], [2, 5, 3]
    # the two uids share no tokens (shared tokens would make one trie of their rows)
    sequences = [torch.arange(p + r) + 100 * (u == "b") for u, p, r in zip(uids, prompt_lens, response_lens)]
    planned = {"a|4": Plan(degree=2, est_time_s=1.0, est_single_s=1.5), "b|3": Plan(est_time_s=0.5)}
    entries = plan_entries(find_trees(uids, prompt_lens, response_lens), planned, len(uids))
    trees = find_trees(uids, prompt_lens, response_lens, sequences)
    # no CP group: the degree-2 plan cannot apply
    step_plan = StepPlan.from_batch(trees, entries, mesh=None, model_config=transformers.Qwen2Config())
    assert (step_plan.plans, step_plan.fallbacks) == ([Plan(est_time_s=1.5), planned["b|3"]], 1)
    assert [(s.trees[0], s.node.micro_batches) for s in step_plan.slots] == [(0, [[1, 0]]), (1, [[0]])]
    assert StepPlan.from_batch(trees, None, mesh=None, model_config=transformers.Qwen2Config()).plans == [None, None]


def test_subgroups_need_a_cp_group():
    with pytest.raises(ValueError, match="subgroups place trees in a CP group"):
        StepPlan.build(random_trees([4], [[2]]), subgroups=[0])


def test_heaviest_first_onto_the_least_loaded_subgroup():
    # Group of 4 ranks, by weight: 8 (degree 4) loads [2, 2, 2, 2]; 6 (degree 2) -> subgroup {0, 1}: [5, 5, 2, 2];
    # 3 -> rank 2: [5, 5, 5, 2]; 2 (degree 2) ties at 5 -> subgroup {0, 1}: [6, 6, 5, 2]; 1 and 1 -> rank 3.
    works = [8.0, 6.0, 2.0, 3.0, 1.0, 1.0]
    degrees = [4, 2, 2, 1, 1, 1]
    assert pack_subgroups(works, degrees, 4) == ([0, 0, 0, 2, 3, 3], 6.0)


def test_every_tree_is_placed_once_and_ties_go_low():
    assert pack_subgroups([1.0] * 5, [1] * 5, 2) == ([0, 1, 0, 1, 0], 3.0)
    assert pack_subgroups([], [], 8) == ([], 0.0)
    assert pack_subgroups([5.0, 5.0], [1, 1], 1) == ([0, 0], 10.0)


def test_a_degree_that_does_not_divide_the_group_names_the_tree():
    with pytest.raises(ValueError, match="tree 1: degree 3 does not divide the CP group size 4"):
        pack_subgroups([1.0, 2.0], [2, 3], 4)


def _trees(n):
    return [Tree(uid="u", prompt_len=8, response_lens=(2,))] * n


def _cp(single_s, efficiency=0.8, degree=2):
    """A degree-2 plan whose parallel efficiency T_1 / (d T_d) is ``efficiency``."""
    return Plan(degree=degree, est_time_s=single_s / (degree * efficiency), est_single_s=single_s)


def test_trees_that_balance_side_by_side_run_on_one_rank_each():
    # Two equal trees on 2 ranks: both at degree 2 take 2 x 0.625 = 1.25; side by side 1.0.
    assert assign_subgroups(_trees(2), [_cp(1.0), _cp(1.0)], 2) == ([1, 1], [0, 1])


def test_a_long_tree_beside_a_short_one_keeps_its_cp_plan():
    # 8 s at degree 2 (5 s) + a 1 s tree: 5 + 1 on one rank, 5 on the other = 6 < 8 side by side.
    plans = [_cp(8.0), Plan(est_time_s=1.0)]
    assert assign_subgroups(_trees(2), plans, 2) == ([2, 1], [0, 0])


def test_short_inefficient_trees_are_demoted_around_a_long_cp_tree():
    # 4 ranks: a long tree (8 s alone, 90% efficient at degree 4: 2.22 s on every rank) and three 1 s trees
    # planned at degree 2 with 50% efficiency (1 s on two ranks each). As planned: 2.22 + 1 + 1 = 4.22.
    # Demoting two short trees (the least efficient first, then by index): 2.22 + 1 on every rank = 3.22;
    # the third demotion ties (3.22) and is not taken; demoting the long tree would cost 8.
    plans = [_cp(8.0, efficiency=0.9, degree=4)] + [_cp(1.0, efficiency=0.5)] * 3
    degrees, placement = assign_subgroups(_trees(4), plans, 4)
    assert degrees == [4, 1, 1, 2]
    assert pack_subgroups([8.0 / 0.9, 1.0, 1.0, 2.0], degrees, 4)[1] == pytest.approx(8.0 / 3.6 + 1.0)


def test_three_trees_on_two_ranks_run_side_by_side():
    plans = [_cp(2.0, efficiency=0.5), _cp(4.0, efficiency=0.95), _cp(1.0, efficiency=0.9)]
    assert assign_subgroups(_trees(3), plans, 2)[0] == [1, 1, 1]  # makespan 4.0 vs 4.66 as planned


def test_without_planner_estimates_the_planned_degrees_stand():
    trees = _trees(2)
    assert assign_subgroups(trees, [None, None], 2) == ([1, 1], [0, 1])
    assert assign_subgroups(trees, [Plan(degree=2), Plan(degree=2, est_time_s=1.0)], 2)[0] == [2, 2]


def test_without_rebalance_the_planned_degrees_stand():
    assert assign_subgroups(_trees(2), [_cp(1.0), _cp(1.0)], 2, rebalance=False) == ([2, 2], [0, 0])


def test_the_trees_of_one_trie_go_to_one_rank():
    """Trees 0 and 3 share their prompt (one trie): on one rank together, as one item of their summed work
    (5 + 1 = 6, then 6 on the other rank, then 4 on the first, the lower on a tie), where alone they part."""
    assert pack_subgroups([5.0, 6.0, 4.0, 1.0], [1, 1, 1, 1], 2, tries=[[0, 3], [1], [2]]) == ([0, 1, 0, 0], 10.0)
    assert pack_subgroups([5.0, 6.0, 4.0, 1.0], [1, 1, 1, 1], 2) == ([1, 0, 1, 0], 9.0)
    trees = random_trees([6, 5, 7], [[2, 3], [40], [1, 2]], seed=2)  # the trie of 0 and 2 within a share
    trees[2] = Tree.of_tokens(trees[0].prompt, list(trees[2].responses))
    _, subgroups = assign_subgroups(trees, [None] * 3, 2, rebalance=False)
    assert subgroups[0] == subgroups[2] != subgroups[1]


def test_a_trie_heavier_than_a_ranks_share_is_cut_into_chunks():
    """Four trees behind one system prompt (one trie) on 2 ranks: two per rank (each rank runs the shared
    prefix once), not all four on one rank; a light trie still stays together."""
    assert pack_subgroups([4.0, 4.0, 4.0, 4.0], [1] * 4, 2, tries=[[0, 1, 2, 3]]) == ([0, 0, 1, 1], 8.0)
    assert pack_subgroups([5.0, 1.0, 1.0, 9.0], [1] * 4, 2, tries=[[0, 1, 2]]) == ([1, 1, 1, 0], 9.0)


def test_a_step_reads_its_token_ids_to_the_host_once(monkeypatch):
    """The engine's plan of a batch behind one system prompt on rank 0 of a CP group of 2: the trie makes its
    root context-parallel (the trees have CP plans), places the trees (the one trie on the subgroup of 2) and
    shapes this rank's slots from one copy of the token ids (``trie.host_token_ids``), and so does ``build``."""
    copies = []
    monkeypatch.setattr(trie, "host_token_ids", lambda ids: copies.append(len(ids)) or ids.numpy())
    system = torch.arange(3, 3 + MIN_SHARED_TOKENS)
    trees = [
        Tree.of_tokens(torch.cat([system, t.prompt]), t.responses, uid=str(k), samples=range(2 * k, 2 * k + 2))
        for k, t in enumerate(random_trees([6, 5, 7, 4], [[2, 3], [4, 1], [1, 2], [3, 3]], seed=1))
    ]
    plan = Plan(degree=2, est_time_s=0.6, est_single_s=1.0)
    entries = plan_entries(trees, {t.tree_id: plan for t in trees}, 8)
    step_plan = StepPlan.from_batch(
        trees, entries, mesh=CPMesh.for_planning((1, 2), 0), model_config=transformers.Qwen2Config()
    )
    assert len(copies) == 1
    assert step_plan.trie_demoted == 0 and step_plan.subgroups == [0, 0, 0, 0]
    assert [(root.trees(), d) for root, d in step_plan.cp_roots] == [([0, 1, 2, 3], 2)]
    StepPlan.build(trees)
    assert len(copies) == 2


def test_a_trie_found_for_other_trees_or_another_threshold_is_refused():
    trees = random_trees([6, 5], [[2, 3], [4, 1]], seed=1)
    with pytest.raises(ValueError, match="other trees"):
        StepPlan.build(trees, trie=trie.StepTrie(trees[:1]))
    with pytest.raises(ValueError, match=f"min_shared_tokens=0 and .* the plan asks for {trie.MIN_SHARED_TOKENS} and"):
        StepPlan.build(trees, trie=trie.StepTrie(trees, min_shared_tokens=0))
    with pytest.raises(ValueError, match=f"micro_batch_tokens=7, the plan asks for {trie.MIN_SHARED_TOKENS} and 8"):
        StepPlan.build(trees, micro_batch_tokens=8, trie=trie.StepTrie(trees, micro_batch_tokens=7))
    StepPlan.build(trees, micro_batch_tokens=8, trie=trie.StepTrie(trees, micro_batch_tokens=8))


def _behind_system_prompt(system: int, groups: int, seed: int = 0) -> list[Tree]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 1000, (system,), generator=g)
    return [
        Tree.of_tokens(
            torch.cat([prefix, torch.randint(3, 1000, (64,), generator=g)]),
            [torch.randint(3, 1000, (256,), generator=g) for _ in range(4)],
            uid=str(k),
        )
        for k in range(groups)
    ]


class _FixedCost:
    """A ``TrieCost`` with fixed answers: the whole trie on one device, its root's prefill, the CP slot."""

    def __init__(self, whole: float, prefill: float, cp: float):
        self.whole, self.prefill, self.cp = whole, prefill, cp

    def trie(self, node):
        return self.whole

    def node_prefill(self, node):
        return self.prefill

    def cp_trie(self, root, degree):
        return self.cp


def test_a_heavy_trie_without_cp_plans_gets_a_context_parallel_root_where_the_cost_model_says_sooner():
    """No tree has a CP plan. A batch behind one 4k-token system prompt is the whole step's work: cut into a chunk
    per rank, each rank would prefill the system prompt; the planner's cost model (7B on H100) predicts the
    context-parallel root sooner, so the trie runs with one. The same trie among heavier unrelated groups fits
    in one rank's share (it is not cut): no CP root. A cost that predicts the CP slot slower than the chunks'
    (root prefill + the rest over d) keeps the chunks."""
    mesh, cost = CPMesh.for_planning((1, 2), 0), cost_model(ClusterProfile.default())
    trees = _behind_system_prompt(4096, 8)
    step_plan = StepPlan.build(trees, mesh=mesh, trie_cost=cost)
    assert [(root.trees(), d) for root, d in step_plan.cp_roots] == [(list(range(8)), 2)]
    assert step_plan.subgroups == [0] * 8 and step_plan.trie_demoted == 0
    assert StepPlan.build(trees, mesh=mesh).cp_roots == []  # no cost model: the chunks, as before
    light = _behind_system_prompt(4096, 2) + random_trees([20000, 20000], [[900] * 8, [900] * 8], seed=1)
    assert StepPlan.build(light, mesh=mesh, trie_cost=cost).cp_roots == []
    # 10 s on one device, 1 s of it the root's prefill: the chunks take 1 + 9 / 2 = 5.5 s on two ranks
    assert StepPlan.build(trees, mesh=mesh, trie_cost=_FixedCost(10.0, 1.0, 5.4)).cp_roots != []
    assert StepPlan.build(trees, mesh=mesh, trie_cost=_FixedCost(10.0, 1.0, 5.6)).cp_roots == []


class _CostByDegree(_FixedCost):
    """A ``_FixedCost`` whose CP slot takes ``cp[degree]``."""

    def cp_trie(self, root, degree):
        return self.cp[degree]


def test_the_cost_model_searches_the_roots_degree_beyond_the_planned_one():
    """A batch behind one system prompt, every tree planned at degree 2, on a CP group of 4 (degrees 1, 2, 4).
    10 s on one device, 1 s of it the root's prefill: the chunks take 1 + 9 / 2 = 5.5 s over 2 ranks and
    1 + 9 / 4 = 3.25 s over 4. The root goes to the degree predicted the most below its chunks: 4 where its CP
    slot takes 2 s there (0.62 of its chunks against 5 / 5.5 = 0.91 at 2), the planned 2 where it takes 3.2 s at 4
    (0.98); where no degree is below its chunks the trie runs in chunks, its CP plans demoted and counted."""
    mesh = CPMesh.for_planning((1, 2, 4), 0)
    trees = _behind_system_prompt(4096, 8)
    plans = [Plan(degree=2, est_time_s=1.0, est_single_s=1.5)] * 8

    def roots(cp):
        step_plan = StepPlan.build(trees, plans=plans, mesh=mesh, trie_cost=_CostByDegree(10.0, 1.0, cp))
        return [d for _, d in step_plan.cp_roots], step_plan.trie_demoted

    assert roots({2: 5.0, 4: 2.0}) == ([4], 0)
    assert roots({2: 5.0, 4: 3.2}) == ([2], 0)
    assert roots({2: 6.0, 4: 4.0}) == ([], 8)
