"""The async trainer modes ``augtree_colocate_async`` and ``augtree_separate_async``.

verl's two async V1 trainers with the group-aware balance and plans (``group_aware.AugTreeTrainerMixin``).
A group may be trained one or more steps after its rollout finished; the planner service keeps its plan by
uid until then. They read verl's ``trainer.v1.colocate_async`` / ``trainer.v1.separate_async`` settings.

separate_async runs the actor in verl's ``DetachActorWorker``, which saves and restores the weights on the
CPU by strategy; ``trainer/__init__`` makes it serve strategy ``augtree`` with FSDP2's handlers (our engine
is FSDP2). verl also requires there a non-naive checkpoint engine (``rollout.checkpoint_engine.backend``; on
CPU ``rollout.checkpoint_engine`` of this package, ``gloo``) and calls the balance once per mini-batch.
"""

from verl.trainer.ppo.v1 import PPOTrainerColocateAsync, PPOTrainerSeparateAsync, register_trainer

from augtree_verl.integration import verl_compat
from augtree_verl.trainer.group_aware import AugTreeTrainerMixin

COLOCATE_ASYNC_MODE = "augtree_colocate_async"
SEPARATE_ASYNC_MODE = "augtree_separate_async"


@register_trainer(COLOCATE_ASYNC_MODE)
class AugTreeColocateAsyncTrainer(AugTreeTrainerMixin, PPOTrainerColocateAsync):
    """Trainer and rollout share the GPUs; partial rollouts; groups trained a step or more after sampling."""

    trainer_mode = verl_compat.trainer_mode_as("colocate_async")


@register_trainer(SEPARATE_ASYNC_MODE)
class AugTreeSeparateAsyncTrainer(AugTreeTrainerMixin, PPOTrainerSeparateAsync):
    """A standalone rollout pool beside the trainer (which may lend its GPUs to the rollout when idle)."""

    trainer_mode = verl_compat.trainer_mode_as("separate_async")

    def __init__(self, config):
        if not config.actor_rollout_ref.get("hybrid_engine", True):
            verl_compat.quiet_separate_async_info_log()  # verl's log line there raises otherwise
        super().__init__(config)
