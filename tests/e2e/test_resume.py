"""Resuming through verl's ``main_ppo``: each trainer mode's straight run (``conftest``: 2 steps, a checkpoint
after each) is cut after step 1 (its folder copied with ``global_step_1`` only) and run again with
``trainer.resume_mode=auto``. Step 2 of the resumed run must be step 2 of the straight run: same batch, same
responses, same update. The planner service of the resumed run is a new, empty actor (a new Ray cluster): the
groups sampled after the restart get their plans from it, the groups restored from verl's TransferQueue
checkpoint (async modes: sampled before the cut, not trained yet) are planned in-process and counted
``missing``; no plan outlives the restart."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import Run
from tests.e2e.runs import read_steps, run_env, run_script, stopped_after
from tests.e2e.test_cpu_loop import PG_LOSS_ATOL

pytestmark = pytest.mark.slow

# The resumed step computes what the straight one did, from the same bytes (weights, optimizer moments, lr
# schedule, dataloader position, sampled tokens), in the same order: any difference is float32 rounding.
RESUME_RTOL = 1e-5
# Losses, gradient, reward and the batch that was trained.
SAME = ("actor/loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac",
        "critic/score/mean", "critic/score/max", "critic/score/min", "response_length/mean", "prompt_length/mean",
        "augtree/balance/groups")
MODES = ["sync_run", "colocate_async_run", "separate_async_run"]


def resumed_step_two(straight: Run, assets, out) -> dict:
    stopped_after(straight.dir, 1, out)
    log = out / "metrics.jsonl"
    run_script("run_cpu.sh", run_env(assets, out, VERL_FILE_LOGGER_PATH=str(log)), out, *straight.overrides,
               "trainer.resume_mode=auto")
    (step,) = read_steps(log)
    return step


@pytest.mark.timeout(1300)
@pytest.mark.parametrize("mode", MODES)
def test_a_resumed_run_makes_the_straight_runs_next_step(request, mode, assets, tmp_path):
    straight = request.getfixturevalue(mode)
    resumed, expected = resumed_step_two(straight, assets, tmp_path), straight.steps[1]
    assert resumed["training/global_step"] == 2
    for key in SAME:
        assert abs(resumed[key] - expected[key]) <= RESUME_RTOL * abs(expected[key]), (key, resumed[key],
                                                                                      expected[key])
    # step 2's pg_loss is on-policy GRPO's in the sync mode: cancelling terms, rounding noise
    assert abs(resumed["actor/pg_loss"] - expected["actor/pg_loss"]) <= PG_LOSS_ATOL
    # every group has a plan, from the new service or made here; those made here are the ones it never saw
    groups = resumed["augtree/balance/groups"]
    from_rollout = resumed["augtree/planner/plans_from_rollout"]
    in_process = resumed["augtree/planner/plans_in_process"]
    assert from_rollout + in_process == groups
    assert in_process == resumed["augtree/planner/missing"]
    assert resumed["augtree/planner/mismatched"] == resumed["augtree/planner/restarts"] == 0
    if mode == "sync_run":
        assert from_rollout == groups, "the sync trainer samples step 2's groups after the restart"
