"""Per-step AugTree metrics in verl's metrics dict (they reach the console and wandb as ``actor/augtree/...``).

Every rank reports every key once per ``forward_backward_batch`` call, so verl's DP aggregation
(``Metric.aggregate_dp``) sees equal-length value lists. SUM metrics are per rank, summed over the step's
mini-batches (verl averages them over DP ranks); MEAN and MAX metrics are as named.
"""

from __future__ import annotations

from verl.utils.metric import AggregationType, Metric

from augtree_verl.plan import PRIMITIVES, Plan
from augtree_verl.replay import ReplayStats

PREFIX = "augtree/"
# "single" counts trees run without a plan (one device); the others count trees by their plan's primitive.
PLAN_KINDS = ("single",) + PRIMITIVES
DIRECTIONS = ("fwd", "bwd")


def step_metrics(stats: ReplayStats, plans: list[Plan | None], *, backward_s: float, plan_fallbacks: int) -> dict:
    """``stats`` of the step's replays (forward: prefill and response micro-batches); ``backward_s``: the
    delayed backward, one per replay unit (responses and prompts together), 0 when forward-only."""
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
        "cp_degree_mean": Metric(AggregationType.MEAN, sum(degrees) / len(degrees)),
        "cp_degree_max": Metric(AggregationType.MAX, float(max(degrees))),
    }
    for kind in PLAN_KINDS:
        out[f"plans/{kind}"] = total(stats.plans.get(kind, 0))
    for primitive in PRIMITIVES:
        for direction in DIRECTIONS:
            out[f"comm_bytes/{primitive}/{direction}"] = total(stats.comm_bytes.get(f"{primitive}/{direction}", 0))
    return {PREFIX + k: v for k, v in out.items()}
