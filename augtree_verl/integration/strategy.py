"""The backend name users select with ``actor_rollout_ref.actor.strategy`` (a leaf module: the engine's
config, its registration and the trainer all read it, and it imports nothing)."""

STRATEGY = "augtree"
