"""The main_ppo runs the end-to-end tests read, each run once per session in the background (``background``,
started by ``tests/conftest.py``): the straight runs checkpoint after every step, so they also serve as the
oracles of the resumed runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.background import E2E_WIDTH, RUN_OF_FIXTURE, Background, Run, sync_run_of


@pytest.fixture(scope="session", autouse=True)  # before the session fixtures that wait for a run
def _every_core_to_the_runs(e2e_background: Background) -> None:
    """From here on the session's tests only wait for their runs: two launches at once."""
    e2e_background.widen(E2E_WIDTH)


@pytest.fixture(scope="session")
def assets(e2e_background: Background) -> Path:
    return e2e_background.assets


def _run_fixture(fixture: str, run: str):
    @pytest.fixture(scope="session", name=fixture)
    def read(e2e_background: Background):
        return e2e_background.result(run)

    read.__doc__ = f"The result of the session's run {run!r} (``background.RUNS``)."
    return read


# One session fixture per run: ``compared`` is OUT_DIR of ``examples/compare_engines.sh`` (<engine>.jsonl,
# compare.png, wandb/, checkpoints/<engine>/, log.txt), ``*_async_run`` a ``Run``, ``resumed_*`` step 2's metrics
# of a resumed run, ``agent_runs`` OUT_DIR of ``examples/train_agent.sh``, ``dapo_steps`` the DAPO run's steps,
# ``vision_steps`` each vision engine's steps, ``ray_job`` a ``RayJob``.
for _fixture, _run in RUN_OF_FIXTURE.items():
    globals()[f"_{_fixture}"] = _run_fixture(_fixture, _run)


@pytest.fixture(scope="session")
def sync_run(compared: Path) -> Run:
    """The augtree_sync run of the compare script (our engine; the recipes' default trainer mode)."""
    return sync_run_of(compared)
