"""The online planner: per-tree CP plans from a calibrated cluster profile (docs/design.md §6).

The Ray planner service lives in ``augtree_verl.planner.service`` (imported on demand: it pulls in Ray).
"""

from augtree_verl.planner.profile import ClusterProfile
from augtree_verl.planner.search import plan_tree

__all__ = ["ClusterProfile", "plan_tree"]
