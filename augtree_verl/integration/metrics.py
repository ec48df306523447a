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

from augtree_verl.plan import Plan
from augtree_verl.replay import ReplayStats
from augtree_verl.replay.stats import PHASES

PREFIX = "augtree/"


def group_totals(stats: ReplayStats, group, device) -> ReplayStats:
    """``stats`` combined over the CP ``group`` (see the module docstring), on every rank: every counter
    field of ``ReplayStats`` summed, the phase times the slowest rank's."""
    counters, keyed = ReplayStats.counters(), ReplayStats.keyed()
    counts = torch.tensor(
        [getattr(stats, f.name) for f in counters]
        + [getattr(stats, f.name).get(k, 0) for f in keyed for k in f.metadata["keys"]],
        dtype=torch.float64,
        device=device,
    )
    times = torch.tensor([getattr(stats, phase) for phase in PHASES], dtype=torch.float64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    summed = iter(int(x) for x in counts.tolist())
    values: dict[str, Any] = {**dict(zip(PHASES, times.tolist())), **{f.name: next(summed) for f in counters}}
    total = ReplayStats(**values)
    for f in keyed:
        getattr(total, f.name).update({k: next(summed) for k in f.metadata["keys"]})
    return total


def step_metrics(stats: ReplayStats, plans: list[Plan | None], *, plan_fallbacks: int, cp_demoted: int) -> dict:
    """``stats`` of the step's replays (every phase and counter field, summed over the step; the delayed
    backward is 0 when forward-only), the predicted replay time, fallbacks, CP degrees and ``cp_demoted``:
    context-parallel plans run on one device because the model cannot run them (linear attention,
    ``replay.linear_state.demote_cp_plans``)."""
    measured = stats.prefill_s + stats.replay_s + stats.prompt_backward_s
    predicted = sum(p.est_time_s for p in plans if p is not None and p.est_time_s is not None)
    degrees = [p.degree if p is not None else 1 for p in plans] or [1]

    def total(value) -> Metric:
        return Metric(AggregationType.SUM, float(value))

    out = {
        ReplayStats.metric_name(name): total(getattr(stats, name))
        for name in PHASES + tuple(f.name for f in ReplayStats.counters())
    }
    for f in ReplayStats.keyed():
        out.update({f"{f.name}/{k}": total(getattr(stats, f.name).get(k, 0)) for k in f.metadata["keys"]})
    out.update(
        {
            "measured_replay_s": total(measured),
            "predicted_replay_s": total(predicted),
            "executed_per_logical_token": Metric(
                AggregationType.MEAN, stats.executed_tokens / max(stats.logical_tokens, 1)
            ),
            "plan_fallbacks": total(plan_fallbacks),
            "planner/cp_demoted_linear_attention": total(cp_demoted),
            "cp_degree_mean": Metric(AggregationType.MEAN, sum(degrees) / len(degrees)),
            "cp_degree_max": Metric(AggregationType.MAX, float(max(degrees))),
        }
    )
    return {PREFIX + k: v for k, v in out.items()}
