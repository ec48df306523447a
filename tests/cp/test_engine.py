"""``replay`` with context-parallel plans vs the flattened single-process baseline, on real gloo process groups.

Contract checked on every rank: returned log-probs equal the baseline's; the SUM over ranks of every
parameter's .grad equals the baseline's .grad (float32, 1e-5 relative); bytes each rank sent per
primitive equal the analytic count (``cp.bytes``, summed over the same ``cp.schedule`` steps the run
executes); the prompt runs once per lane / group."""

import pytest
import torch
import torch.distributed as dist

from augtree_verl import Plan, ReplayOptions, ReplayStats, StepPlan, per_response, replay
from augtree_verl.cp.bytes import AttentionShape, analytic_bytes
from augtree_verl.cp.layout import ZigzagLayout
from augtree_verl.planner import plan_tree
from augtree_verl.replay import held_prompt_tensors
from augtree_verl.replay.baseline import flattened_replay
from augtree_verl.replay.offload import Offload
from tests.cp.distributed import run_distributed
from tests.families import VOCAB as FAMILY_VOCAB
from tests.families import family_model
from tests.parity import assert_grads_match, assert_logps_match, grads, random_trees, tiny_model

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses


def grpo_like_loss(trees, seed=0):
    """Policy-gradient term plus a non-linear term so dL/dlogp differs per token."""
    g = torch.Generator().manual_seed(seed)
    adv = [torch.randn(len(t.responses), generator=g).tolist() for t in trees]
    return lambda t, i, logp: -(logp * adv[t][i]).mean() + 0.05 * (logp**2).sum()


def split_plan(primitive, d, lanes, placement):
    return Plan(
        degree=d, primitive=primitive, rounds=1 + max(r for r, _ in placement), lanes=lanes, placement=placement
    )


def ring_plan(d):
    return Plan(degree=d, primitive="ring")


def summed_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's .grad summed over the ranks (a rank that scores no token leaves e.g. the LM head's
    .grad None: its share is zero)."""
    summed = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    for n in summed:
        dist.all_reduce(summed[n])
    return summed


def check_call(model, trees, plans, *, temperature=1.0, train=True, seed=0, forward_runs=1, offload=None):
    """One CP call vs the baseline on the same weights; returns (stats, grads summed over ranks).
    ``forward_runs``: 2 with activation checkpointing (each layer's forward, and its communication, re-runs
    once in the backward); ``offload``: an ``Offload`` for the prompts' activations (training)."""
    loss_fn = grpo_like_loss(trees, seed) if train else None
    model.zero_grad(set_to_none=True)
    stats = ReplayStats()
    step_plan = StepPlan.build(trees, plans=plans)
    options = ReplayOptions(temperature=temperature, stats=stats, offload=offload)
    got = replay(model, step_plan, per_response(loss_fn) if train else None, options)
    summed = summed_grads(model) if train else {}
    model.zero_grad(set_to_none=True)
    want = flattened_replay(model, trees, loss_fn, temperature=temperature)
    assert_logps_match(got, want)
    if train:
        assert_grads_match(summed, grads(model))

    rank, shape = dist.get_rank(), AttentionShape.of(model.config, 4)
    for primitive in {p.primitive for p in plans}:
        want_bytes = {"fwd": 0, "bwd": 0}
        for tree, plan in zip(trees, plans):
            if plan.primitive == primitive:
                b = analytic_bytes(plan, tree.prompt_len, tree.response_lens, rank, shape, train)
                want_bytes = {"fwd": want_bytes["fwd"] + forward_runs * b["fwd"], "bwd": want_bytes["bwd"] + b["bwd"]}
        got_bytes = {k: stats.comm_bytes.get(f"{primitive}/{k}", 0) for k in ("fwd", "bwd")}
        assert got_bytes == want_bytes, (rank, primitive, got_bytes, want_bytes)
    return stats, summed


PROMPT_HEAVY = ([41], [[3, 6, 2]])  # G = 3: not divisible by 2 lanes
RESPONSE_HEAVY = ([5], [[17, 12, 9]])


def one_lane_tokens(prompt_len, response_lens, rank, d):
    """Tokens a rank runs when one lane of d ranks prefills the prompt once and replays every response
    (each feeds R - 1 tokens); a rank with no token of a sequence runs one dummy token."""
    shard = lambda n: max(1, ZigzagLayout(n, d).size(rank))
    return shard(prompt_len) + sum(shard(r - 1) for r in response_lens if r > 1)


