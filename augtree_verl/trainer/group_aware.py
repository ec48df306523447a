"""What every AugTree trainer mode adds to verl's V1 trainer: a group-aware balance and plans in the batch.

Per balance call (once per step in the sync and colocate_async modes, once per mini-batch in
separate_async) the mixin

1. reads each sample's group (``uid``) and lengths (the rollout's ``prompt_len`` / ``response_len`` tags),
   and puts each tree's samples in the rollout's (session, index) order (from verl's TransferQueue keys
   ``{uid}_{session}_{index}``), the order the rollout workers reported the group's lengths in;
2. orders the batch so each group's samples sit on one data-parallel rank, balanced by estimated work
   with the prompt counted once (``group_balance.balance_groups``);
3. when the actor runs the AugTree engine, plans every tree and writes the plans into the batch as
   ``PLAN_FIELD``, so they reach the workers: with ``use_planner`` it takes the plans the planner service
   made while the rollout ran (groups reported by ``rollout.agent_loop``) and plans the rest here (padding
   rows, unreported groups, lengths that differ from the report); without, it plans every tree here. Either
   way with the engine config's ``cp_degrees`` and ``force_primitive``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import transfer_queue as tq
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.utils import tensordict_utils as tu
from verl.utils.debug import marked_timer
from verl.utils.seqlen_balancing import log_seqlen_unbalance

from augtree_verl.groups import Tree, find_trees
from augtree_verl.integration import verl_compat
from augtree_verl.plan_field import PLAN_FIELD, plan_entries
from augtree_verl.planner.client import PlannerClient
from augtree_verl.planner.profile import ClusterProfile
from augtree_verl.planner.service import start_planner_service
from augtree_verl.planner.startup import RunProfile, published_profile
from augtree_verl.rollout.planner_config import augtree_engine_config
from augtree_verl.trainer.group_balance import WorkModel, balance_groups, split_groups

logger = logging.getLogger(__name__)


def in_rollout_order(tree: Tree, keys: Sequence[str]) -> Tree:
    """``tree`` with its samples sorted by (session, index), read from the keys ``{uid}_{session}_{index}``.

    If a key of the tree has another form, the batch order stays (the planner's report, if any, will not
    match, and the tree is planned by the trainer).
    """
    order = []
    for sample in tree.samples:
        position = verl_compat.tq_session_and_index(keys[sample], tree.uid)
        if position is None:
            return tree
        order.append((position, sample))
    order.sort()
    lens = dict(zip(tree.samples, tree.response_lens))
    samples = tuple(s for _, s in order)
    return dataclasses.replace(tree, samples=samples, response_lens=tuple(lens[s] for s in samples))


class AugTreeTrainerMixin:
    """Mixed in before one of verl's V1 trainers (``class M(AugTreeTrainerMixin, PPOTrainerSync)``).

    verl's PPOTrainer branches on ``self.trainer_mode`` (replay-buffer class, dataloader refill, TransferQueue
    checkpointing) and reads ``trainer.v1.<trainer_mode>`` settings. A mode registered under our name sets
    ``trainer_mode = verl_compat.trainer_mode_as(<the verl mode it extends>)``, which answers that mode to
    those checks and keeps the registered name as ``registered_trainer_mode``.
    """

    # What the mixin reads from verl's trainer (set by verl's __init__/init; declared for the type checker).
    config: Any
    actor_rollout_wg: Any
    tokenizer: Any
    global_steps: int

    def __init__(self, config):
        super().__init__(config)
        self.planner = None
        self.planner_actor = None
        if self.config.actor_rollout_ref.actor.get("shuffle", False):
            logger.warning(
                "actor.shuffle=true reshuffles each rank's samples into PPO mini-batches, so groups the "
                "balance kept in one mini-batch get split and their split CP plans cannot apply"
            )

    def init(self):
        super().init()
        # The workers have made the run's profile (engine initialize); the planner starts with it before the
        # rollout, whose agent-loop workers (created after init()) report to it by name.
        engine_config = augtree_engine_config(self.config)
        if engine_config is not None:
            # The profile the actor's engine made at start-up (``integration.run_profile``), on rank 0.
            published = verl_compat.run_on_rank_zero(self.actor_rollout_wg, published_profile)
            self.planner = self._start_planner(ClusterProfile.from_dict(published["profile"]))
            run = RunProfile(self.planner.profile, published["source"])  # what the planners plan with
            print(f"augtree: {run.describe(engine_config.cp_degrees)}", flush=True)

    def _start_planner(self, profile: ClusterProfile) -> PlannerClient | None:
        """A ``PlannerClient`` planning with ``profile`` when the actor runs the AugTree engine, else None; with
        ``use_planner`` it starts the planner service (same profile) and the client asks it, without it the
        client plans in-process only."""
        engine_config = augtree_engine_config(self.config)
        if engine_config is None:
            return None
        degrees = tuple(engine_config.cp_degrees)
        name = engine_config.planner_name if engine_config.use_planner else None
        if name is not None:
            # Keep the handle: Ray destroys a non-detached named actor once its creator's handles are gone.
            self.planner_actor = start_planner_service(
                name,
                degrees=degrees,
                profile=profile,
                ttl_s=engine_config.planner_ttl_s,
                max_entries=engine_config.planner_max_entries,
                force_primitive=engine_config.force_primitive,
            )
        return PlannerClient(
            name,
            degrees=degrees,
            profile=profile,
            timeout_s=engine_config.planner_timeout_s,
            force_primitive=engine_config.force_primitive,
        )

    def _actor_dp_size(self) -> int:
        """Data-parallel size of the actor worker group (as verl's own ``_balance_batch`` finds it)."""
        return verl_compat.dispatch_dp_size(self.actor_rollout_wg, "actor")

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
            sampled = set(batch.keys)
            batch = upsample_batch_to_divisible_size(
                batch, verl_compat.required_batch_multiple(self, dp_size), self.tokenizer.eos_token_id
            )
            return self._group_balance(batch, dp_size, metrics, logging_prefix, sampled)

    def _group_balance(
        self, batch: KVBatchMeta, dp_size: int, metrics: dict, logging_prefix: str, sampled: set
    ) -> KVBatchMeta:
        """Reorder ``batch`` (already a multiple of ``dp_size``) group-aware; write plans into it if planning.

        ``sampled``: the keys that came from the rollout (the others are verl's padding rows).
        """
        uids = [
            str(u)
            for u in tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["uid"])["uid"]
        ]
        prompt_lens = [int(tag["prompt_len"]) for tag in batch.tags]
        response_lens = [int(tag["response_len"]) for tag in batch.tags]
        trees = [in_rollout_order(t, batch.keys) for t in find_trees(uids, prompt_lens, response_lens)]

        ranks = balance_groups(uids, prompt_lens, response_lens, dp_size, self._actor_mini_batches(len(uids), dp_size))
        metrics.update(
            log_seqlen_unbalance(
                seqlen_list=[p + r for p, r in zip(prompt_lens, response_lens)], partitions=ranks, prefix=logging_prefix
            )
        )
        work = WorkModel(uids, prompt_lens, response_lens)
        rank_work = [work(rank) for rank in ranks]
        metrics.update(
            {
                "augtree/balance/groups": float(len(set(uids))),
                "augtree/balance/groups_split": float(split_groups(uids, ranks)),
                "augtree/balance/work_max_over_mean": max(rank_work) * len(ranks) / sum(rank_work),
            }
        )

        entries = None
        if self.planner is not None:
            trees_per_uid: dict[str, int] = {}
            for t in trees:
                trees_per_uid[t.uid] = trees_per_uid.get(t.uid, 0) + 1
            # The rollout reported whole groups of sampled rows, one prompt length each.
            from_rollout = [
                t.tree_id
                for t in trees
                if trees_per_uid[t.uid] == 1 and all(batch.keys[s] in sampled for s in t.samples)
            ]
            plans = self.planner.plans({t.tree_id: (t.uid, t.lengths) for t in trees}, from_rollout=from_rollout)
            entries = plan_entries(trees, plans, len(uids))
            # The client's counters since the last balance ("planner/plans_from_rollout", ...).
            metrics.update({f"augtree/{k}": v for k, v in self.planner.metrics(reset=True).items()})

        order = [i for rank in ranks for i in rank]
        batch.reorder(order)
        if entries is not None:
            tq.kv_batch_put(
                keys=batch.keys,
                partition_id=batch.partition_id,
                fields=tu.get_tensordict({PLAN_FIELD: [entries[i] for i in order]}),
            )
        return batch
