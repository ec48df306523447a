"""Grouped replay vs the flattened baseline: log-probs and every parameter gradient, float32 CPU."""

import pytest
import torch

from augtree_verl import ReplayOptions, ReplayStats, StepPlan, per_response, replay
from augtree_verl.replay.baseline import flattened_replay
from tests.parity import (
    MODELS,
    assert_grads_match,
    assert_logps_match,
    grads,
    plan_and_options,
    random_trees,
    rel_err,
    tiny_model,
)


def grpo_like_loss(advantages):
    """Policy-gradient term plus a non-linear term so dL/dlogp differs per token."""
    return lambda t, i, logp: -(logp * advantages[t][i]).mean() + 0.05 * (logp**2).sum()


def run_both(model, trees, loss_fn, **kw):
    build, options = plan_and_options(kw)
    model.zero_grad(set_to_none=True)
    got = replay(model, StepPlan.build(trees, **build), per_response(loss_fn), options)
    got_grads = grads(model)
    model.zero_grad(set_to_none=True)
    want = flattened_replay(model, trees, loss_fn, temperature=options.temperature)
    return got, got_grads, want, grads(model)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_prompt_heavy_and_response_heavy(name):
    model = tiny_model(name)
    trees = random_trees([96, 9], [[5, 11, 3, 8], [40, 33, 1]])
    adv = [[0.5, -1.0, 2.0, 0.3], [1.0, -0.2, 0.7]]
    got, gg, want, gw = run_both(model, trees, grpo_like_loss(adv), micro_batch_tokens=24)
    assert_logps_match(got, want)
    assert_grads_match(gg, gw)


@pytest.mark.parametrize(
    "prompt_lens,response_lens",
    [
        ([1], [[1, 1, 1]]),  # one-token prompt, one-token responses
        ([13], [[6]]),  # G = 1
        ([7], [[3, 9, 1, 4, 12, 2, 5]]),  # G = 7, mixed lengths
        ([1], [[17]]),
    ],
)
def test_odd_lengths(prompt_lens, response_lens):
    model = tiny_model("qwen2-gqa", seed=1)
    trees = random_trees(prompt_lens, response_lens, seed=3)
    adv = [[(-1.0) ** i * (i + 1) for i in range(len(rs))] for rs in response_lens]
    got, gg, want, gw = run_both(model, trees, grpo_like_loss(adv), micro_batch_tokens=8)
    assert_logps_match(got, want)
    assert_grads_match(gg, gw)


@pytest.mark.parametrize("micro_batch_tokens", [1, 16, 10_000])
def test_temperature_and_micro_batch_budgets(micro_batch_tokens):
    model = tiny_model("llama-mha", seed=2)
    trees = random_trees([21, 50], [[4, 9, 2], [6, 6, 15, 1]], seed=4)
    adv = [[1.0, -1.0, 0.5], [0.2, -0.4, 1.5, -2.0]]
    got, gg, want, gw = run_both(
        model, trees, grpo_like_loss(adv), temperature=0.6, micro_batch_tokens=micro_batch_tokens
    )
    assert_logps_match(got, want)
    assert_grads_match(gg, gw)


def test_activation_checkpointing():
    model = tiny_model("qwen2-gqa", seed=5)
    model.gradient_checkpointing_enable()
    trees = random_trees([40], [[7, 12, 3]], seed=5)
    got, gg, want, gw = run_both(model, trees, grpo_like_loss([[1.0, -0.5, 2.0]]), micro_batch_tokens=20)
    assert_logps_match(got, want)
    assert_grads_match(gg, gw)


def test_reentrant_checkpointing_is_refused():
    model = tiny_model("qwen2-gqa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    trees = random_trees([8], [[3, 4]])
    with pytest.raises(ValueError, match="use_reentrant=False"):
        replay(model, StepPlan.build(trees), per_response(lambda t, i, lp: lp.sum()))


@pytest.mark.slow
def test_several_optimizer_steps_stay_in_parity():
    """Train by replay for several steps; before every step the flattened baseline, run on the same
    weights, must give the same log-probs and gradients (catches state leaking across steps or trees).

    Both are evaluated on the same weights: two replicas trained apart drift by float rounding that the
    training dynamics amplify, which says nothing about the engine.
    """
    model = tiny_model("qwen2-gqa", seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(4):
        trees = random_trees([30 + step, 5], [[4, 9, 2, 6], [12, 1, 7]], seed=100 + step)
        adv = [[1.0, -1.0, 0.5, -0.5], [2.0, -1.0, 0.1]]
        got, gg, want, gw = run_both(model, trees, grpo_like_loss(adv), micro_batch_tokens=12)
        assert_logps_match(got, want)
        assert_grads_match(gg, gw)
        for p, g in zip(model.parameters(), gg.values()):
            p.grad = g
        optimizer.step()
    moved = [rel_err(p.detach(), p0) for p, p0 in zip(model.parameters(), start)]
    assert min(moved) > 1e-4, "the weights must change between steps for this test to mean anything"


def test_forward_only_builds_no_graph_and_matches():
    model = tiny_model("qwen3-gqa", seed=8)
    trees = random_trees([25], [[5, 1, 9]], seed=8)
    got = replay(model, StepPlan.build(trees), options=ReplayOptions(temperature=1.3))
    want = flattened_replay(model, trees, temperature=1.3)
    assert_logps_match(got, want)
    assert all(not lp.requires_grad for row in got for lp in row)
    assert all(p.grad is None for p in model.parameters())


def test_stats_count_prompt_once():
    model = tiny_model("qwen2-gqa")
    trees = random_trees([50], [[4, 4, 4, 4]])
    stats = ReplayStats()
    replay(
        model,
        StepPlan.build(trees, micro_batch_tokens=100),
        per_response(lambda t, i, lp: lp.sum()),
        ReplayOptions(stats=stats),
    )
    assert stats.logical_tokens == 4 * (50 + 4)
    assert stats.executed_tokens == 50 + 4 * 3  # prompt once; each response feeds R - 1 tokens
    assert stats.trees == 1 and stats.micro_batches == 1


def test_model_outside_replay_runs_its_own_attention():
    model = tiny_model("llama-mha", seed=9).eval()
    ids = random_trees([20], [[1]])[0].prompt[None]
    before = model(input_ids=ids).logits
    replay(model, StepPlan.build(random_trees([5], [[3, 2]])))
    assert model.config._attn_implementation == "augtree"
    assert torch.equal(model(input_ids=ids).logits, before)
