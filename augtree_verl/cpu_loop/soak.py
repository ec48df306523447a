"""The pieces of the soak (``benchmarks/soak.py``): per-step process memory, warnings per step, flatness and
equal curves.

- ``ProcessSampler``: the RSS of every process under a root (the driver, and Ray's raylet with every worker
  process it starts: trainer workers, rollout server, planner actor, ...), each named by its role (a Ray
  worker's actor class from its process title ``ray::Class.method``, else the executable).
- ``warnings_per_step``: the warnings a run's log shows between verl's step lines.
- ``growth``: how much a per-step series grew after the warm-up (median of the last ``window`` samples minus
  the median of the first ``window`` after warm-up), the check that nothing grows step by step.
- ``curve_differences``: the largest difference between two runs' per-step metrics.
- ``checks``: every check of the soak on finished runs, against the bounds below.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

import psutil

MIB = 1 << 20
# Allocator noise: glibc's arenas and torch's CPU allocator keep freed blocks, so a process's RSS moves between
# steps doing the same work, in plateaus of several steps: verl's stock fsdp2 workers by up to 40 MiB (measured
# 702-778 MiB over 30 steps, no trend), every other process by 1-2 MiB. The median of WINDOW steps smooths
# that to within 9 MiB (measured); a leak of 0.8 MiB per step, over the 21 steps between the windows' middles
# of a 30-step soak with a 5-step warm-up, exceeds the bound.
RSS_GROWTH_BOUND_MIB = 16.0
WINDOW = 5
# The planner holds a group from its report until the balance takes it; DAPO's dropped groups stay until the
# TTL. After the step's balance it may hold the groups of the batches sampled ahead (DAPO: up to
# max_inflight_gen_batches), never more than this many steps' groups.
PLANNER_ENTRIES_BOUND_STEPS = 3
# Both engines sample the same responses (seeded rollout, updates equal within fp32 rounding), so the reward
# is the same; the policy loss is a sum of cancelling terms, equal within fp32 rounding of its terms.
REWARD_TOL = 1e-6
LOSS_TOL = 1e-5
CURVES = {"critic/score/mean": REWARD_TOL, "actor/pg_loss": LOSS_TOL}
# verl's console logger prints one line per step: "step:12 - actor/pg_loss:... - ...".
STEP_LINE = re.compile(r"(?:^|\s)step:(\d+) - ")
WARNING_LINE = re.compile(r"warn(?:ing)?\b", re.IGNORECASE)
# What varies between repeats of one message: colours, pids, times.
VARYING = [
    (re.compile(r"\x1b\[[0-9;]*m"), ""),
    (re.compile(r"pid=\d+"), "pid=N"),
    (re.compile(r"\d{4}-\d\d-\d\d[ T][\d:,.]+"), "TIME"),
]
# The processes every run has: verl's driver and task runner, the trainer workers, the rollout server; the
# planner actor with the augtree engine.
REQUIRED_ROLES = ("driver", "TaskRunnerV1", "WorkerDict", "HFRolloutServer")
PLANNER_ROLE = "PlannerService"


def process_role(cmdline: Sequence[str], name: str) -> str:
    """A process's role: a Ray worker's actor class (process title ``ray::Class``, ``ray::Class.method`` or,
    for a named actor, ``ray::name:Class.method``),
    ``idle`` for a Ray worker without an actor, else the executable's name."""
    title = " ".join(cmdline)
    if title.startswith("ray::"):  # ray::[actor name:]Class[.method]
        role = title[len("ray::") :].split()[0].split(".")[0].split(":")[-1]
        return "idle" if role == "IDLE" else role
    return Path(cmdline[0]).name if cmdline else name


class ProcessSampler:
    """RSS per process of the tree under ``root_pid`` (the root itself is ``driver``), sampled on demand.

    ``sample()`` appends one sample per call: ``{pid: rss_bytes}`` for the processes alive then; ``roles``
    keeps each pid's latest non-idle role (a Ray worker's title follows the method it runs).
    """

    def __init__(self, root_pid: int):
        self.root = psutil.Process(root_pid)
        self.roles: dict[int, str] = {root_pid: "driver"}
        self.samples: list[dict[int, int]] = []

    def sample(self) -> dict[int, int]:
        found = {}
        for proc in [self.root, *self._children()]:
            try:
                with proc.oneshot():
                    rss = proc.memory_info().rss
                    role = process_role(proc.cmdline(), proc.name())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            found[proc.pid] = rss
            if proc.pid != self.root.pid and (role != "idle" or proc.pid not in self.roles):
                self.roles[proc.pid] = role
        self.samples.append(found)
        return found

    def series(self) -> dict[str, list[int | None]]:
        """``"role pid" -> [rss per sample]`` (None where the process was not alive at that sample)."""
        return {
            f"{self.roles[pid]} {pid}": [sample.get(pid) for sample in self.samples]
            for pid in sorted({pid for sample in self.samples for pid in sample})
        }

    def _children(self) -> list[psutil.Process]:
        try:
            return self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            return []


