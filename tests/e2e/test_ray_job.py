"""``examples/submit_cpu_job.sh`` against a Ray head started here (127.0.0.1): a CPU job that resumes a run
submitted, waited for, its logs read; the head is stopped at the end (only the processes this test started)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from augtree_verl.testing.harness import free_port
from tests.e2e.background import LAUNCH_TIMEOUT_S
from tests.e2e.runs import STEPS, stopped_after
from tests.e2e.test_resume import assert_resumed

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HEAD_START_S = 120


@pytest.fixture
def head(tmp_path):
    """``ray start --head --block`` with its own temp dir (so no other ray.init() here joins it) and ports."""
    temp_dir = tempfile.mkdtemp(prefix="rayhead-", dir="/tmp")  # short: Ray's socket paths have a length limit
    dashboard = free_port()
    args = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={free_port()}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        f"--temp-dir={temp_dir}",
        "--num-cpus=16",
        "--num-gpus=2",
        "--disable-usage-stats",
    ]
    # Ray 2.60 turns token authentication on for `ray start` when ~/.ray/auth_token exists but leaves its CLI
    # clients off unless RAY_AUTH_MODE says so: set the mode explicitly (off: a head on 127.0.0.1 for a test).
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        args, env=env, stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.time() + HEAD_START_S
        while (
            subprocess.run(
                [str(BIN / "ray"), "job", "list", "--address", address], env=env, capture_output=True, timeout=60
            ).returncode
            != 0
        ):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "head.log").read_text()[-3000:]
            time.sleep(2)
        yield address, env
    finally:
        # --block: on SIGINT the command stops the Ray processes it started, and only those.
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_a_submitted_cpu_job_resumes_the_sync_run(head, sync_run, assets, tmp_path, e2e_background):
    """The job resumes the compare script's augtree_sync run (``conftest``) from its step-1 checkpoint and runs
    step 2, which must be that run's step 2 (``test_resume``'s check: a resumed run on another Ray cluster)."""
    address, env = head
    stopped_after(sync_run.dir, 1, tmp_path)
    checkpoints = next(tmp_path.glob("checkpoints/augtree"))
    log = tmp_path / "metrics.jsonl"
    env = dict(
        env,
        RAY_ADDRESS=address,
        STEPS=str(STEPS),
        ASSETS_DIR=str(assets),
        VERL_FILE_LOGGER_PATH=str(log),
        PYTHON=sys.executable,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    # the job runs in Ray's copy of the repository: the checkpoint folder by its absolute path
    with e2e_background.slot():  # a launch beside the session's others
        run = subprocess.run(
            [
                "bash",
                str(REPO / "examples/submit_cpu_job.sh"),
                *sync_run.overrides,
                f"trainer.default_local_dir={checkpoints}",
                "trainer.resume_mode=auto",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=LAUNCH_TIMEOUT_S,
        )
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"exit status {run.returncode}:\n{output[-6000:]}"
    assert "succeeded" in output.lower()
    # the job's logs, read back from the cluster
    job_id = next(line.split("'")[1] for line in output.splitlines() if "submitted successfully" in line)
    logs = subprocess.run(
        [str(BIN / "ray"), "job", "logs", job_id, "--address", address],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert f"step:{STEPS} - " in logs and "actor/augtree/logical_tokens" in logs
    (metrics,) = [json.loads(line)["data"] for line in log.read_text().splitlines()]
    assert_resumed(metrics, sync_run.steps[1], restored_groups=False)
