import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from augtree_verl.planner.startup import CACHE_ENV
from augtree_verl.testing import harness

# One intra-op thread per process, here and in every process the tests start: the suite's models are tiny (threads
# add only overhead), and beside a background launch on the other core OpenMP's spinning threads made an in-process
# test several times slower (tests/integration/test_engine_losses.py: 0.3 s a setting alone, 2.6 s in the suite).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# verl resolves its device once per process, when something first imports verl.workers.engine; the suite runs
# verl's engines and trainers on our CPU platform, so it is selected before any test module is collected.
harness.use_cpu_platform()


def pytest_terminal_summary(terminalreporter, config):
    """Name the random order of this run (pytest-random-order's header is hidden by -q), so it can be repeated."""
    opt = config.option
    bucket, seed = str(getattr(opt, "random_order_bucket", "")), str(getattr(opt, "random_order_seed", ""))
    given = lambda value: value and not value.startswith("default:")  # the plugin marks values not given so
    if getattr(opt, "random_order", False) or given(bucket) or given(seed):
        terminalreporter.write_line(
            f"test order: --random-order-bucket={bucket.removeprefix('default:')} "
            f"--random-order-seed={seed.removeprefix('default:')}"
        )


@pytest.fixture(scope="session", autouse=True)
def planner_profile_cache(tmp_path_factory):
    """Training engines calibrate the planner's profile once per model shape and world in a session, into a
    directory of the session (not the user's cache); processes the tests start inherit it."""
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("planner-profiles"))
    yield
    if before is None:
        del os.environ[CACHE_ENV]
    else:
        os.environ[CACHE_ENV] = before


E2E = Path(__file__).parent / "e2e"


@pytest.hookimpl(trylast=True)  # after pytest-random-order's shuffle
def pytest_collection_modifyitems(items):
    """The end-to-end tests last (in their shuffled order): their runs start with the session, in the background
    (``e2e_background``), while the other tests run."""
    items[:] = [item for item in items if E2E not in item.path.parents] + [
        item for item in items if E2E in item.path.parents
    ]


@pytest.fixture(scope="session", autouse=True)
def e2e_background(request, planner_profile_cache, tmp_path_factory):
    """The end-to-end runs the selected tests read (``tests/e2e/background.py``), started now; ended with the
    session."""
    from tests.e2e.background import RUN_OF_FIXTURE, Background

    background = Background(tmp_path_factory)
    background.start(
        {run for item in request.session.items for name, run in RUN_OF_FIXTURE.items() if name in item.fixturenames}
    )
    yield background
    background.stop()


@pytest.fixture(scope="module")
def single_process_group():
    """A gloo process group of this one process (world size 1) for a module's tests, destroyed after them."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised here: an earlier test module leaked it")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{harness.free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module", autouse=True)
def nothing_left_running(request):
    """Every test module tears down the process groups and the Ray instance it starts (tests run in any order)."""
    yield
    leaks = []
    if dist.is_initialized():
        leaks.append("a torch.distributed process group")
        dist.destroy_process_group()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        leaks.append("Ray")
        ray.shutdown()
    if leaks:
        pytest.fail(f"{request.module.__name__} left {' and '.join(leaks)} running")


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """wandb in offline mode writing under ``tmp_path/wandb``.

    wandb keeps process-wide settings (its run directory among them) from its first setup; tearing it
    down before and after lets each test's WANDB_DIR take effect, whatever ran before.
    """
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()
    yield tmp_path / "wandb"
    wandb.teardown()
