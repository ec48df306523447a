"""The main_ppo runs the end-to-end tests share (one run each per session, whichever test asks first): each is
a straight run with a checkpoint after every step, so it also serves as the oracle of a resumed run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from augtree_verl.cpu_loop.task import TaskConfig, write_task
from augtree_verl.trainer.augtree_async import COLOCATE_ASYNC_MODE, SEPARATE_ASYNC_MODE
from tests.e2e.runs import LR, SAVE_EVERY_STEP, read_steps, run_env, run_script


@dataclass(frozen=True)
class Run:
    """A finished run: its folder (the working directory, with ``checkpoints/``), its overrides, its steps."""

    dir: Path
    overrides: tuple[str, ...]
    steps: list[dict]


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cpu-loop")
    write_task(out, TaskConfig(train_rows=8, test_rows=2))
    return out


@pytest.fixture(scope="session")
def compared(assets, tmp_path_factory) -> Path:
    """OUT_DIR of ``examples/compare_engines.sh``: <engine>.jsonl, compare.png, wandb/, checkpoints/<engine>/,
    and log.txt (the script's output)."""
    out = tmp_path_factory.mktemp("compare")
    log = run_script(
        "compare_engines.sh",
        run_env(assets, out, OUT_DIR=str(out), WANDB_DIR=str(out), PROMPTS="short"),  # the test's own task
        out,
        f"actor_rollout_ref.actor.optim.lr={LR}",
        *SAVE_EVERY_STEP,
    )
    (out / "log.txt").write_text(log)
    return out


@pytest.fixture(scope="session")
def sync_run(compared) -> Run:
    """The augtree_sync run of the compare script (our engine; the recipes' default trainer mode)."""
    return Run(
        compared, (f"actor_rollout_ref.actor.optim.lr={LR}", *SAVE_EVERY_STEP), read_steps(compared / "augtree.jsonl")
    )


def _mode_run(assets: Path, out: Path, mode: str, *extra: str) -> Run:
    overrides = (f"trainer.v1.trainer_mode={mode}", f"actor_rollout_ref.actor.optim.lr={LR}", *SAVE_EVERY_STEP, *extra)
    log = out / "metrics.jsonl"
    run_script("run_cpu.sh", run_env(assets, out, VERL_FILE_LOGGER_PATH=str(log)), out, *overrides)
    return Run(out, overrides, read_steps(log))


@pytest.fixture(scope="session")
def colocate_async_run(assets, tmp_path_factory) -> Run:
    return _mode_run(assets, tmp_path_factory.mktemp("colocate-async"), COLOCATE_ASYNC_MODE)


@pytest.fixture(scope="session")
def separate_async_run(assets, tmp_path_factory) -> Run:
    """Without verl's warm-up batch: each step's batch is sampled after the previous step's weights were pushed
    to the rollout pool, so step 1 trains the dataloader's first batch (as the sync trainer does: comparable
    with the stock engine) and step 2's rollout shows the pushed weights. (With a warm-up batch, step 1 takes
    whichever of the two batches' groups verl's replay buffer lists first: uids sorted by step, ties in set
    order.) colocate_async_run keeps the warm-up batch."""
    return _mode_run(
        assets,
        tmp_path_factory.mktemp("separate-async"),
        SEPARATE_ASYNC_MODE,
        "trainer.v1.separate_async.num_warmup_batches=0",
    )
