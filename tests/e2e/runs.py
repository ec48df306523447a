"""The end-to-end runs' settings and files: the scripts' environment, verl's file logger, checkpoints cut for a resume
(the runs themselves: ``background``)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
# Every stage of a step, as verl's marked_timer names them (timing_s/*).
STAGES = ("gen", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "step")
# A learning rate at which one update moves the policy visibly, so step 2 shows whether the rollout got the
# updated weights, and whether a resumed run loaded the trained ones (the recipe's 1e-6 barely moves a random
# tiny model).
LR = 1e-3
# Checkpoint after every step, under the engine's name (the compare script runs both engines in one folder).
SAVE_EVERY_STEP = ("trainer.save_freq=1", "trainer.default_local_dir=checkpoints/${actor_rollout_ref.actor.strategy}")

# ``examples/train_agent.sh``'s sizes for test_agent_loop: 2 prompts x 4 samples (one tree of 4 leaves per prompt,
# 2 continuations after turns 1 and 2 of 3) of 32-token turns behind one 256-word system prompt.
AGENT_SIZES = dict(BATCH=2, N=4, TURNS=3, TURN_TOKENS=32, SYSTEM_WORDS=256)


def run_env(assets: Path, log_dir: Path, **overrides) -> dict:
    """The scripts' environment: our checkout first on the path, a local Ray, wandb offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "WANDB_API_KEY")}
    env.update(
        ASSETS_DIR=str(assets),
        STEPS=str(STEPS),
        PYTHON=sys.executable,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        TORCHINDUCTOR_CACHE_DIR=str(log_dir / "inductor"),
        WANDB_MODE="offline",
        WANDB_SILENT="true",
    )
    env.update(overrides)
    return env


def read_steps(log: Path) -> list[dict]:
    return [json.loads(line)["data"] for line in log.read_text().splitlines()]


def stopped_after(run_dir: Path, step: int, into: Path) -> None:
    """``into`` as ``run_dir`` would be had the run stopped after ``step``: its checkpoint folders (the folders
    holding verl's ``latest_checkpointed_iteration.txt``) with ``global_step_<step>`` only, named the latest."""
    trackers = sorted(run_dir.glob("checkpoints/**/latest_checkpointed_iteration.txt"))
    assert trackers, f"{run_dir} holds no checkpoint"
    for tracker in trackers:
        folder = into / tracker.parent.relative_to(run_dir)
        shutil.copytree(tracker.parent / f"global_step_{step}", folder / f"global_step_{step}")
        (folder / tracker.name).write_text(str(step))
