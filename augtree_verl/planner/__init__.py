"""The online planner: per-tree CP plans from a calibrated cluster profile (docs/design.md §6).

The Ray planner service (``planner.service``), its rollout-side feed (``planner.feed``) and its trainer-side
client (``planner.client``) are imported on demand: they pull in Ray.
"""

from augtree_verl.planner.profile import ClusterProfile
from augtree_verl.planner.search import plan_tree

__all__ = ["ClusterProfile", "plan_tree"]
