"""``augtree_verl.testing`` imports without side effects; ``use_cpu_platform`` selects verl's CPU platform, and
refuses once verl has fixed another device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import augtree_verl

pytestmark = pytest.mark.slow  # subprocesses that import verl

REPO = Path(augtree_verl.__file__).parents[1]
PLATFORM_ENV = ("VERL_PLATFORM", "TORCHINDUCTOR_CACHE_DIR")

# Third-party imports first: tensordict sets TORCHINDUCTOR_CACHE_DIR itself when imported.
IMPORT_THEN_SELECT = """
import json, os, sys
import tensordict, torch.distributed as dist, transformers
before = dict(os.environ)
from augtree_verl.testing import harness, verl_batch
after_import = {"verl": "verl" in sys.modules, "env_changed": dict(os.environ) != before,
                "process_group": dist.is_initialized()}
harness.use_cpu_platform()
from verl.utils.device import get_device_name
print(json.dumps({"after_import": after_import, "device": get_device_name(), "platform": os.environ["VERL_PLATFORM"]}))
"""

TOO_LATE = """
import verl
from verl.utils.device import get_device_name
get_device_name()  # fixes verl's device (cuda: no VERL_PLATFORM)
from augtree_verl.testing import harness
harness.use_cpu_platform()
"""


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in PLATFORM_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_import_has_no_side_effects_and_use_cpu_platform_selects_cpu():
    done = _run(IMPORT_THEN_SELECT)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["after_import"] == {"verl": False, "env_changed": False, "process_group": False}
    assert found["device"] == "cpu" and found["platform"] == "cpu"


@pytest.mark.timeout(300)
def test_use_cpu_platform_refuses_after_verl_fixed_another_device():
    done = _run(TOO_LATE)
    assert done.returncode != 0
    assert "RuntimeError: verl resolved its device to 'cuda' before use_cpu_platform()" in done.stderr, done.stderr[
        -3000:
    ]


def _sleepy_rank(rank: int, pid_dir: str, fail: bool) -> None:
    """Rank 0 raises (``fail``) or hangs; rank 1 hangs, as ranks stuck in mismatched collectives would."""
    import time

    (Path(pid_dir) / f"rank{rank}").write_text(str(os.getpid()))
    if rank == 0 and fail:
        # once rank 1 is up (it is forked after rank 0 and could be killed before it wrote its pid)
        deadline = time.monotonic() + 30
        while not (Path(pid_dir) / "rank1").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise ValueError("rank 0 failed")
    time.sleep(600)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fail", [False, True])
def test_spawn_kills_every_rank_after_a_hang_or_an_error(tmp_path, fail):
    import torch.multiprocessing as mp

    from augtree_verl.testing import harness

    with pytest.raises(
        mp.ProcessRaisedException if fail else TimeoutError, match="rank 0 failed" if fail else "still running after"
    ):
        harness.spawn(_sleepy_rank, (str(tmp_path), fail), nprocs=2, timeout_s=60 if fail else 5)
    for rank in range(2):
        pid = int((tmp_path / f"rank{rank}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
