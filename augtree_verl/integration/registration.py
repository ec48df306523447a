"""Registering with verl (idempotently): ``AugTreeEngine`` in ``EngineRegistry`` (whose ``register`` asserts on
repeats) and the CPU rollout backend ``hf`` (``augtree_verl.rollout.hf``) for ``rollout.name=hf``.
"""

from __future__ import annotations

from augtree_verl.integration import verl_compat
from augtree_verl.integration.import_hooks import after_import
from augtree_verl.integration.strategy import STRATEGY
MODEL_TYPE = "language_model"
# verl resolves the engine by its platform's device name: "cuda" (NVIDIA and ROCm), "npu", or "cpu" with our
# CPU platform. The replay runs on CUDA and CPU (SDPA); NPU is not tested, so it is not claimed.
DEVICES = ("cuda", "cpu")


def register_engine(engine_package) -> None:
    """Register ``AugTreeEngine`` for every device in ``DEVICES`` not registered yet."""
    from augtree_verl.integration.engine import AugTreeEngine

    registry = engine_package.EngineRegistry
    registered = verl_compat.registered_engine_devices(registry, MODEL_TYPE, STRATEGY)
    missing = [d for d in DEVICES if d not in registered]
    if missing:
        registry.register(model_type=MODEL_TYPE, backend=STRATEGY, device=missing)(AugTreeEngine)


def register_engine_when_verl_loads() -> None:
    after_import("verl.workers.engine", register_engine)


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
