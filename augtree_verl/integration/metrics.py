"""Per-step AugTree metrics in verl's metrics dict (they reach the console and wandb as ``actor/augtree/...``).

Every rank reports every key once per ``forward_backward_batch`` call, so verl's DP aggregation
(``Metric.aggregate_dp``) sees equal-length value lists. SUM metrics are per data-parallel rank, summed over
the step's mini-batches (verl averages them over DP ranks); MEAN and MAX metrics are as named. With context
parallelism a data-parallel rank is a CP group, whose ranks' stats are first combined (``group_totals``):
tokens, trees and bytes summed, times those of the slowest rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from verl.utils.metric import AggregationType, Metric

from augtree_verl.plan import PRIMITIVES, Plan
from augtree_verl.replay import ReplayStats

PREFIX = "augtree/"
# "single" counts trees run without a plan (one device, no planner); the others count trees by their plan's
# primitive (a planner fallback runs with the one-device plan: ring at degree 1).
PLAN_KINDS = ("single",) + PRIMITIVES
DIRECTIONS = ("fwd", "bwd")


def group_totals(stats: ReplayStats, backward_s: float, group, device) -> tuple[ReplayStats, float]:
    """(``stats`` and ``backward_s`` combined over the CP ``group``: see the module docstring), on every rank."""
    byte_keys = [f"{p}/{d}" for p in PRIMITIVES for d in DIRECTIONS]
    counts = torch.tensor([stats.logical_tokens, stats.executed_tokens, stats.trees, stats.micro_batches]
                          + [stats.comm_bytes.get(k, 0) for k in byte_keys]
                          + [stats.plans.get(k, 0) for k in PLAN_KINDS], dtype=torch.float64, device=device)
    times = torch.tensor([stats.prefill_s, stats.replay_s, stats.prompt_backward_s, backward_s],
                         dtype=torch.float64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    counts, times = [int(x) for x in counts.tolist()], times.tolist()
    total = ReplayStats(prefill_s=times[0], replay_s=times[1], prompt_backward_s=times[2],
                        logical_tokens=counts[0], executed_tokens=counts[1], trees=counts[2], micro_batches=counts[3])
    for k, value in zip(byte_keys + list(PLAN_KINDS), counts[4:]):
        (total.comm_bytes if k in byte_keys else total.plans)[k] = value
    return total, times[3]


def step_metrics(stats: ReplayStats, plans: list[Plan | None], *, backward_s: float, plan_fallbacks: int) -> dict:
    """``stats`` of the step's replays (forward: prefill and response micro-batches); ``backward_s``: the
    delayed prompt backwards (response backwards are in ``replay_s``), 0 when forward-only."""
    measured = stats.prefill_s + stats.replay_s + backward_s
    predicted = sum(p.est_time_s for p in plans if p is not None and p.est_time_s is not None)
    degrees = [p.degree if p is not None else 1 for p in plans] or [1]

    def total(value) -> Metric:
        return Metric(AggregationType.SUM, float(value))

    out = {
        "prefill_s": total(stats.prefill_s),
        "replay_s": total(stats.replay_s),
        "delayed_backward_s": total(backward_s),
        "measured_replay_s": total(measured),
        "predicted_replay_s": total(predicted),
        "logical_tokens": total(stats.logical_tokens),
        "executed_tokens": total(stats.executed_tokens),
        "executed_per_logical_token": Metric(AggregationType.MEAN,
                                             stats.executed_tokens / max(stats.logical_tokens, 1)),
        "trees": total(stats.trees),
        "plan_fallbacks": total(plan_fallbacks),
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
