"""benchmarks/planner_overlap.py runs end to end (small sizes) and writes the JSON the issue asks for."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_overlap_benchmark_writes_its_json(tmp_path):
    out = tmp_path / "overlap.json"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks/planner_overlap.py"),
            "--groups",
            "24",
            "--rollout-s",
            "0.3",
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=580,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["groups"] == 24 and result["plans_from_rollout_min"] == 24
    assert result["ready_after_last_finish_ms"] >= 0 and result["at_balance_ms"] > 0
    assert "every plan ready" in run.stdout
