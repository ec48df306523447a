"""The soak's pieces (``augtree_verl.cpu_loop.soak``) without a full run: per-process RSS of a real process
tree, warnings per step from a log, the flatness and equal-curve checks and their bounds."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from augtree_verl.cpu_loop.soak import (
    MIB,
    RSS_GROWTH_BOUND_MIB,
    WINDOW,
    ProcessSampler,
    checks,
    growth,
    message,
    process_role,
    warnings_per_step,
)

STEPS, WARMUP = 16, 3
# A parent that starts a child holding 64 MiB of written (resident) bytes.
TREE = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; b = bytes(range(256)) * (1 << 18); time.sleep(60)'])\n"
    "time.sleep(60)\n"
)


def test_the_sampler_sees_every_process_of_the_tree_with_its_rss_and_role():
    root = subprocess.Popen([sys.executable, "-c", TREE])
    try:
        sampler = ProcessSampler(root.pid)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sample = sampler.sample()
            if len(sample) == 2 and max(sample.values()) > 64 * MIB:
                break
            time.sleep(0.1)
        series = sampler.series()
        assert len(series) == 2 and f"driver {root.pid}" in series
        (child,) = [name for name in series if not name.startswith("driver")]
        assert child.split()[0].startswith("python") and series[child][-1] > 64 * MIB
    finally:
        for proc in psutil.Process(root.pid).children(recursive=True):
            proc.kill()
        root.kill()
        root.wait()


@pytest.mark.parametrize(
    "cmdline, role",
    [
        (["ray::HFRolloutServer.generate"], "HFRolloutServer"),
        (["ray::WorkerDict"], "WorkerDict"),
        (["ray::IDLE"], "idle"),
        (["ray::hf_server_0:HFRolloutServer.__init__"], "HFRolloutServer"),
        (["/usr/bin/raylet", "--x"], "raylet"),
        ([], "zombie"),
    ],
)
def test_process_roles(cmdline, role):
    assert process_role(cmdline, "zombie") == role


def test_warnings_are_counted_by_the_step_they_were_printed_in():
    log = "\n".join(
        [
            "WARNING start-up",
            "(TaskRunner pid=7) step:1 - actor/pg_loss:0.1",
            "(WorkerDict pid=8) UserWarning: x",
            "(WorkerDict pid=8) UserWarning: x",
            "(TaskRunner pid=7) step:2 - a:1",
            "(TaskRunner pid=7) step:3 - a:1",
            "a warning at exit",
        ]
    )
    found = warnings_per_step(log)
    assert {step: len(lines) for step, lines in found.items()} == {1: 1, 2: 2, 4: 1}
    assert {message(line) for line in found[2]} == {"(WorkerDict pid=N) UserWarning: x"}


def _run(rss_mib_per_step, warnings=0, depth=None, reward=0.5):
    steps = [
        {
            "critic/score/mean": reward,
            "actor/pg_loss": 0.01 * i,
            **({} if depth is None else {"augtree/planner/queue_depth": depth}),
        }
        for i in range(STEPS)
    ]
    rss = [int((500 + rss_mib_per_step * i) * MIB) for i in range(STEPS)]
    flat = [int(500 * MIB)] * STEPS
    processes = {
        "HFRolloutServer 5": rss,
        "helper 6": [None] * (STEPS - 1) + [MIB],
        "driver 1": flat,
        "TaskRunnerV1 2": flat,
        "WorkerDict 3": flat,
        **({} if depth is None else {"PlannerService 4": flat}),
    }
    return {"expected_steps": STEPS, "steps": steps, "rss": processes, "warnings_per_step": [warnings] * STEPS}


def _failed(found):
    return sorted(f"{c['check']} {c['run']}" for c in found if not c["ok"])


def test_flat_runs_with_equal_curves_pass():
    found = checks({"grpo_fsdp2": _run(0.1), "grpo_augtree": _run(0.1, depth=0)}, WARMUP, groups_per_step=2)
    assert _failed(found) == [] and {c["check"] for c in found} == {
        "processes_missing",
        "steps_missing",
        "rss_growth_mib",
        "planner_entries",
        "warnings_growth",
        "curve critic/score/mean",
        "curve actor/pg_loss",
    }


def test_growth_beyond_each_bound_fails_by_name():
    leak = RSS_GROWTH_BOUND_MIB / (STEPS - WARMUP - WINDOW) * 1.5  # MiB per step: the windows' middles differ by
    # STEPS - WARMUP - WINDOW steps
    grows = _run(leak, depth=7)
    grows["warnings_per_step"] = list(range(STEPS))
    del grows["rss"]["PlannerService 4"]
    grows["expected_steps"] = STEPS + 1
    found = checks({"dapo_augtree": grows, "dapo_fsdp2": _run(0, reward=0.25)}, WARMUP, groups_per_step=2)
    assert _failed(found) == [
        "curve critic/score/mean dapo",
        "planner_entries dapo_augtree",
        "processes_missing dapo_augtree ['PlannerService']",
        "rss_growth_mib dapo_augtree HFRolloutServer 5",
        "steps_missing dapo_augtree",
        "warnings_growth dapo_augtree",
    ]


def test_growth_needs_enough_steps():
    assert growth([1, 1, 1, 2, 3, 4, 5, 6, 7], warmup=1, window=2) == 6.5 - 1
    with pytest.raises(ValueError, match="5 steps are too few for warmup=2 and two windows of 2"):
        growth([1] * 5, warmup=2, window=2)
