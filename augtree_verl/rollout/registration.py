"""Registering the CPU rollout backend ``hf`` (``augtree_verl.rollout.hf``) with verl for ``rollout.name=hf``.

Called by the ``augtree_trainer`` plugin (``augtree_verl.trainer``), which ``import verl`` loads in every
process, driver and Ray workers alike; the hooks run when verl imports its rollout modules.
"""

from __future__ import annotations

from augtree_verl.integration import verl_compat
from augtree_verl.integration.import_hooks import after_import

# The CPU rollout backend, selected with actor_rollout_ref.rollout.name.
ROLLOUT = "hf"
ROLLOUT_ADAPTER = "augtree_verl.rollout.hf.HFServerAdapter"


def _load_hf_replica():
    from augtree_verl.rollout.hf import HFReplica

    return HFReplica


def register_rollout_replica(replica_module) -> None:
    replica_module.RolloutReplicaRegistry.register(ROLLOUT, _load_hf_replica)


def register_rollout_adapter(base_module) -> None:
    verl_compat.register_rollout_adapter(base_module, ROLLOUT, ROLLOUT_ADAPTER)


def register_rollout_when_verl_loads() -> None:
    after_import("verl.workers.rollout.replica", register_rollout_replica)
    after_import("verl.workers.rollout.base", register_rollout_adapter)
