"""The ``augtree_sync`` trainer mode: verl's sync V1 trainer with a group-aware batch balance.

Select it with ``trainer.v1.trainer_mode=augtree_sync`` (verl's ``main_ppo`` looks the name up in the
``@register_trainer`` registry). Per training step it

1. reads each sample's group (``uid``) and lengths (the rollout's ``prompt_len`` / ``response_len`` tags),
2. sends every replay tree's lengths to the planner service (when the AugTree engine uses it),
3. orders the batch so each group's samples sit on one data-parallel rank, balanced by estimated work
   with the prompt counted once (``group_balance.balance_groups``),
4. collects the plans and writes them into the batch as ``PLAN_FIELD`` (see ``plan_field``), so they
   reach the workers with the batch.
"""

from __future__ import annotations

import itertools
import logging

import transfer_queue as tq
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.debug import marked_timer
from verl.utils.seqlen_balancing import log_seqlen_unbalance

from augtree_verl.integration.registration import STRATEGY as AUGTREE_STRATEGY
from augtree_verl.planner.service import PlannerClient, start_planner_service
from augtree_verl.trainer.group_balance import WorkModel, balance_groups, find_trees, split_groups
from augtree_verl.trainer.plan_field import PLAN_FIELD, plan_entries

logger = logging.getLogger(__name__)

TRAINER_MODE = "augtree_sync"


@register_trainer(TRAINER_MODE)
class AugTreeSyncTrainer(PPOTrainerSync):
    """Sync PPO/GRPO/DAPO trainer whose batch balance keeps groups whole and feeds the AugTree planner."""

    # verl's PPOTrainer branches on ``self.trainer_mode == "sync"`` (replay-buffer class, dataloader refill,
    # TransferQueue checkpointing) and reads ``trainer.v1.<trainer_mode>`` settings. This mode is the sync
    # trainer under another registry name, so it answers "sync" to those checks and uses the sync settings.
    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, registered_name: str) -> None:
        self.registered_trainer_mode = registered_name

    def __init__(self, config):
        super().__init__(config)
        self.planner = None
        self.planner_actor = None
        self._plan_round = itertools.count()
        if self.config.actor_rollout_ref.actor.get("shuffle", False):
            logger.warning("actor.shuffle=true reshuffles each rank's samples into PPO mini-batches, so groups the "
                           "balance kept in one mini-batch get split and their split CP plans cannot apply")

    def init(self):
        # Start the planner before the workers, whose engines may look it up by name.
        self.planner = self._start_planner()
        super().init()

    def _start_planner(self):
        """A ``PlannerClient`` when the actor runs the AugTree engine with its planner on, else None."""
        actor = self.config.actor_rollout_ref.actor
        if actor.strategy != AUGTREE_STRATEGY:
            return None
        engine_config = omega_conf_to_dataclass(actor.fsdp_config)
        if not engine_config.use_planner:
            return None
        degrees = tuple(engine_config.cp_degrees)
        # Keep the handle: Ray destroys a non-detached named actor once its creator's handles are gone.
        self.planner_actor = start_planner_service(engine_config.planner_name, degrees=degrees)
        return PlannerClient(engine_config.planner_name, degrees=degrees,
                             timeout_s=engine_config.planner_timeout_s)

    def _actor_dp_size(self) -> int:
        """Data-parallel size of the actor worker group (as verl's own ``_balance_batch`` finds it)."""
        worker_group = self.actor_rollout_wg
        if "actor" not in worker_group._dispatch_info:
            worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
        return max(worker_group._dispatch_info["actor"]) + 1

    def _actor_mini_batches(self, num_samples: int, dp_size: int) -> int:
        """How many PPO mini-batches each rank cuts its share into this step (1 if there is no actor update)."""
        if self.config.trainer.critic_warmup > self.global_steps:
            return 1
        mini_batch = self.config.actor_rollout_ref.actor.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n
        if num_samples % mini_batch or mini_batch % dp_size:
            return 1
        return num_samples // mini_batch

    def _balance_batch(self, batch: KVBatchMeta, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        """Pad the batch as verl does, then order it group-aware across ranks and attach the plans.

        verl calls this outside its stage timers; it is timed here as ``timing_s/balance``.
        """
        # verl's fit() sets timing_raw per step; a call outside fit() times into a throwaway dict
        with marked_timer("balance", getattr(self, "timing_raw", {})):
            dp_size = self._actor_dp_size()
            batch = upsample_batch_to_divisible_size(
                batch, self._get_required_batch_multiple(dp_size), self.tokenizer.eos_token_id)
            return self._group_balance(batch, dp_size, metrics, logging_prefix)

    def _group_balance(self, batch: KVBatchMeta, dp_size: int, metrics: dict, logging_prefix: str) -> KVBatchMeta:
        """Reorder ``batch`` (already a multiple of ``dp_size``) group-aware; write plans into it if planning."""
        uids = [str(u) for u in tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                                   select_fields=["uid"])["uid"]]
        prompt_lens = [int(tag["prompt_len"]) for tag in batch.tags]
        response_lens = [int(tag["response_len"]) for tag in batch.tags]
        trees = find_trees(uids, prompt_lens, response_lens)

        plan_round = None
        if self.planner is not None:
            plan_round = next(self._plan_round)
            self.planner.submit(plan_round, {t.tree_id: (t.prompt_len, list(t.response_lens)) for t in trees})

        ranks = balance_groups(uids, prompt_lens, response_lens, dp_size,
                               self._actor_mini_batches(len(uids), dp_size))
        metrics.update(log_seqlen_unbalance(
            seqlen_list=[p + r for p, r in zip(prompt_lens, response_lens)], partitions=ranks, prefix=logging_prefix))
        work = WorkModel(uids, prompt_lens, response_lens)
        rank_work = [work(rank) for rank in ranks]
        metrics.update({"augtree/balance/groups": float(len(set(uids))),
                        "augtree/balance/groups_split": float(split_groups(uids, ranks)),
                        "augtree/balance/work_max_over_mean": max(rank_work) * len(ranks) / sum(rank_work)})

        entries = None
        if self.planner is not None:
            plans = self.planner.fetch(plan_round, [t.tree_id for t in trees])
            entries = plan_entries(trees, plans, len(uids))
            # The client's counters since the last step ("planner/fallbacks", "planner/plans_move_q", ...).
            metrics.update({f"augtree/{k}": v for k, v in self.planner.metrics(reset=True).items()})

        order = [i for rank in ranks for i in rank]
        batch.reorder(order)
        if entries is not None:
            tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                            fields=tu.get_tensordict({PLAN_FIELD: [entries[i] for i in order]}))
        return batch
