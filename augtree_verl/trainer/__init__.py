"""verl trainer hook: the trainer modes ``augtree_sync``, ``augtree_colocate_async``, ``augtree_separate_async``.

This package is a ``verl.plugins`` entry point (``augtree_trainer``), so ``import verl`` imports it in every
process. Importing it is cheap: it only arranges that

- the modes are registered with verl's ``@register_trainer`` as soon as verl imports its V1 trainers
  (``verl.trainer.ppo.v1``), which is where ``main_ppo``'s task runner looks the mode up;
- verl's ``DetachActorWorker`` (separate_async's actor worker) accepts strategy ``augtree`` as soon as verl
  imports it, in whichever process builds the worker;
- the CPU rollout backend ``hf`` is registered as soon as verl imports its rollouts
  (``augtree_verl.rollout.registration``; ``augtree_verl.integration``, the engine's plugin, sits below the
  rollout layer and may not import it).

Importing ``verl.trainer.ppo.v1`` inside ``import verl`` would take seconds in every Ray worker and fix
verl's platform before the CPU platform plugin registers.
"""

import importlib

from augtree_verl.groups import Tree, find_trees, tree_workload
from augtree_verl.integration.import_hooks import after_import
from augtree_verl.integration.strategy import STRATEGY
from augtree_verl.integration.verl_compat import serve_strategy_in_detach_actor_worker
from augtree_verl.plan_field import PLAN_FIELD, PlannedTree, group_plan_entries, plan_entries
from augtree_verl.rollout.registration import register_rollout_when_verl_loads
from augtree_verl.trainer.group_balance import WorkModel, balance_groups

TRAINER_MODULES = ("augtree_verl.trainer.augtree_sync", "augtree_verl.trainer.augtree_async")


def _register_trainers(_v1_package) -> None:
    for module in TRAINER_MODULES:
        importlib.import_module(module)  # its @register_trainer(...) runs on import


def _serve_augtree(engine_workers_module) -> None:
    serve_strategy_in_detach_actor_worker(engine_workers_module, STRATEGY)


after_import("verl.trainer.ppo.v1", _register_trainers)
after_import("verl.experimental.separation.engine_workers", _serve_augtree)
register_rollout_when_verl_loads()

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
