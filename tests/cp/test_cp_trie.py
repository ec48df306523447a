"""Tries whose root runs context-parallel (``replay.cp_trie``) vs the flattened baseline, on real gloo ranks.

The batch is ``tests.replay.test_trie.sharing_batch``: five trees behind one system prompt (the root), with
every kind of sharing below it (a prompt under two uids, the next turn of a conversation, responses that
branch), and an unrelated group. The planner asked for a context-parallel plan for one of the five: the
whole trie then runs with its root prefilled once over the subgroup and its children dealt over the members.
Checked on every rank: log-probs equal the baseline's, the sum over ranks of every gradient equals the
baseline's (float32, ``tests.parity.RTOL``), over several optimizer steps, at micro-batch budgets that make
one and several micro-batches, with offload and checkpointing; each member runs its shard of the root (not
the root) and sends exactly ``trie_root_bytes``; the calls are in lock-step on every rank.
"""

import pytest
import torch
import torch.distributed as dist

from augtree_verl import Plan, ReplayOptions, ReplayStats, StepPlan, per_response, replay
from augtree_verl.cp.bytes import AttentionShape
from augtree_verl.cp.mesh import CPMesh
from augtree_verl.replay.baseline import flattened_replay
from augtree_verl.replay.cp_trie import trie_root_bytes
from augtree_verl.replay.lockstep import CPTrieSlot
from augtree_verl.replay.offload import Offload
from augtree_verl.replay.stats import TRIE_ROOT
from tests.cp.distributed import run_distributed
from tests.cp.test_engine import grpo_like_loss, summed_grads
from tests.cp.test_lockstep import _record, _same_on_every_rank
from tests.families import family_model
from tests.parity import assert_grads_match, assert_logps_match, grads, random_trees, tiny_model
from tests.replay.test_trie import MIN_SHARED, SHORT, sharing_batch

pytestmark = pytest.mark.slow  # spawns process groups


def _cp_plan(trees, degree: int, planned: int = 0) -> list[Plan | None]:
    plans: list[Plan | None] = [None] * len(trees)
    plans[planned] = Plan(degree=degree)
    return plans


def _step_plan(trees, plans, **build) -> StepPlan:
    step_plan = StepPlan.build(trees, plans=plans, min_shared_tokens=MIN_SHARED, **build)
    assert step_plan.trie_demoted == 0 and len(step_plan.cp_roots) == 1, step_plan.cp_roots
    return step_plan


def _check(
    model, trees, plans, *, seed=0, forward_runs=1, events=None, offload=None, **build
) -> tuple[ReplayStats, dict]:
    """One forward-only and one training call vs the baseline (with ``events``, ``_record``'s list: each in
    lock-step on every rank); returns the training call's stats and the gradients summed over the ranks."""
    loss_fn = grpo_like_loss(trees, seed)
    model.zero_grad(set_to_none=True)
    forward = replay(model, _step_plan(trees, plans, **build), None, ReplayOptions(offload=offload))
    if events is not None:
        _same_on_every_rank(events, "forward only")
    step_plan, stats = _step_plan(trees, plans, **build), ReplayStats()
    got = replay(model, step_plan, per_response(loss_fn), ReplayOptions(offload=offload, stats=stats))
    if events is not None:
        _same_on_every_rank(events, "training")
    summed = summed_grads(model)
    model.zero_grad(set_to_none=True)
    want = flattened_replay(model, trees, loss_fn)
    assert_logps_match(got, want)
    assert_logps_match(forward, want)
    assert_grads_match(summed, grads(model))
    # this rank's bytes: the formula's as a member of the root's subgroup, else none; the root counted once
    root, degree = step_plan.cp_roots[0]
    member = next((s.share.member for s in step_plan.slots if isinstance(s, CPTrieSlot)), None)
    expected = (
        trie_root_bytes(
            root.length,
            degree,
            member,
            AttentionShape.of(model.config, 4),
            model.config.hidden_size,
            forward_runs=forward_runs,
        )
        if member is not None
        else {"fwd": 0, "bwd": 0}
    )
    assert {k: stats.comm_bytes[f"{TRIE_ROOT}/{k}"] for k in ("fwd", "bwd")} == expected
    assert stats.cp_roots == (1 if member == 0 else 0)
    return stats, summed


def _world2(rank, world):
    model = tiny_model("qwen2-gqa", seed=3)
    trees = sharing_batch(**SHORT)
    plans = _cp_plan(trees, world)
    stats, _ = _check(model, trees, plans)
    # the root ran once over the group, each member its shard; every node prefilled once; each rank ran less
    # than one device would, and nothing was skipped (the members' shares only add padding)
    root = _step_plan(trees, plans).cp_roots[0][0]
    assert root.length == SHORT["system"]
    alone = ReplayStats()
    replay(model, StepPlan.build(trees, min_shared_tokens=MIN_SHARED), None, ReplayOptions(stats=alone))
    summed = torch.tensor([stats.nodes, stats.executed_tokens])
    dist.all_reduce(summed)
    assert summed[0] == alone.nodes, (summed, alone.nodes)
    assert stats.executed_tokens < alone.executed_tokens <= summed[1], (stats.executed_tokens, alone, summed)
    # several micro-batches per node, offload, several optimizer steps
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        _, summed = _check(model, trees, plans, seed=step, micro_batch_tokens=6, offload=Offload())
        for n, p in model.named_parameters():
            p.grad = summed[n]
        opt.step()
    # activation checkpointing (non-reentrant) on a Qwen3 model: the ring prefill's forward runs twice
    model = tiny_model("qwen3-gqa", seed=1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _check(model, trees, plans, forward_runs=2)
    # multi-head latent attention (DeepSeek-V3, D_v < D_k): the root's K/V gathered and returned at their true widths
    _check(family_model("deepseek-v3", seed=3), trees, plans)


def _world4_lockstep(rank, world):
    """CP group of 4 with subgroups of 2: a trie with a context-parallel root on one subgroup, a CP tree and
    groups elsewhere, all ranks one FSDP-like lock-step group: the same call sequence on every rank."""
    mesh = CPMesh.build([1, 2, 4])
    model = tiny_model("qwen2-gqa", seed=5)
    events = _record(model)
    shared = sharing_batch(**SHORT)
    others = random_trees([31, 5, 7], [[4, 9, 2], [3, 3], [6]], seed=11)
    trees = shared + others
    plans = _cp_plan(trees, 2, planned=1)
    plans[len(shared)] = Plan(degree=2)  # a CP tree of its own
    stats, _ = _check(
        model, trees, plans, seed=4, events=events, mesh=mesh, lockstep_group=dist.group.WORLD, micro_batch_tokens=8
    )
    counted = torch.tensor(stats.cp_roots)
    dist.all_reduce(counted)
    assert counted.item() == 1


@pytest.mark.timeout(400)
def test_a_trie_with_a_context_parallel_root_matches_flattened():
    run_distributed(_world2, 2)


@pytest.mark.timeout(400)
def test_context_parallel_roots_keep_every_rank_in_lock_step():
    run_distributed(_world4_lockstep, 4)
