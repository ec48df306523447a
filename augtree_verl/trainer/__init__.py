"""verl trainer hook: the ``augtree_sync`` trainer mode (group-aware balance, planner feed, plans in the batch).

This package is a ``verl.plugins`` entry point (``augtree_trainer``), so ``import verl`` imports it in every
process. Importing it is cheap: it only arranges that ``augtree_sync`` is registered with verl's
``@register_trainer`` as soon as verl imports its V1 trainers (``verl.trainer.ppo.v1``), which is where
``main_ppo``'s task runner looks the mode up. Importing ``verl.trainer.ppo.v1`` inside ``import verl``
would take seconds in every Ray worker and fix verl's platform before the CPU platform plugin registers.
"""

import importlib

from augtree_verl.integration.import_hooks import after_import
from augtree_verl.groups import Tree, find_trees, tree_workload
from augtree_verl.plan_field import PLAN_FIELD, PlannedTree, group_plan_entries, plan_entries
from augtree_verl.trainer.group_balance import WorkModel, balance_groups

TRAINER_MODULE = "augtree_verl.trainer.augtree_sync"


def _register_trainer(_v1_package) -> None:
    importlib.import_module(TRAINER_MODULE)  # its @register_trainer("augtree_sync") runs on import


after_import("verl.trainer.ppo.v1", _register_trainer)

__all__ = [
    "PLAN_FIELD",
    "PlannedTree",
    "Tree",
    "WorkModel",
    "balance_groups",
    "find_trees",
    "group_plan_entries",
    "plan_entries",
    "tree_workload",
]
