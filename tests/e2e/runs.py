"""Running ``examples/*.sh`` (verl's main_ppo on CPU) from the end-to-end tests, and resuming their checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
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


def run_script(script: str, env: dict, cwd: Path, *overrides: str) -> str:
    """The script's output (stdout and stderr) once it exited 0."""
    run = subprocess.run(
        ["bash", str(REPO / "examples" / script), *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=1100,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return run.stdout + run.stderr


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
