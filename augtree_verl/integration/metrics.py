"""Per-step AugTree metrics in verl's metrics dict (they reach the console and wandb as ``actor/augtree/...``).

Every rank reports every key once per ``forward_backward_batch`` call, so verl's DP aggregation
(``Metric.aggregate_dp``) sees equal-length value lists. SUM metrics are per data-parallel rank, summed over
the step's mini-batches (verl averages them over DP ranks); MEAN and MAX metrics are as named. With context
parallelism a data-parallel rank is a CP group, whose ranks' stats are first combined (``group_totals``):
tokens, trees and bytes summed, times those of the slowest rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from verl.utils.metric import AggregationType, Metric

from augtree_verl.plan import PRIMITIVES, Plan
from augtree_verl.replay import ReplayStats
from augtree_verl.replay.stats import PHASES

PREFIX = "augtree/"
# "single" counts trees run without a plan (one device, no planner); the others count trees by their plan's
# primitive (a planner fallback runs with the one-device plan: ring at degree 1).
PLAN_KINDS = ("single",) + PRIMITIVES
DIRECTIONS = ("fwd", "bwd")
# ReplayStats' integer counters, summed over a CP group (``group_totals``)
COUNTERS = ("logical_tokens", "executed_tokens", "trees", "micro_batches", "offloaded_bytes", "prefetched_bytes",
            "offload_copies")


def group_totals(stats: ReplayStats, group, device) -> ReplayStats:
    """``stats`` combined over the CP ``group`` (see the module docstring), on every rank."""
    byte_keys = [f"{p}/{d}" for p in PRIMITIVES for d in DIRECTIONS]
    counts = torch.tensor([getattr(stats, name) for name in COUNTERS]
                          + [stats.comm_bytes.get(k, 0) for k in byte_keys]
                          + [stats.plans.get(k, 0) for k in PLAN_KINDS], dtype=torch.float64, device=device)
    times = torch.tensor([getattr(stats, phase) for phase in PHASES], dtype=torch.float64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    summed = [int(x) for x in counts.tolist()]
    counters: dict[str, Any] = dict(zip(COUNTERS, summed))
    total = ReplayStats(**dict(zip(PHASES, times.tolist())), **counters)
    for k, value in zip(byte_keys + list(PLAN_KINDS), summed[len(COUNTERS):]):
        (total.comm_bytes if k in byte_keys else total.plans)[k] = value
    return total


def step_metrics(stats: ReplayStats, plans: list[Plan | None], *, plan_fallbacks: int, cp_demoted: int) -> dict:
    """``stats`` of the step's replays: prefills, response micro-batches (forward and backward: ``replay_s``)
    and the delayed prompt backwards (0 when forward-only); ``cp_demoted``: context-parallel plans run on one
    device because the model cannot run them (linear attention, ``replay.linear_state.demote_cp_plans``)."""
    measured = stats.prefill_s + stats.replay_s + stats.prompt_backward_s
    predicted = sum(p.est_time_s for p in plans if p is not None and p.est_time_s is not None)
    degrees = [p.degree if p is not None else 1 for p in plans] or [1]

    def total(value) -> Metric:
        return Metric(AggregationType.SUM, float(value))

    out = {
        "prefill_s": total(stats.prefill_s),
        "replay_s": total(stats.replay_s),
        "delayed_backward_s": total(stats.prompt_backward_s),
        "measured_replay_s": total(measured),
        "predicted_replay_s": total(predicted),
        "logical_tokens": total(stats.logical_tokens),
        "executed_tokens": total(stats.executed_tokens),
        "executed_per_logical_token": Metric(AggregationType.MEAN,
                                             stats.executed_tokens / max(stats.logical_tokens, 1)),
        "trees": total(stats.trees),
        "plan_fallbacks": total(plan_fallbacks),
        "planner/cp_demoted_linear_attention": total(cp_demoted),
        "offload/offloaded_bytes": total(stats.offloaded_bytes),
        "offload/prefetched_bytes": total(stats.prefetched_bytes),
        "offload/copies": total(stats.offload_copies),
        "cp_degree_mean": Metric(AggregationType.MEAN, sum(degrees) / len(degrees)),
        "cp_degree_max": Metric(AggregationType.MAX, float(max(degrees))),
    }
    for kind in PLAN_KINDS:
        out[f"plans/{kind}"] = total(stats.plans.get(kind, 0))
    for primitive in PRIMITIVES:
        for direction in DIRECTIONS:
            out[f"comm_bytes/{primitive}/{direction}"] = total(stats.comm_bytes.get(f"{primitive}/{direction}", 0))
    return {PREFIX + k: v for k, v in out.items()}
