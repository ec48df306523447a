"""The async trainer modes through verl's own ``main_ppo`` on CPU: ``examples/run_cpu.sh`` (GRPO recipe, AugTree
engine, rollout ``hf``, two trainer worker processes, Ray) for 2 steps with ``trainer.v1.trainer_mode`` set to
``augtree_colocate_async`` or ``augtree_separate_async`` (its own rollout worker, weights pushed through the CPU
checkpoint engine ``gloo``); the steps are read back from verl's file logger."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from augtree_verl.trainer.augtree_async import SEPARATE_ASYNC_MODE
from tests.e2e.runs import LR, STAGES, STEPS, read_steps, run_env, run_script
from tests.e2e.test_cpu_loop import assert_same_step_one

pytestmark = pytest.mark.slow

# The update's metrics: the policy loss and gradient, and our engine's replay counters.
UPDATE = ("actor/pg_loss", "actor/grad_norm", "actor/augtree/logical_tokens", "actor/augtree/executed_tokens",
          "actor/augtree/prefill_s", "actor/augtree/delayed_backward_s")
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
@pytest.mark.parametrize("mode", MODES)
def test_step_two_trains_a_batch_sampled_before_step_one_updated(request, mode):
    """The modes are really verl's async ones: a warm-up batch (``num_warmup_batches``, default 1) is sampled
    beside step 1's, so step 2 trains groups sampled one weight version late (verl's off-policy staleness),
    with their plans kept by uid until then."""
    first, second = request.getfixturevalue(mode).steps
    assert first["training/off_policy/trajectory_staleness/max"] == 0
    assert second["training/off_policy/trajectory_staleness/min"] >= 1


@pytest.mark.timeout(1300)
def test_separate_async_pushes_every_weight_to_its_rollout_pool_each_step(separate_async_run, assets):
    model = AutoModelForCausalLM.from_pretrained(assets / "model")
    weights = model.state_dict()
    for step, metrics in enumerate(separate_async_run.steps, 1):
        assert metrics["augtree/weight_sync/tensors"] == len(weights), step
        assert metrics["augtree/weight_sync/bytes"] == sum(t.nbytes for t in weights.values()), step
        assert metrics["augtree/weight_sync/buckets"] >= 1


@pytest.mark.timeout(1300)
def test_separate_async_step_one_is_the_stock_engines(assets, compared, tmp_path):
    """Without the warm-up batch, separate_async's step 1 trains the dataloader's first batch, as the sync
    trainer does: the same update as verl's stock engine in the compare run (with a warm-up batch, step 1 takes
    whichever of the two batches' groups verl's replay buffer lists first)."""
    log = tmp_path / "metrics.jsonl"
    run_script("run_cpu.sh", run_env(assets, tmp_path, STEPS="1", VERL_FILE_LOGGER_PATH=str(log)), tmp_path,
               f"trainer.v1.trainer_mode={SEPARATE_ASYNC_MODE}", "trainer.v1.separate_async.num_warmup_batches=0",
               f"actor_rollout_ref.actor.optim.lr={LR}")
    (ours,) = read_steps(log)
    assert ours["augtree/planner/plans_from_rollout"] == ours["augtree/balance/groups"]
    assert_same_step_one(ours, read_steps(compared / "fsdp2.jsonl")[0])
