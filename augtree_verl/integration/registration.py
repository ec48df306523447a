"""Registering ``AugTreeEngine`` with verl's ``EngineRegistry`` (idempotently: its ``register`` asserts on
repeats). The CPU rollout backend registers itself from the rollout layer (``augtree_verl.rollout.registration``).
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
