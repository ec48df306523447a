"""The full RL loop on CPU: ``examples/compare_engines.sh`` runs ``examples/run_cpu.sh`` (verl's main_ppo, our
GRPO recipe, rollout ``hf``, two worker processes, Ray) for 2 steps with each engine (``conftest.compared``, a
checkpoint after each step, which ``test_ray_job`` resumes); the steps are read back from verl's file logger,
the runs from wandb's offline files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from augtree_verl.planner import ClusterProfile
from augtree_verl.planner.startup import CACHE_ENV
from tests.e2e.runs import STAGES, STEPS, read_steps

# Step 1 runs the same sampled responses through both engines from the same weights, so the update is the
# same up to float32 rounding (the parity tests bound that at 1e-5 relative).
RTOL = 1e-5
# Step 1's GRPO pg_loss is a sum of terms that cancel (importance ratios are 1, a group's advantages sum to
# 0): its value is rounding noise, so only an absolute bound says anything.
PG_LOSS_ATOL = 1e-6
# verl compares the rollout's log-probs with the trainer's recomputed ones (training/rollout_probs_diff_max:
# max |p_rollout - p_trainer| over tokens). Same weights, float32, another kernel: rounding only.
ROLLOUT_PROB_ATOL = 1e-5
# Metrics our engine and trainer mode add (timing_s/balance: the trainer mode's group-aware balance).
OURS = (
    "timing_s/balance",
    "actor/augtree/prefill_s",
    "actor/augtree/delayed_backward_s",
    "actor/augtree/logical_tokens",
    "actor/augtree/executed_tokens",
    "actor/augtree/predicted_replay_s",
    "augtree/planner/plans",
    "augtree/planner/plans_from_rollout",
    "augtree/planner/plans_in_process",
    "augtree/planner/plan_wait_s",
    "augtree/balance/groups",
)
# The step-1 metrics two runs on the same batch from the same weights must share (means may be summed in
# another row order).
STEP_ONE = ("critic/score/mean", "response_length/mean", "prompt_length/mean", "actor/grad_norm", "actor/entropy")


def assert_same_step_one(ours: dict, stock: dict) -> None:
    """``ours`` and ``stock`` (a step's metrics) trained the same batch from the same weights to the same update."""
    for key in STEP_ONE:
        assert abs(ours[key] - stock[key]) <= RTOL * abs(stock[key]), (key, ours[key], stock[key])
    assert abs(ours["actor/pg_loss"] - stock["actor/pg_loss"]) <= PG_LOSS_ATOL


@pytest.fixture(scope="module")
def steps(compared: Path) -> dict[str, list[dict]]:
    return {strategy: read_steps(compared / f"{strategy}.jsonl") for strategy in ("augtree", "fsdp2")}


@pytest.mark.slow
@pytest.mark.timeout(1300)
@pytest.mark.parametrize("strategy", ["augtree", "fsdp2"])
def test_every_stage_runs_for_each_step(steps, strategy):
    assert len(steps[strategy]) == STEPS
    for step, metrics in enumerate(steps[strategy], 1):
        missing = [s for s in STAGES if f"timing_s/{s}" not in metrics]
        assert not missing, f"{strategy} step {step}: stages {missing} did not run"
        assert metrics["training/global_step"] == step
        # the rollout really sampled (and the reward varies, so GRPO has a gradient)
        assert metrics["response_length/mean"] > 0 and metrics["critic/score/max"] > metrics["critic/score/min"]
        assert metrics["actor/grad_norm"] > 0
        # the rollout sampled with the trainer's current weights: synced after step 1's update
        diff = metrics["training/rollout_probs_diff_max"]
        assert diff <= ROLLOUT_PROB_ATOL, f"{strategy} step {step}: rollout probabilities off by {diff:.1e}"


@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_step_one_update_is_the_same_with_both_engines(steps):
    # same seed, same weights: the same responses and rewards
    assert_same_step_one(steps["augtree"][0], steps["fsdp2"][0])


@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_our_metrics_are_logged_only_with_our_engine(steps):
    for metrics in steps["augtree"]:
        assert not [key for key in OURS if key not in metrics]
        assert metrics["actor/augtree/executed_tokens"] < metrics["actor/augtree/logical_tokens"]
    assert not [key for key in steps["fsdp2"][0] if "augtree" in key]


@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_the_planner_plans_with_the_runs_own_profile(compared, steps, assets):
    """The trainer prints the profile the actor's workers made at start-up (the tiny model's shape, hardware
    measured on the two workers: calibrated now, or this session's cache); the planner service plans with it
    (the client refuses a service with another profile, and the rollout's plans were taken)."""
    (line,) = [line for line in (compared / "log.txt").read_text().splitlines() if "augtree: planner profile" in line]
    config = json.loads((assets / "model" / "config.json").read_text())
    shape = (
        f"model {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, heads "
        f"{config['num_attention_heads']}/{config['num_key_value_heads']}x"
    )
    assert shape in line and "model 28 layers" not in line, line
    assert "planner profile from calibrated now" in line or "planner profile from cache file" in line, line
    assert ", world 2," in line or "-w2-" in line, line
    # the session's cache also holds the other e2e runs' models (the vision task's): this run's is the one of its shape
    cached = [ClusterProfile.load(path) for path in Path(os.environ[CACHE_ENV]).glob("profile-cpu-*-w2-*.json")]
    dims = (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"], config["vocab_size"])
    (profile,) = [p for p in cached if (p.num_layers, p.hidden_size, p.num_kv_heads, p.vocab_size) == dims]
    assert f"dense {profile.flops_per_s:.3g} FLOP/s" in line
    assert sum(metrics["augtree/planner/plans_from_rollout"] for metrics in steps["augtree"]) > 0


def _wandb_group(run_dir: Path) -> str | None:
    """The run group recorded in an offline run: the RunRecord's ``run_group`` string field (protobuf field 6)."""
    data = next(run_dir.glob("*.wandb")).read_bytes()
    for group in ("augtree", "fsdp2"):
        if bytes([6 << 3 | 2, len(group)]) + group.encode() in data:
            return group
    return None


@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_compare_engines_writes_the_picture_and_one_wandb_run_per_engine(compared):
    assert (compared / "compare.png").stat().st_size > 10_000
    runs = sorted((compared / "wandb").glob("offline-run-*"))
    assert sorted(_wandb_group(run) for run in runs) == ["augtree", "fsdp2"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dapo_recipe_runs_a_step_on_our_engine(dapo_steps):
    """DAPO: no reference model, dynamic sampling (filter_groups), the dapo reward manager's overlong shaping."""
    (metrics,) = dapo_steps
    assert "timing_s/ref" not in metrics and "timing_s/update_actor" in metrics
    assert metrics["actor/grad_norm"] > 0 and "actor/augtree/logical_tokens" in metrics
