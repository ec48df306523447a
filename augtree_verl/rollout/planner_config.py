"""Whether a verl run plans, and whether it runs the planner service: read by the trainer (which plans, and
starts the service) and by the rollout workers (which report to the service)."""

from __future__ import annotations

from verl.utils.config import omega_conf_to_dataclass

from augtree_verl.integration.strategy import STRATEGY


def augtree_engine_config(config):
    """The actor's ``AugTreeEngineConfig`` when the actor runs the AugTree engine, else None.

    ``config``: verl's whole trainer config (``actor_rollout_ref.actor`` is read). Its planner knobs
    (``use_planner``, ``planner_*``, ``force_primitive``) are the run's: the trainer plans for the actor and
    the reference model alike.
    """
    actor = config.actor_rollout_ref.actor
    if actor.strategy != STRATEGY:
        return None
    return omega_conf_to_dataclass(actor.fsdp_config)


def planner_service_config(config):
    """The actor's ``AugTreeEngineConfig`` when it runs the AugTree engine with the planner service
    (``use_planner``), else None."""
    engine_config = augtree_engine_config(config)
    return engine_config if engine_config is not None and engine_config.use_planner else None