def _world2(rank, world):
    model = tiny_model("qwen2-gqa")
    for prompt_lens, response_lens in (PROMPT_HEAVY, RESPONSE_HEAVY):
        trees = random_trees(prompt_lens, response_lens, seed=len(response_lens[0]))
        for plan in (
            ring_plan(2),
            split_plan("tree_move_kv", 2, 1, ((0, 0), (1, 0), (2, 0))),
            split_plan("tree_move_kv", 2, 2, ((0, 0), (0, 1), (1, 0))),
            split_plan("move_q", 2, 2, ((0, 0), (0, 1), (1, 0))),
            split_plan("move_q", 2, 1, ((0, 0), (1, 0), (1, 0))),
        ):
            stats, _ = check_call(model, trees, [plan])
            if plan.primitive != "ring" and plan.lanes == 1:  # the prompt ran once, not per response
                assert stats.executed_tokens == one_lane_tokens(prompt_lens[0], response_lens[0], rank, world)
    # several trees with different plans in one call, through the public replay(); temperature != 1
    trees = random_trees([13, 30, 2], [[4, 9], [5, 1, 7, 3], [6, 2, 1]], seed=5)
    plans = [
        ring_plan(2),
        split_plan("move_q", 2, 2, ((0, 0), (1, 1), (0, 1), (1, 0))),
        split_plan("tree_move_kv", 2, 2, ((0, 1), (0, 0), (1, 0))),
    ]
    stats, _ = check_call(model, trees, plans, temperature=0.7)
    # each tree is counted once in the group: by its subgroup's first member
    assert dict(stats.plans) == ({"ring": 1, "move_q": 1, "tree_move_kv": 1} if rank == 0 else {})
    # forward only
    check_call(model, trees, plans, train=False)
    # activation checkpointing (non-reentrant) on a Qwen3 model
    model = tiny_model("qwen3-gqa", seed=1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    check_call(model, trees, plans, forward_runs=2)
    # multi-head latent attention, the value width apart from the query/key width (DeepSeek-V3: D_v < D_k,
    # Mistral 4: D_v > D_k): every primitive in one call, bytes by the shape its config gives
    mla_trees = random_trees([13, 30, 2], [[4, 9], [5, 1, 7, 3], [6, 2, 1]], seed=5, vocab=FAMILY_VOCAB)
    for name in ("deepseek-v3", "mistral4"):
        check_call(family_model(name, seed=2), mla_trees, plans)


def _world4(rank, world):
    model = tiny_model("llama-mha", seed=3)
    trees = random_trees([37, 6], [[2, 11, 1, 5, 8], [23, 4, 9]], seed=7)
    for plans in (
        [
            split_plan("tree_move_kv", 4, 2, ((0, 0), (0, 1), (1, 0), (1, 1), (2, 0))),
            split_plan("move_q", 4, 3, ((0, 0), (0, 1), (0, 2))),
        ],
        [split_plan("tree_move_kv", 4, 4, ((0, 0), (0, 1), (0, 2), (0, 3), (1, 2))), ring_plan(4)],
        [
            split_plan("move_q", 4, 2, ((0, 0), (0, 0), (1, 1), (0, 1), (1, 0))),
            split_plan("tree_move_kv", 4, 1, ((0, 0), (1, 0), (1, 0))),
        ],
    ):
        stats, _ = check_call(model, trees, plans)
    # plans made by the planner (each split primitive forced once) run as planned
    planned = [
        plan_tree(t.prompt_len, t.response_lens, degrees=(world,), force_primitive=p)
        for t, p in zip(trees, ("move_q", "tree_move_kv"))
    ]
    check_call(model, trees, planned)


def _several_steps(rank, world):
    """Parity after each of three AdamW steps (the same summed gradient applied on every rank)."""
    model = tiny_model("qwen2-gqa", seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trees = random_trees([19], [[7, 3, 10]], seed=9)
    plans = [split_plan("move_q", world, 2, ((0, 0), (0, 1), (1, 0)))]
    for step in range(3):
        _, summed = check_call(model, trees, plans, seed=step)
        for n, p in model.named_parameters():
            p.grad = summed[n]
        opt.step()


def entropy(logits):
    return torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)


def assert_scores_match_flattened(model, trees, loss_fn, temperature, got, summed) -> None:
    """``got[t][i]`` ([R, 2]: log-prob, entropy) and the gradients ``summed`` over ranks of
    sum_{t,i} loss_fn(t, i, scores_ti) equal the flattened baseline's (which this leaves in ``.grad``)."""
    model.zero_grad(set_to_none=True)
    entropies = {}
    want = flattened_replay(
        model,
        trees,
        keep_graph=True,
        temperature=temperature,
        on_logits=lambda t, i, logits: entropies.__setitem__((t, i), entropy(logits)),
    )
    sum(
        loss_fn(t, i, torch.stack([want[t][i], entropies[(t, i)]], dim=-1))
        for t in range(len(trees))
        for i in range(len(trees[t].responses))
    ).backward()
    assert_logps_match([[s[:, 0] for s in row] for row in got], want)
    assert_logps_match(
        [[s[:, 1] for s in row] for row in got],
        [[entropies[(t, i)] for i in range(len(tree.responses))] for t, tree in enumerate(trees)],
    )
    assert_grads_match(summed, grads(model))


def _micro_batch_loss_with_entropy(rank, world, offload_on=False):
    """``micro_batch_loss`` + ``entropy_fn`` (what the verl engine uses): scores [R, 2] on every rank, a
    loss over log-probs and entropies of each step's responses, over three optimizer steps. With
    ``offload_on`` each rank's prompt shard waits on the host while its responses replay."""
    model = tiny_model("qwen2-gqa", seed=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trees = random_trees([21, 4], [[5, 2, 8], [9, 1, 3, 6]], seed=11)
    plans = [
        split_plan("move_q", world, 2, ((0, 0), (0, 1), (1, 0))),
        split_plan("tree_move_kv", world, 2, ((0, 0), (0, 1), (1, 1), (1, 0))),
    ]
    for step in range(3):
        pg = grpo_like_loss(trees, seed=step)

        def loss_fn(t, i, scores):
            return pg(t, i, scores[:, 0]) + 0.1 * scores[:, 1].sum()

        held, hosted = [], []

        def micro_batch_loss(t, rows, scores):
            held.append(len(held_prompt_tensors()))  # this tree's prompt leaves (and sums) are alive
            if offload is not None:
                hosted.append(offload.host_bytes)  # and its saved activations wait on the host
            return sum(loss_fn(t, i, s) for i, s in zip(rows, scores))

        model.zero_grad(set_to_none=True)
        offload = Offload(min_bytes=0) if offload_on else None
        got = replay(
            model,
            StepPlan.build(trees, plans=plans if step != 1 else [ring_plan(world)] * 2),
            micro_batch_loss,
            ReplayOptions(temperature=0.8, entropy_fn=entropy, offload=offload),
        )
        assert all(
            s.shape == (n, 2) and not s.requires_grad
            for tree, row in zip(trees, got)
            for s, n in zip(row, tree.response_lens)
        )
        assert held and min(held) > 0 and not held_prompt_tensors()
        if offload is not None:
            if step != 1:  # ring trees have no shared prefill: nothing to offload at step 1
                assert min(hosted) > 0 and offload.stats.offloaded_bytes > 0
            assert offload.host_bytes == 0 and offload.device_storages() == []
        summed = summed_grads(model)
        assert_scores_match_flattened(model, trees, loss_fn, 0.8, got, summed)
        for n, p in model.named_parameters():
            p.grad = summed[n]
        opt.step()


def _world1(rank, world):
    model = tiny_model("qwen2-gqa")
    trees = random_trees([9], [[4, 1, 6]], seed=2)
    for plan in (
        ring_plan(1),
        split_plan("tree_move_kv", 1, 1, ((0, 0), (1, 0), (1, 0))),
        split_plan("move_q", 1, 1, ((0, 0), (0, 0), (1, 0))),
    ):
        stats, _ = check_call(model, trees, [plan])
        assert stats.total_comm_bytes == 0


@pytest.mark.timeout(400)
def test_world2_each_primitive_prompt_and_response_heavy_mixed_plans():
    run_distributed(_world2, 2)


@pytest.mark.timeout(400)
def test_world4_lanes_short_responses_mha():
    run_distributed(_world4, 4)


@pytest.mark.timeout(300)
def test_parity_after_each_of_several_steps():
    run_distributed(_several_steps, 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("offload_on", [False, True])
def test_micro_batch_loss_with_entropy_scores(offload_on):
    run_distributed(_micro_batch_loss_with_entropy, 2, offload_on)


@pytest.mark.timeout(200)
def test_degree_one():
    run_distributed(_world1, 1)


def _bad_plans(rank, world):
    model = tiny_model("qwen2-gqa")
    trees = random_trees([5], [[3, 2]], seed=1)
    with pytest.raises(ValueError, match="tree 0: plan degree 4 differs from the CP group size 2"):
        replay(model, StepPlan.build(trees, plans=[ring_plan(4)]))
    with pytest.raises(ValueError, match="tree 0 has 1 cells"):
        replay(model, StepPlan.build(trees, plans=[split_plan("move_q", 2, 1, ((0, 0),))]))
    with pytest.raises(ValueError, match="tree 0: subgroup 1 outside the 1 subgroups of degree 2"):
        replay(model, StepPlan.build(trees, plans=[ring_plan(2)], subgroups=[1]))


@pytest.mark.timeout(200)
def test_bad_plans_raise():
    run_distributed(_bad_plans, 2)


def test_needs_initialised_process_group():
    model = tiny_model("qwen2-gqa")
    trees = random_trees([5], [[3]], seed=1)
    with pytest.raises(ValueError, match="torch.distributed initialised"):
        replay(model, StepPlan.build(trees, plans=[ring_plan(2)]))