def warnings_per_step(log: str) -> dict[int, list[str]]:
    """The warning lines of a run's log by step: step k's are those after verl's line for step k-1 up to its
    line for step k (step 1's include the start-up's; the lines after the last step count for the next)."""
    found: dict[int, list[str]] = {}
    step = 1
    for line in log.splitlines():
        if WARNING_LINE.search(line):
            found.setdefault(step, []).append(line)
        match = STEP_LINE.search(line)
        if match:
            step = int(match.group(1)) + 1
    return found


def growth(values: Sequence[float], warmup: int, window: int) -> float:
    """Median of the last ``window`` values minus the median of the ``window`` values after the first ``warmup``.

    ``values`` [steps] per step; needs ``warmup + 2 * window`` <= steps (else ``ValueError`` naming the sizes).
    """
    if warmup < 0 or window < 1:
        raise ValueError(f"warmup must be >= 0 and window >= 1, got warmup={warmup}, window={window}")
    if warmup + 2 * window > len(values):
        raise ValueError(f"{len(values)} steps are too few for warmup={warmup} and two windows of {window}")
    after = list(values[warmup:])
    return statistics.median(after[-window:]) - statistics.median(after[:window])


def curve_differences(a: Sequence[dict], b: Sequence[dict], keys: Iterable[str]) -> dict[str, float]:
    """The largest |a - b| per key over the steps both runs logged (``a``, ``b``: per-step metric dicts)."""
    if len(a) != len(b):
        raise ValueError(f"the runs logged {len(a)} and {len(b)} steps")
    return {key: max(abs(x[key] - y[key]) for x, y in zip(a, b)) for key in keys}


def checks(runs: dict[str, dict], warmup: int, groups_per_step: int) -> list[dict]:
    """The soak's checks on finished runs (``name -> {"expected_steps", "steps", "rss", "warnings_per_step"}``,
    names ``<recipe>_<engine>``): every step ran, the required processes were sampled, each process's RSS
    growth after the warm-up, the planner's entries, the growth of the warnings per step, and the curves of
    the two engines per recipe. Returns ``[{"check", "run", "value", "bound", "ok"}]``."""
    found = []
    for name, result in runs.items():
        roles = {process.split()[0] for process in result["rss"]}
        required = REQUIRED_ROLES + ((PLANNER_ROLE,) if name.endswith("augtree") else ())
        found.append(
            _check("processes_missing", f"{name} {sorted(set(required) - roles)}", len(set(required) - roles), 0)
        )
        found.append(_check("steps_missing", name, result.get("expected_steps", 0) - len(result["steps"]), 0))
        for process, rss in result["rss"].items():
            if None in rss[warmup:]:  # started or ended after the warm-up: a short-lived helper process
                continue
            mib = growth([value / MIB for value in rss], warmup, WINDOW)
            found.append(_check("rss_growth_mib", f"{name} {process}", mib, RSS_GROWTH_BOUND_MIB))
        depth = [step.get("augtree/planner/queue_depth") for step in result["steps"]]
        if depth[0] is not None:
            found.append(
                _check("planner_entries", name, max(depth[warmup:]), PLANNER_ENTRIES_BOUND_STEPS * groups_per_step)
            )
        found.append(_check("warnings_growth", name, growth(result["warnings_per_step"], warmup, WINDOW), 0))
    for recipe in {name.split("_")[0] for name in runs}:
        if f"{recipe}_fsdp2" in runs and f"{recipe}_augtree" in runs:
            diffs = curve_differences(runs[f"{recipe}_fsdp2"]["steps"], runs[f"{recipe}_augtree"]["steps"], CURVES)
            found += [_check(f"curve {key}", recipe, diff, CURVES[key]) for key, diff in diffs.items()]
    return found


def message(line: str) -> str:
    """A log line without what varies between repeats of it (colours, pids, times)."""
    for pattern, replacement in VARYING:
        line = pattern.sub(replacement, line)
    return line.strip()


def _check(check: str, run_name: str, value: float, bound: float) -> dict:
    return {"check": check, "run": run_name, "value": value, "bound": bound, "ok": value <= bound}
