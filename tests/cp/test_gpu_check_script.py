"""The GPU check script: flash-attn is imported lazily, the script runs end to end on CPU (--cpu-smoke),
and without CUDA it refuses with a message instead of passing silently."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check_cp.py"


def test_cp_package_does_not_import_flash_attn():
    code = ("import sys, augtree_verl.cp.engine, augtree_verl.ops.attention; "
            "assert 'flash_attn' not in sys.modules, 'flash_attn imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.timeout(300)
def test_cpu_smoke_runs_the_same_code():
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke"], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "replay_cp on one rank" in done.stdout and done.stdout.strip().endswith("op checks over tolerance)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="only meaningful without CUDA")
def test_refuses_without_cuda():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "no CUDA device" in done.stderr
