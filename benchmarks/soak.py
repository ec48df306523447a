"""The soak: the CPU loop for many steps with each engine, GRPO and DAPO; nothing grows, the engines agree.

    python benchmarks/soak.py [--steps 30] [--warmup 5] [--recipes grpo dapo] [--engines fsdp2 augtree]
                              [--out results/soak]

Each (recipe, engine) runs ``examples/run_cpu.sh`` (verl's main_ppo: two trainer workers, the ``hf`` rollout
server, on augtree the planner service) for ``--steps`` steps, with every Python warning shown each time it
is raised (``PYTHONWARNINGS=always``, Ray's log deduplication off). Each time verl's file logger writes a step,
the RSS of every process of the run is sampled (``cpu_loop.soak.ProcessSampler``). The checks and their
bounds (``cpu_loop.soak.checks``; each printed with its figures, the script exits 1 if one fails):

- every step ran (and was sampled);
- the run's processes include verl's driver and task runner, the trainer workers, the rollout server and,
  on augtree, the planner actor;
- every process's RSS grows by at most ``RSS_GROWTH_BOUND_MIB`` after the warm-up (``growth``: median of
  the last ``WINDOW`` steps minus the median of the first ``WINDOW`` after ``--warmup``);
- the planner actor's entries after the step's balance (``augtree/planner/queue_depth``) stay within
  ``PLANNER_ENTRIES_BOUND_STEPS`` steps' groups after the warm-up;
- the warnings per step do not grow after the warm-up (``growth`` of the per-step counts <= 0);
- the reward and loss curves of the engines agree at every step within ``REWARD_TOL`` and ``LOSS_TOL``.

Writes ``OUT/soak.json`` (the per-step series and the checks), ``OUT/soak.png`` and each run's log and
metrics (``OUT/<recipe>_<engine>.{log,jsonl}``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from augtree_verl.cpu_loop.compare import read_steps
from augtree_verl.cpu_loop.soak import (
    MIB,
    REQUIRED_ROLES,
    RSS_GROWTH_BOUND_MIB,
    WINDOW,
    ProcessSampler,
    checks,
    message,
    warnings_per_step,
)

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"grpo": "grpo_augtree", "dapo": "dapo_augtree"}
POLL_S = 0.2
MAIN_ROLES = (*REQUIRED_ROLES, "PlannerService", "PlannerFeedWorker", "AgentLoopWorkerTQ")


def run(recipe: str, engine: str, steps: int, out: Path) -> dict:
    """One run of ``examples/run_cpu.sh``; returns its per-step metrics, RSS series and warnings per step."""
    name = f"{recipe}_{engine}"
    metrics, log = out / f"{name}.jsonl", out / f"{name}.log"
    metrics.unlink(missing_ok=True)
    env = {
        **os.environ,
        "RECIPE": RECIPES[recipe],
        "STRATEGY": engine,
        "STEPS": str(steps),
        "VERL_FILE_LOGGER_PATH": str(metrics),
        "PYTHONWARNINGS": "always",
        "RAY_DEDUP_LOGS": "0",
        "PYTHON": sys.executable,
    }
    start = time.monotonic()
    # Enough epochs for the steps (the generated task's 64 rows make 32 steps an epoch).
    command = ["bash", str(REPO / "examples/run_cpu.sh"), f"trainer.total_epochs={steps}"]
    with open(log, "w") as log_file:
        proc = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=out)
        sampler = ProcessSampler(proc.pid)
        logged = 0
        while proc.poll() is None:
            lines = _lines(metrics)
            for _ in range(lines - logged):  # a step ended: one sample per logged step
                sampler.sample()
            logged = max(logged, lines)
            time.sleep(POLL_S)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: examples/run_cpu.sh exited {proc.returncode}; see {log}")
    rows = read_steps(metrics)[: len(sampler.samples)]
    warnings = warnings_per_step(log.read_text())
    return {
        "wall_s": time.monotonic() - start,
        "expected_steps": steps,
        "steps": rows,
        "rss": sampler.series(),
        "warnings_per_step": [len(warnings.get(step, [])) for step in range(1, len(rows) + 1)],
        "warnings": Counter(message(line) for lines in warnings.values() for line in lines).most_common(30),
    }


def _lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def summary(runs: dict[str, dict], found: list[dict], warmup: int) -> str:
    """A markdown table per run (processes, the largest RSS growth, planner entries, warnings per step after
    the warm-up) and the curves' largest differences between the engines."""
    lines = [
        f"| run | steps | processes | largest RSS growth after step {warmup} | planner entries | "
        f"warnings per step after step {warmup} |",
        "| --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for name, result in runs.items():
        rss = [c for c in found if c["check"] == "rss_growth_mib" and c["run"].startswith(name + " ")]
        worst = max(rss, key=lambda c: c["value"])
        depth = [s.get("augtree/planner/queue_depth") for s in result["steps"][warmup:]]
        counts = result["warnings_per_step"][warmup:]
        lines.append(
            f"| {name} | {len(result['steps'])} | {len(result['rss'])} | {worst['value']:.1f} MiB "
            f"({worst['run'].split()[1]}) | {'-' if depth[0] is None else f'max {max(depth):g}'} | "
            f"{min(counts)}-{max(counts)} |"
        )
    curves = [f"{c['run']} {c['check'].split()[1]} {c['value']:.2g}" for c in found if c["check"].startswith("curve")]
    if curves:
        lines.append("\nlargest difference between the engines per step: " + ", ".join(curves))
    return "\n".join(lines)


def plot(runs: dict[str, dict], warmup: int, out: Path) -> Path:
    """Per run: each process's RSS change since the warm-up (the main roles named, the others grey), the
    planner's entries, the warnings, the reward and the loss per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (f"RSS - RSS at step {warmup} (MiB)", "planner entries", "warnings", "critic/score/mean", "actor/pg_loss")
    fig, axes = plt.subplots(len(runs), len(panels), figsize=(4 * len(panels), 2.8 * len(runs)), squeeze=False)
    for row, (name, result) in zip(axes, runs.items()):
        steps = range(1, len(result["steps"]) + 1)
        for process, rss in sorted(result["rss"].items()):
            if None in rss:
                continue
            role = process.split()[0]
            named = role in MAIN_ROLES
            row[0].plot(
                steps,
                [(value - rss[warmup - 1]) / MIB for value in rss],
                lw=1.2 if named else 0.6,
                color=None if named else "0.75",
                label=role if named else None,
            )
        for bound in (-RSS_GROWTH_BOUND_MIB, RSS_GROWTH_BOUND_MIB):
            row[0].axhline(bound, ls="--", color="red", lw=0.8)
        row[0].legend(fontsize=6, ncol=2)
        row[1].plot(steps, [s.get("augtree/planner/queue_depth", 0) for s in result["steps"]])
        row[2].plot(steps, result["warnings_per_step"])
        for ax, key in zip(row[3:], panels[3:]):
            ax.plot(steps, [s[key] for s in result["steps"]])
        for ax, title in zip(row, panels):
            ax.set_title(f"{name}: {title}", fontsize=9)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "soak.png"
    fig.savefig(path, dpi=64)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps before the flatness checks start")
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=sorted(RECIPES, reverse=True))
    parser.add_argument("--engines", nargs="+", choices=("fsdp2", "augtree"), default=["fsdp2", "augtree"])
    parser.add_argument("--groups-per-step", type=int, default=2, help="data.train_batch_size of run_cpu.sh")
    parser.add_argument("--out", type=Path, default=Path("results/soak"))
    parser.add_argument("--from-json", type=Path, help="check and plot the runs of an earlier soak.json again")
    args = parser.parse_args(argv)
    if args.steps < args.warmup + 2 * WINDOW:
        parser.error(f"--steps {args.steps} is too few for --warmup {args.warmup} and two windows of {WINDOW}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = json.loads(args.from_json.read_text())["runs"] if args.from_json else {}
    for recipe in args.recipes if not args.from_json else ():
        for engine in args.engines:
            runs[f"{recipe}_{engine}"] = run(recipe, engine, args.steps, args.out.resolve())
            print(f"{recipe}_{engine}: {args.steps} steps in {runs[f'{recipe}_{engine}']['wall_s']:.0f} s", flush=True)
    found = checks(runs, args.warmup, args.groups_per_step)
    (args.out / "soak.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "checks": found, "runs": runs}, indent=1)
    )
    for check in found:
        print(
            f"{'ok  ' if check['ok'] else 'FAIL'} {check['check']:<28} {check['run']:<40} "
            f"{check['value']:>12.6g} <= {check['bound']:g}"
        )
    print(summary(runs, found, args.warmup))
    print(f"plot: {plot(runs, args.warmup, args.out)}")
    return 0 if all(check["ok"] for check in found) else 1


if __name__ == "__main__":
    sys.exit(main())
