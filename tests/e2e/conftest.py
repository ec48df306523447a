"""The main_ppo runs the end-to-end tests read, each run once per session in the background (``background``,
started by ``tests/conftest.py``): the straight runs checkpoint after every step, so they also serve as the
oracles of the resumed runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.background import E2E_WIDTH, Background, Run
from tests.e2e.runs import LR, SAVE_EVERY_STEP, read_steps


@pytest.fixture(scope="session", autouse=True)  # before the session fixtures that wait for a run
def _every_core_to_the_runs(e2e_background: Background) -> None:
    """From here on the session's tests only wait for their runs: two launches at once."""
    e2e_background.widen(E2E_WIDTH)


@pytest.fixture(scope="session")
def assets(e2e_background: Background) -> Path:
    return e2e_background.assets


@pytest.fixture(scope="session")
def compared(e2e_background: Background) -> Path:
    """OUT_DIR of ``examples/compare_engines.sh``: <engine>.jsonl, compare.png, wandb/, checkpoints/<engine>/,
    and log.txt (the script's output)."""
    return e2e_background.result("compared")


@pytest.fixture(scope="session")
def sync_run(compared: Path) -> Run:
    """The augtree_sync run of the compare script (our engine; the recipes' default trainer mode)."""
    return Run(
        compared, (f"actor_rollout_ref.actor.optim.lr={LR}", *SAVE_EVERY_STEP), read_steps(compared / "augtree.jsonl")
    )


@pytest.fixture(scope="session")
def colocate_async_run(e2e_background: Background) -> Run:
    return e2e_background.result("colocate_async")


@pytest.fixture(scope="session")
def separate_async_run(e2e_background: Background) -> Run:
    return e2e_background.result("separate_async")


@pytest.fixture(scope="session")
def resumed_colocate_async(e2e_background: Background) -> dict:
    return e2e_background.result("resumed_colocate_async")


@pytest.fixture(scope="session")
def resumed_separate_async(e2e_background: Background) -> dict:
    return e2e_background.result("resumed_separate_async")


@pytest.fixture(scope="session")
def agent_runs(e2e_background: Background) -> Path:
    return e2e_background.result("agent")


@pytest.fixture(scope="session")
def dapo_steps(e2e_background: Background) -> list[dict]:
    return e2e_background.result("dapo")
