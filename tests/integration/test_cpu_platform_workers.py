"""What verl's workers need from the CPU platform: a valid gloo backend string, reference engines that run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from augtree_verl.testing import harness as H
from tests.parity import RTOL, rel_err

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

REPO = Path(__file__).resolve().parents[2]

# A fresh process: verl's platform and the default process group are per process.
WORKER_INIT = textwrap.dedent("""
    import verl, augtree_verl.integration
    import torch.distributed as dist
    # The name as verl's TrainingWorker binds it (engine_workers.py: initialize_global_process_group_ray()).
    from verl.workers.engine_workers import initialize_global_process_group_ray
    initialize_global_process_group_ray(timeout_second=None)
    print("backend", dist.get_backend())
    dist.destroy_process_group()
""")


@pytest.mark.timeout(180)
def test_worker_process_group_is_plain_gloo():
    env = dict(
        os.environ,
        VERL_PLATFORM="cpu",
        RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(H.free_port()),
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    run = subprocess.run([sys.executable, "-c", WORKER_INIT], env=env, capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "backend gloo" in run.stdout


@pytest.mark.parametrize("strategy", ["fsdp2", "augtree"])
def test_reference_engine_runs_on_cpu(tmp_path, strategy, single_process_group):
    """verl builds a forward-only engine with CPUOffloadPolicy(pin_memory=True); on CPU it must not pin."""
    model_path = H.save_tiny_qwen2(str(tmp_path / "tiny-qwen2"))
    rows = H.group_rows([(5, [3, 4]), (2, [6, 1])])
    batch = H.rows_to_batch(rows)
    logps = {}
    for forward_only in (False, True):
        engine, _ = H.build_engine(strategy, model_path, forward_only=forward_only)
        with engine.eval_mode():
            logps[forward_only] = H.response_logps(engine.infer_batch(batch.clone(), loss_function=None), batch)
    for row, (ref, actor) in enumerate(zip(logps[True], logps[False])):
        assert rel_err(ref, actor) <= RTOL, f"row {row}"
