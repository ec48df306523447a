"""augtree-verl: prompt-reuse replay and prompt-aware context parallelism for verl's update stage."""

from augtree_verl.plan import Plan
from augtree_verl.planner import ClusterProfile, plan_tree
from augtree_verl.replay import ReplayOptions, ReplayStats, StepPlan, Tree, per_response, replay

__all__ = [
    "ClusterProfile",
    "Plan",
    "ReplayOptions",
    "ReplayStats",
    "StepPlan",
    "Tree",
    "per_response",
    "plan_tree",
    "replay",
]
