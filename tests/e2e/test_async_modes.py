"""The async trainer modes through verl's own ``main_ppo`` on CPU: ``examples/run_cpu.sh`` (GRPO recipe, AugTree
engine, rollout ``hf``, two trainer worker processes, Ray) for 2 steps with ``trainer.v1.trainer_mode`` set to
``augtree_colocate_async`` or ``augtree_separate_async`` (its own rollout worker, weights pushed through the CPU
checkpoint engine ``gloo``); the steps are read back from verl's file logger (the runs: ``conftest``)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from tests.e2e.runs import STAGES, STEPS, read_steps
from tests.e2e.test_cpu_loop import ROLLOUT_PROB_ATOL, assert_same_step_one

pytestmark = pytest.mark.slow

# The update's metrics: the policy loss and gradient, and our engine's replay counters.
UPDATE = (
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/augtree/logical_tokens",
    "actor/augtree/executed_tokens",
    "actor/augtree/prefill_s",
    "actor/augtree/delayed_backward_s",
)
MODES = ["colocate_async_run", "separate_async_run"]


@pytest.mark.timeout(1300)
@pytest.mark.parametrize("mode", MODES)
def test_every_stage_runs_with_plans_from_the_rollout(request, mode):
    steps = request.getfixturevalue(mode).steps
    assert len(steps) == STEPS
    for step, metrics in enumerate(steps, 1):
        missing = [s for s in STAGES + ("balance",) if f"timing_s/{s}" not in metrics]
        assert not missing, f"step {step}: stages {missing} did not run"
        assert metrics["training/global_step"] == step
        assert metrics["response_length/mean"] > 0
        # every group's plan was made by the planner service from the rollout workers' reports, none here
        assert metrics["augtree/planner/plans_from_rollout"] > 0, f"step {step}: no plan came from the rollout"
        assert metrics["augtree/planner/plans_in_process"] == 0, f"step {step}: groups planned in-process"
        assert metrics["augtree/planner/plans_from_rollout"] == metrics["augtree/balance/groups"]
        missing = [key for key in UPDATE if key not in metrics]
        assert not missing, f"step {step}: update metrics {missing} not logged"
        assert metrics["actor/grad_norm"] > 0
        assert metrics["actor/augtree/executed_tokens"] < metrics["actor/augtree/logical_tokens"]


@pytest.mark.timeout(1300)
def test_colocate_async_step_two_trains_a_batch_sampled_before_step_one_updated(colocate_async_run):
    """The mode is really verl's colocate_async: a warm-up batch (``num_warmup_batches``, default 1) is sampled
    beside step 1's, so step 2 trains groups sampled one weight version late (verl's off-policy staleness),
    with their plans kept by uid until then."""
    first, second = colocate_async_run.steps
    assert first["training/off_policy/trajectory_staleness/max"] == 0
    assert second["training/off_policy/trajectory_staleness/min"] >= 1


@pytest.mark.timeout(1300)
def test_separate_async_pushes_every_weight_to_its_rollout_pool_each_step(separate_async_run, assets):
    """Through the CPU checkpoint engine: every tensor, every byte, after every step; without a warm-up batch
    (staleness 0, as configured) step 2's responses were sampled with the weights pushed after step 1, and the
    rollout's log-probs are the trainer's to float32 rounding."""
    model = AutoModelForCausalLM.from_pretrained(assets / "model")
    weights = model.state_dict()
    for step, metrics in enumerate(separate_async_run.steps, 1):
        assert metrics["augtree/weight_sync/tensors"] == len(weights), step
        assert metrics["augtree/weight_sync/bytes"] == sum(t.nbytes for t in weights.values()), step
        assert metrics["augtree/weight_sync/buckets"] >= 1
        assert metrics["training/off_policy/trajectory_staleness/max"] == 0, step
        diff = metrics["training/rollout_probs_diff_max"]
        assert diff <= ROLLOUT_PROB_ATOL, f"step {step}: rollout probabilities off by {diff:.1e}"


@pytest.mark.timeout(1300)
def test_separate_async_step_one_is_the_stock_engines(separate_async_run, compared):
    """separate_async's step 1 trains the dataloader's first batch from the initial weights, as the compare
    run's stock engine (sync trainer) does: the same responses and update."""
    assert_same_step_one(separate_async_run.steps[0], read_steps(compared / "fsdp2.jsonl")[0])
