"""The full RL loop on images, on CPU: ``examples/run_cpu.sh`` with ``TASK=vision`` (verl's main_ppo, GRPO, the
``hf`` rollout generating with a tiny Qwen2.5-VL from each prompt's image, the shape task's exact-answer reward)
for 2 steps on verl's stock fsdp2 engine and on ours (``background.VISION_ENGINES``): the same step-1 update."""

from __future__ import annotations

import pytest

from tests.e2e.runs import STAGES, STEPS
from tests.e2e.test_cpu_loop import ROLLOUT_PROB_ATOL, assert_same_step_one


@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_grpo_trains_on_images_on_verls_stock_engine(vision_steps):
    steps = vision_steps["fsdp2"]
    assert len(steps) == STEPS
    for step, metrics in enumerate(steps, 1):
        missing = [s for s in STAGES if f"timing_s/{s}" not in metrics]
        assert not missing, f"step {step}: stages {missing} did not run"
        assert metrics["response_length/mean"] > 0 and metrics["prompt_length/mean"] > 16  # 16 image tokens
        diff = metrics["training/rollout_probs_diff_max"]
        assert diff <= ROLLOUT_PROB_ATOL, f"step {step}: rollout probabilities off by {diff:.1e}"
    # the untrained model answers in the task's words: some group's samples score differently, a GRPO gradient
    assert any(m["critic/score/max"] > m["critic/score/min"] and m["actor/grad_norm"] > 0 for m in steps)


@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_step_one_update_on_images_is_the_same_with_both_engines(vision_steps):
    assert_same_step_one(vision_steps["augtree"][0], vision_steps["fsdp2"][0])
