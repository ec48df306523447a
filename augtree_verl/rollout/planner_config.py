"""Whether a verl run plans with the planner service, and under which name: read by the trainer (which
starts the service) and by the rollout workers (which report to it)."""

from __future__ import annotations

from verl.utils.config import omega_conf_to_dataclass

from augtree_verl.integration.registration import STRATEGY


def planner_engine_config(config):
    """The actor's ``AugTreeEngineConfig`` when it runs the AugTree engine with the planner on, else None.

    ``config``: verl's whole trainer config (``actor_rollout_ref.actor`` is read).
    """
    actor = config.actor_rollout_ref.actor
    if actor.strategy != STRATEGY:
        return None
    engine_config = omega_conf_to_dataclass(actor.fsdp_config)
    return engine_config if engine_config.use_planner else None
