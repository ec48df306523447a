"""The engine's GPU check script runs end to end on CPU (--cpu-smoke: the same code paths, a tiny model) and
passes its own checks, so it is ready the day a GPU is lent."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check_engine.py"


@pytest.mark.timeout(300)
def test_cpu_smoke_passes():
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke"], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The JSON report on stdout, the verdict as the last line on stderr.
    assert json.loads(done.stdout[done.stdout.index("{\n"):])["pass"] is True, done.stdout[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("gpu_check_engine: PASS"), done.stderr[-2000:]
