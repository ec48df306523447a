"""Resuming through verl's ``main_ppo``: each async trainer mode's straight run (``conftest``: 2 steps, a
checkpoint after each) is cut after step 1 (its folder copied with ``global_step_1`` only) and run again with
``trainer.resume_mode=auto`` (the sync mode's: ``test_ray_job``, as a job submitted to a Ray cluster). Step 2
of the resumed run must be step 2 of the straight run: same batch, same responses, same update. The planner
service of the resumed run is a new, empty actor (a new Ray cluster): the groups sampled after the restart get
their plans from it, the groups restored from verl's TransferQueue checkpoint (sampled before the cut, not
trained yet) are planned in-process and counted ``missing``; no plan outlives the restart."""

from __future__ import annotations

import pytest

from tests.e2e.test_cpu_loop import PG_LOSS_ATOL

pytestmark = pytest.mark.slow

# The resumed step computes what the straight one did, from the same bytes (weights, optimizer moments, lr
# schedule, dataloader position, sampled tokens), in the same order: any difference is float32 rounding.
RESUME_RTOL = 1e-5
# Losses, gradient, reward and the batch that was trained.
SAME = (
    "actor/loss",
    "actor/grad_norm",
    "actor/entropy",
    "actor/kl_loss",
    "actor/pg_clipfrac",
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "response_length/mean",
    "prompt_length/mean",
    "augtree/balance/groups",
)


def assert_resumed(resumed: dict, straight: dict, *, restored_groups: bool) -> None:
    """``resumed`` (step k+1 of a resumed run) is ``straight`` (the straight run's step k+1); its groups' plans
    came from the new planner service or were made in-process because it never saw them (``restored_groups``:
    some of the step's groups may come from verl's TransferQueue checkpoint; else all were sampled after the
    restart)."""
    assert resumed["training/global_step"] == straight["training/global_step"]
    for key in SAME:
        assert abs(resumed[key] - straight[key]) <= RESUME_RTOL * abs(straight[key]), (key, resumed[key], straight[key])
    # on-policy GRPO's pg_loss is a sum of cancelling terms: rounding noise
    assert abs(resumed["actor/pg_loss"] - straight["actor/pg_loss"]) <= PG_LOSS_ATOL
    groups = resumed["augtree/balance/groups"]
    from_rollout = resumed["augtree/planner/plans_from_rollout"]
    in_process = resumed["augtree/planner/plans_in_process"]
    assert from_rollout + in_process == groups
    assert in_process == resumed["augtree/planner/missing"], "an in-process plan not for a group the service lacked"
    assert resumed["augtree/planner/mismatched"] == resumed["augtree/planner/restarts"] == 0
    if not restored_groups:
        assert from_rollout == groups, "every group was sampled after the restart, so reported to the new service"


@pytest.mark.timeout(1300)
def test_a_resumed_colocate_async_run_makes_the_straight_runs_next_step(colocate_async_run, resumed_colocate_async):
    """With verl's warm-up batch: step 2 trains groups sampled before the cut, restored from the checkpoint."""
    assert_resumed(resumed_colocate_async, colocate_async_run.steps[1], restored_groups=True)


@pytest.mark.timeout(1300)
def test_a_resumed_separate_async_run_makes_the_straight_runs_next_step(separate_async_run, resumed_separate_async):
    assert_resumed(resumed_separate_async, separate_async_run.steps[1], restored_groups=False)
