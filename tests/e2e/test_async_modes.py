"""The async trainer modes through verl's own ``main_ppo`` on CPU: ``examples/run_cpu.sh`` (GRPO recipe, AugTree
engine, rollout ``hf``, two worker processes, Ray) for 2 steps with ``trainer.v1.trainer_mode`` set to our
``augtree_colocate_async``; the steps are read back from verl's file logger."""

from __future__ import annotations

import pytest

from augtree_verl.cpu_loop.task import TaskConfig, write_task
from augtree_verl.trainer.augtree_async import COLOCATE_ASYNC_MODE
from tests.e2e.test_cpu_loop import STAGES, STEPS, _env, _run, read_steps

pytestmark = pytest.mark.slow

# The update's metrics: the policy loss and gradient, and our engine's replay counters.
UPDATE = ("actor/pg_loss", "actor/grad_norm", "actor/augtree/logical_tokens", "actor/augtree/executed_tokens",
          "actor/augtree/prefill_s", "actor/augtree/delayed_backward_s")


@pytest.fixture(scope="module")
def colocate_async_steps(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("colocate-async")
    write_task(out / "assets", TaskConfig(train_rows=8, test_rows=2))
    log = out / "metrics.jsonl"
    _run("run_cpu.sh", _env(out / "assets", out, VERL_FILE_LOGGER_PATH=str(log)), out,
         f"trainer.v1.trainer_mode={COLOCATE_ASYNC_MODE}")
    return read_steps(log)


@pytest.mark.timeout(1300)
def test_colocate_async_runs_every_stage_with_plans_from_the_rollout(colocate_async_steps):
    assert len(colocate_async_steps) == STEPS
    for step, metrics in enumerate(colocate_async_steps, 1):
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
def test_colocate_async_trains_step_two_on_the_warmup_batch(colocate_async_steps):
    """The mode is really verl's colocate_async: its warm-up batch, sampled before step 1's update, is trained
    at step 2, one weight version late (verl's off-policy staleness), with its plans kept by uid until then."""
    first, second = colocate_async_steps
    assert first["training/off_policy/trajectory_staleness/max"] == 0
    assert second["training/off_policy/trajectory_staleness/min"] >= 1
