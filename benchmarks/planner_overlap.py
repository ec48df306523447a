"""Plans ready before the batch: the planner actor fed live by a simulated rollout, against planning at balance;
or, with ``--separate-async STEPS``, by the rollout pool of a real ``augtree_separate_async`` run.

    python benchmarks/planner_overlap.py [--groups 512] [--group-size 8] [--rollout-s 2] [--repeats 3] [--json PATH]
    python benchmarks/planner_overlap.py --separate-async 4 [--json PATH]

A simulated rollout stream: ``--groups`` groups drawn in turn from the shipped length tables (longdoc, rag,
chat, reasoning; each group's first ``--group-size`` responses, repeated cyclically if it has fewer), each
finishing after a time proportional to its prefill plus its longest response's decode (P / 50 + max R, in
tokens) times a seeded speed factor in [0.9, 1.1] (replicas and their batches decode at different speeds; it
also keeps the cyclically reused groups of the small tables from finishing at the very same instant), scaled
so that the last one finishes ``--rollout-s`` seconds after the start. As each group finishes,
a ``PlannerFeed`` reports it to the planner actor, as the rollout workers do.

Reported (median over ``--repeats`` streams):
- ``ready_after_last_finish_ms``: from the last group's finish until the actor has planned every group
  (its ``last_planned_s``; ``time.monotonic`` is one clock for all processes of a host). Goal: under 5 ms for
  512 groups of 8.
- ``trainer_fetch_ms``: the trainer's ``PlannerClient.plans`` for every group, handed over by the actor
  (the trainer's wait, ``augtree/planner/plan_wait_s``, when the plans are ready).
- ``at_balance_ms``: the same call when the trainer plans every group itself at balance time (planning on
  the critical path).
``--json PATH`` writes ``{"groups", "ready_after_last_finish_ms", "at_balance_ms", ...}``. Times taken on a
shared machine are noisy; the ratio is the point.

``--separate-async STEPS`` runs ``examples/run_cpu.sh trainer.v1.trainer_mode=augtree_separate_async`` (verl's
main_ppo on CPU: the GRPO recipe, its own rollout worker, ``STEPS`` steps) and reports per step, from verl's
metrics: the groups trained, how many plans came from the rollout workers, and how long before the trainer's
balance (its dispatch to the workers) those plans were ready (``augtree/planner/plan_lead_s_min`` / ``_mean``,
on the planner actor's clock), against the step's ``timing_s/gen`` (the trainer's wait for the batch).
``--json`` then writes ``{"separate_async": [one row per step]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import ray

from augtree_verl.bench.workloads import fit_group_size, load_table
from augtree_verl.groups import GroupLengths
from augtree_verl.planner import ClusterProfile
from augtree_verl.planner.client import PlannerClient
from augtree_verl.planner.feed import PlannerFeed
from augtree_verl.planner.service import start_planner_service

WORKLOADS = ("longdoc", "rag", "chat", "reasoning")
DEGREES = (1, 2, 4, 8)
PREFILL_TOKENS_PER_DECODE_TOKEN = 50  # a prompt token costs ~1/50 of a decoded token (batched prefill)
SPEED_JITTER = 0.1  # decode speed factor drawn uniformly in [1 - 0.1, 1 + 0.1]
GOAL_MS = 5.0
REPO = Path(__file__).resolve().parents[1]
# What --separate-async reports per step (verl's metric names).
LEAD_METRICS = {
    "groups": "augtree/balance/groups",
    "from_rollout": "augtree/planner/plans_from_rollout",
    "lead_min_s": "augtree/planner/plan_lead_s_min",
    "lead_mean_s": "augtree/planner/plan_lead_s_mean",
    "plan_wait_s": "augtree/planner/plan_wait_s",
    "gen_s": "timing_s/gen",
    "staleness_max": "training/off_policy/trajectory_staleness/max",
}


def rollout_stream(
    num_groups: int, group_size: int, rollout_s: float, seed: int
) -> list[tuple[float, str, GroupLengths]]:
    """(finish time s, uid, lengths) per group, in finish order."""
    rng = random.Random(seed)
    tables = [load_table(name) for name in WORKLOADS]
    groups = []
    for i in range(num_groups):
        table = tables[i % len(tables)]
        shape = fit_group_size(table[(i // len(tables)) % len(table)], group_size)
        groups.append((uuid.uuid4().hex, shape.prompt_len, list(shape.response_lens)))
    cost = [
        (p / PREFILL_TOKENS_PER_DECODE_TOKEN + max(rs)) * rng.uniform(1 - SPEED_JITTER, 1 + SPEED_JITTER)
        for _, p, rs in groups
    ]
    scale = rollout_s / max(cost)
    return sorted((c * scale, uid, GroupLengths(p, rs)) for c, (uid, p, rs) in zip(cost, groups))


def run_stream(actor, feed: PlannerFeed, client: PlannerClient, stream) -> dict[str, float]:
    """Feed the groups at their finish times; once the actor has planned them, the trainer asks for every plan."""
    reported_before = ray.get(actor.state.remote())["reported"]
    start = time.monotonic()
    for finish_s, uid, lengths in stream:
        delay = start + finish_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        feed.report(uid, lengths)
    last_finish = time.monotonic()
    while (state := ray.get(actor.state.remote()))["reported"] < reported_before + len(stream):
        time.sleep(0.001)
    ready_ms = (state["last_planned_s"] - last_finish) * 1e3

    request = {f"{uid}|{lengths.prompt_len}": (uid, lengths) for _, uid, lengths in stream}
    fetch_start = time.perf_counter()
    client.plans(request, from_rollout=request)
    fetch_ms = (time.perf_counter() - fetch_start) * 1e3
    from_rollout = client.metrics(reset=True)["planner/plans_from_rollout"]

    at_balance_start = time.perf_counter()
    client.plans(request, from_rollout=())  # every group planned here, at balance time
    at_balance_ms = (time.perf_counter() - at_balance_start) * 1e3
    client.metrics(reset=True)
    return {
        "ready_after_last_finish_ms": ready_ms,
        "trainer_fetch_ms": fetch_ms,
        "at_balance_ms": at_balance_ms,
        "from_rollout": from_rollout,
    }


def separate_async_leads(steps: int) -> list[dict[str, float]]:
    """Per step of an ``augtree_separate_async`` main_ppo run on CPU: ``LEAD_METRICS`` (nan where absent)."""
    with tempfile.TemporaryDirectory(prefix="planner-overlap-") as out:
        log = Path(out) / "metrics.jsonl"
        env = dict(
            os.environ,
            STEPS=str(steps),
            VERL_FILE_LOGGER_PATH=str(log),
            PYTHON=sys.executable,
            TORCHINDUCTOR_CACHE_DIR=str(Path(out) / "inductor"),
        )
        env.pop("RAY_ADDRESS", None)
        run = subprocess.run(
            ["bash", str(REPO / "examples/run_cpu.sh"), "trainer.v1.trainer_mode=augtree_separate_async"],
            cwd=out,
            env=env,
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            raise SystemExit(f"run_cpu.sh failed:\n{(run.stdout + run.stderr)[-4000:]}")
        rows = [json.loads(line)["data"] for line in log.read_text().splitlines()]
    return [
        {"step": row["training/global_step"], **{k: float(row.get(m, "nan")) for k, m in LEAD_METRICS.items()}}
        for row in rows
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--rollout-s", type=float, default=2.0, help="when the last group finishes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the result to this file")
    parser.add_argument(
        "--separate-async",
        type=int,
        metavar="STEPS",
        help="instead: an augtree_separate_async main_ppo run of STEPS steps on CPU",
    )
    args = parser.parse_args()
    if args.separate_async is not None:
        if args.separate_async < 1:
            parser.error("--separate-async must be >= 1")
        rows = separate_async_leads(args.separate_async)
        print(
            "step  groups  from rollout  plans ready before dispatch: least / mean s  trainer's wait gen s  staleness"
        )
        for r in rows:
            print(
                f"{r['step']:4d}  {r['groups']:6.0f}  {r['from_rollout']:12.0f}  {r['lead_min_s']:27.3f} / "
                f"{r['lead_mean_s']:.3f}  {r['gen_s']:20.3f}  {r['staleness_max']:9.0f}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"separate_async": rows}, f, indent=2)
        return
    for name in ("groups", "group_size", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.rollout_s > 0:
        parser.error("--rollout-s must be > 0")

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        name = f"planner-overlap-{uuid.uuid4().hex[:8]}"
        actor = start_planner_service(name, degrees=DEGREES, profile=ClusterProfile.default())
        ray.get(actor.config.remote(), timeout=300)
        feed, client = (
            PlannerFeed(name),
            PlannerClient(name, degrees=DEGREES, profile=ClusterProfile.default(), timeout_s=60.0),
        )
        runs = [
            run_stream(actor, feed, client, rollout_stream(args.groups, args.group_size, args.rollout_s, seed))
            for seed in range(args.repeats)
        ]
    finally:
        ray.shutdown()

    result = {
        "groups": args.groups,
        "group_size": args.group_size,
        "rollout_s": args.rollout_s,
        "repeats": args.repeats,
        "ready_after_last_finish_ms": statistics.median(r["ready_after_last_finish_ms"] for r in runs),
        "trainer_fetch_ms": statistics.median(r["trainer_fetch_ms"] for r in runs),
        "at_balance_ms": statistics.median(r["at_balance_ms"] for r in runs),
        "plans_from_rollout_min": min(r["from_rollout"] for r in runs),
    }
    print(
        f"{args.groups} groups of {args.group_size}, last finish at {args.rollout_s:.1f} s, median of {args.repeats}:"
    )
    print(
        f"  every plan ready {result['ready_after_last_finish_ms']:.2f} ms after the last group finished "
        f"(goal < {GOAL_MS:.0f} ms)"
    )
    print(
        f"  the trainer fetches them in {result['trainer_fetch_ms']:.1f} ms "
        f"({result['plans_from_rollout_min']:.0f}/{args.groups} plans from the rollout)"
    )
    print(
        f"  planning at balance time instead: {result['at_balance_ms']:.1f} ms "
        f"({result['at_balance_ms'] / max(result['trainer_fetch_ms'], 1e-9):.1f}x the fetch)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
