"""verl trainer hook: the ``augtree_sync`` trainer mode (group-aware balance, planner feed, plans in the batch).

Importing this package registers the mode with verl's ``@register_trainer``; the ``augtree_trainer``
entry point in the ``verl.plugins`` group makes ``import verl`` do that in every process, including the
Ray actor where ``main_ppo`` looks the mode up.
"""

from augtree_verl.trainer.augtree_sync import TRAINER_MODE, AugTreeSyncTrainer
from augtree_verl.trainer.group_balance import Tree, WorkModel, balance_groups, find_trees, tree_workload
from augtree_verl.trainer.plan_field import PLAN_FIELD, PlannedTree, group_plan_entries, plan_entries

__all__ = [
    "PLAN_FIELD",
    "TRAINER_MODE",
    "AugTreeSyncTrainer",
    "PlannedTree",
    "Tree",
    "WorkModel",
    "balance_groups",
    "find_trees",
    "group_plan_entries",
    "plan_entries",
    "tree_workload",
]
