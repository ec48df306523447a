"""Lock-step with context parallelism (``replay`` with a mesh and ``lockstep_group``) on real gloo ranks.

World 4 as one CP group with degrees [1, 2, 4]; the ranks hold very different work: two degree-4 trees,
three degree-2 trees on subgroup {0, 1} against one on {2, 3} (with a TreeMoveKV lane that has fewer
responses than the other), and five degree-1 trees on rank 0 against one on rank 3 and none on ranks 1 and 2.
Checked on every rank:
- every rank issues the same sequence of model calls and backwards (decoder call "D", LM-head call "H",
  backward "B": what FSDP2's per-layer collectives need), in training and forward-only;
- every response's log-probs and entropies come back on every rank and equal the flattened baseline's, and
  the parameter gradients summed over the ranks equal the baseline's (1e-5 relative), over two AdamW steps.
"""

import pytest
import torch
import torch.distributed as dist

from augtree_verl import Plan, ReplayOptions, StepPlan, per_response, replay
from augtree_verl.cp.mesh import CPMesh
from tests.cp.distributed import run_distributed
from tests.cp.test_engine import (
    assert_scores_match_flattened,
    entropy,
    grpo_like_loss,
    ring_plan,
    split_plan,
    summed_grads,
)
from tests.parity import random_trees, tiny_model

pytestmark = pytest.mark.slow  # spawns process groups

PROMPTS = [29, 7, 21, 12, 9, 15, 5, 8, 11, 6, 4, 10, 3]
RESPONSES = [
    [4, 6, 3],
    [9, 5],
    [3, 7, 2],
    [5, 2, 4],
    [1, 6],
    [8, 3, 5, 2],
    [3, 4],
    [2, 5, 3],
    [6, 2],
    [4],
    [3, 1, 2],
    [2, 7],
    [5, 3],
]
PLANS = [
    split_plan("move_q", 4, 2, ((0, 0), (0, 1), (1, 0))),
    ring_plan(4),
    split_plan("tree_move_kv", 2, 2, ((0, 0), (1, 0), (0, 1))),
    ring_plan(2),
    split_plan("move_q", 2, 1, ((0, 0), (1, 0))),
    split_plan("tree_move_kv", 2, 1, ((0, 0), (1, 0), (2, 0), (3, 0))),
] + [None] * 7
# degree-2 trees 2, 3, 4 on subgroup 0 and tree 5 on subgroup 1; degree-1 trees 6-10 on rank 0, 11-12 on rank 3
SUBGROUPS = [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 3, 3]


def _record(model) -> list[str]:
    events = []
    model.model.register_forward_hook(lambda *_: events.append("D"))
    model.lm_head.register_forward_hook(lambda *_: events.append("H"))
    model.model.embed_tokens.weight.register_hook(lambda g: events.append("B"))
    return events


def _same_on_every_rank(events: list[str], what: str) -> None:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, "".join(events))
    assert all(e == everyone[0] for e in everyone), f"{what}: call sequences differ: {everyone}"
    events.clear()


def _skewed(rank, world):
    mesh = CPMesh.build([1, 2, 4])
    model = tiny_model("qwen2-gqa", seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    events = _record(model)
    trees = random_trees(PROMPTS, RESPONSES, seed=3)
    for step in range(2):
        pg = grpo_like_loss(trees, seed=step)

        def loss_fn(t, i, scores):
            return pg(t, i, scores[:, 0]) + 0.1 * scores[:, 1].sum()

        step_plan = dict(plans=PLANS, mesh=mesh, subgroups=SUBGROUPS, lockstep_group=dist.group.WORLD)
        options = ReplayOptions(entropy_fn=entropy, temperature=0.9)
        got = replay(model, StepPlan.build(trees, **step_plan), None, options)
        _same_on_every_rank(events, f"step {step} forward only")
        forward = got
        model.zero_grad(set_to_none=True)
        got = replay(model, StepPlan.build(trees, **step_plan), per_response(loss_fn), options)
        _same_on_every_rank(events, f"step {step} training")
        summed = summed_grads(model)
        assert_scores_match_flattened(model, trees, loss_fn, 0.9, got, summed)
        assert_scores_match_flattened(model, trees, loss_fn, 0.9, forward, summed)
        events.clear()
        for n, p in model.named_parameters():
            p.grad = summed[n]
        opt.step()


@pytest.mark.timeout(500)
def test_skewed_cp_work_issues_the_same_calls_on_every_rank_and_matches_flattened():
    run_distributed(_skewed, 4)


def _bad_mesh_degree(rank, world):
    mesh = CPMesh.build([1, 2])
    model = tiny_model("qwen2-gqa")
    trees = random_trees([5], [[3, 2]], seed=1)
    with pytest.raises(ValueError, match="tree 0: plan degree 4 differs from the CP group size 2"):
        replay(model, StepPlan.build(trees, plans=[Plan(degree=4, primitive="ring")], mesh=mesh, subgroups=[0]))


@pytest.mark.timeout(200)
def test_a_plan_degree_the_mesh_lacks_names_the_tree():
    run_distributed(_bad_mesh_degree, 2)
