"""The ``augtree_sync`` trainer mode: verl's sync V1 trainer with the group-aware balance and plans.

Select it with ``trainer.v1.trainer_mode=augtree_sync`` (verl's ``main_ppo`` looks the name up in the
``@register_trainer`` registry); it reads verl's ``trainer.v1.sync`` settings.
"""

from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer

from augtree_verl.integration import verl_compat
from augtree_verl.trainer.group_aware import AugTreeTrainerMixin

TRAINER_MODE = "augtree_sync"


@register_trainer(TRAINER_MODE)
class AugTreeSyncTrainer(AugTreeTrainerMixin, PPOTrainerSync):
    """Sync PPO/GRPO/DAPO trainer whose batch balance keeps groups whole and carries the AugTree plans."""

    trainer_mode = verl_compat.trainer_mode_as("sync")
