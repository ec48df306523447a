"""The augtree_sync trainer mode with real Ray, a real TransferQueue and the real planner service, on CPU.

The trainer is built from the GRPO recipe exactly as verl's task runner builds it. Its ``_balance_batch``
runs on rollouts put into the TransferQueue in completion order; what it hands on is read back through
verl's own dispatch path (``kv_batch_meta2batch_meta`` -> ``chunk`` per DP rank -> ``_meta_to_realdata``,
then ``make_iterator`` for the PPO mini-batches), i.e. what each worker receives. Only the actor worker
group (GPU model workers) is absent: ``FixedDPTrainer`` states its data-parallel size instead of asking it.
"""

import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import ray
import torch
import transfer_queue as tq
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.utils import tensordict_utils as tu
from verl.utils.transferqueue_utils import _meta_to_realdata, kv_batch_meta2batch_meta

from augtree_verl.planner.search import plan_tree
from augtree_verl.planner.service import PlannerClient
from augtree_verl.trainer.augtree_sync import AugTreeSyncTrainer
from augtree_verl.plan_field import PLAN_FIELD, group_plan_entries

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = "/work/shared/data/qwen2_5_tokenizer"
PARTITION = "train"
N = 4  # rollout.n: responses per prompt


class FixedDPTrainer(AugTreeSyncTrainer):
    """The trainer with a stated DP size (verl asks its GPU actor worker group, which cannot run here)."""

    dp_size = 2

    def _actor_dp_size(self) -> int:
        return self.dp_size


@pytest.fixture(scope="module")
def ray_tq():
    ray.init(num_cpus=2, include_dashboard=False)
    tq.init(OmegaConf.create({"backend": {"storage_backend": "SimpleStorage",
                                          "SimpleStorage": {"total_storage_size": 4096,
                                                            "num_data_storage_units": 1}}}))
    yield
    tq.close()
    ray.shutdown()


def make_trainer(*overrides, recipe="grpo_augtree"):
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
        config = compose(config_name=recipe, overrides=[
            f"actor_rollout_ref.rollout.n={N}", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "data.train_batch_size=4", "actor_rollout_ref.actor.fsdp_config.cp_degrees=[1,2,4]",
            f"actor_rollout_ref.actor.fsdp_config.planner_name=planner-{uuid.uuid4().hex[:8]}", *overrides])
    trainer = FixedDPTrainer(config)
    trainer.tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    trainer.global_steps = 1
    return trainer


def put_rollouts(groups, seed):
    """Put each group's responses into the TransferQueue in a shuffled completion order, as the agent loop does.

    ``groups``: uid -> (prompt_len, [response_len, ...]). Returns the KVBatchMeta the replay buffer would sample.
    """
    samples = [(uid, s, p, r) for uid, (p, rs) in groups.items() for s, r in enumerate(rs)]
    random.Random(seed).shuffle(samples)
    keys, fields, tags = [], [], []
    for uid, session, p, r in samples:
        prompts, responses = torch.randint(0, 1000, (p,)), torch.randint(0, 1000, (r,))
        input_ids = torch.cat([prompts, responses])
        keys.append(f"{uid}_{session}_0")
        fields.append({"uid": uid, "prompts": prompts, "responses": responses, "input_ids": input_ids,
                       "attention_mask": torch.ones_like(input_ids), "position_ids": torch.arange(p + r),
                       "response_mask": torch.ones_like(responses), "loss_mask": torch.ones_like(responses)})
        tags.append({"status": "success", "prompt_len": p, "response_len": r, "seq_len": p + r, "global_steps": 1})
    tq.kv_batch_put(keys=keys, partition_id=PARTITION, fields=tu.list_of_dict_to_tensordict(fields), tags=tags)
    return tq.KVBatchMeta(partition_id=PARTITION, keys=keys, tags=tags)


def worker_views(batch, dp_size, mini_batch_per_rank):
    """What each DP rank receives (verl's dispatch), and its PPO mini-batches (verl's train_mini_batch cut)."""
    chunks = kv_batch_meta2batch_meta(batch).chunk(dp_size)
    views = [_meta_to_realdata(chunk) for chunk in chunks]
    mini_batches = [list(tu.make_iterator(td, mini_batch_size=mini_batch_per_rank, epochs=1)) for td in views]
    return views, mini_batches


GROUPS = {"long": (3000, [40, 900, 15, 300]), "mid": (700, [800, 20, 60, 1000]), "short": (90, [5, 7, 300, 11])}


@pytest.mark.timeout(300)
def test_groups_stay_whole_per_rank_and_mini_batch_with_verls_padding(ray_tq):
    trainer = make_trainer("actor_rollout_ref.actor.fsdp_config.use_planner=false")
    batch = put_rollouts(GROUPS, seed=0)
    metrics = {}
    balanced = trainer._balance_batch(batch, metrics=metrics)
    # verl pads 12 samples to lcm(dp=2, mini-batch 2 prompts x 4) = 16 with 4 samples of one "pad" uid.
    assert len(balanced) == len(set(balanced.keys)) == 16
    assert set(batch.keys) < set(balanced.keys)
    views, mini_batches = worker_views(balanced, dp_size=2, mini_batch_per_rank=4)
    for rank_mini_batches in mini_batches:
        for mb in rank_mini_batches:
            assert len(set(mb["uid"])) == 1  # one whole group per mini-batch slot
    pad_uid = next(u for td in views for u in td["uid"] if u.startswith("pad"))
    assert sorted(u for td in views for u in td["uid"]) == sorted(
        [uid for uid, (_, rs) in GROUPS.items() for _ in rs] + [pad_uid] * 4)  # every sample exactly once
    for uid in GROUPS:
        assert sum(uid in list(td["uid"]) for td in views) == 1  # on exactly one rank
    assert metrics["augtree/balance/groups_split"] == 0.0
    assert metrics["augtree/balance/groups"] == 4.0
    # verl's own balance metrics are still logged, over the new partition: per-rank token sums
    assert metrics["global_seqlen/min"] + metrics["global_seqlen/minmax_diff"] == metrics["global_seqlen/max"]
    assert PLAN_FIELD not in views[0].keys()  # planner off: no plans in the batch
    tq.kv_clear(keys=balanced.keys, partition_id=PARTITION)


@pytest.mark.timeout(300)
def test_plans_reach_every_worker_with_the_batch_and_survive_a_dead_planner(ray_tq):
    trainer = make_trainer("actor_rollout_ref.actor.fsdp_config.planner_timeout_s=5.0")
    trainer.planner = trainer._start_planner()
    assert isinstance(trainer.planner, PlannerClient)
    # init() starts the planner long before the first step; here, wait until its actor is up.
    ray.get(ray.get_actor(trainer.planner.name).config.remote(), timeout=240)
    groups = {**GROUPS, "rag": (9100, [120, 64, 900, 33])}
    for step in range(2):
        if step == 1:
            ray.kill(ray.get_actor(trainer.planner.name))
        batch = put_rollouts(groups, seed=step)
        metrics = {}
        balanced = trainer._balance_batch(batch, metrics=metrics)
        assert len(balanced) == 16  # 4 groups x 4: no padding needed
        views, _ = worker_views(balanced, dp_size=2, mini_batch_per_rank=4)
        for td in views:
            trees = group_plan_entries(list(td[PLAN_FIELD]))
            uids = list(td["uid"])
            for tree_id, tree in trees.items():
                uid, prompt_len = tree_id.split("|")
                prompt_len = int(prompt_len)
                assert tree.complete and {uids[p] for p in tree.positions} == {uid}
                response_lens = [td["responses"][p].numel() for p in tree.positions]
                assert sorted(response_lens) == sorted(groups[uid][1])
                assert all(td["prompts"][p].numel() == prompt_len for p in tree.positions)
                # the plan is the planner's for this tree, in the response order it was given
                assert tree.plan == plan_tree(prompt_len, response_lens, degrees=(1, 2, 4))
                tree.plan.check_responses(len(tree.positions), tree=tree_id)
        assert sum(len(group_plan_entries(list(td[PLAN_FIELD]))) for td in views) == 4
        assert metrics["augtree/planner/plans"] == 4.0
        assert metrics["augtree/planner/fallbacks"] == (0.0 if step == 0 else 4.0)
        tq.kv_clear(keys=balanced.keys, partition_id=PARTITION)


@pytest.mark.timeout(300)
def test_bad_rollout_lengths_are_a_clear_error(ray_tq):
    trainer = make_trainer("actor_rollout_ref.actor.fsdp_config.use_planner=false")
    batch = put_rollouts({"a": (50, [3, 4, 5, 6]), "b": (60, [1, 2, 3, 4])}, seed=1)
    bad = batch.keys.index("b_2_0")
    batch.tags[bad] = {**batch.tags[bad], "response_len": 0}
    with pytest.raises(ValueError, match=f"sample {bad} of group 'b' has prompt_len=60, response_len=0"):
        trainer._balance_batch(batch, metrics={})
    tq.kv_clear(keys=batch.keys, partition_id=PARTITION)


@pytest.mark.parametrize("recipe", ["grpo_augtree", "dapo_augtree"])
def test_mode_is_verls_sync_trainer_under_its_own_name(recipe):
    trainer = make_trainer(recipe=recipe)
    assert trainer.registered_trainer_mode == "augtree_sync"
    assert trainer.trainer_mode == "sync"
    assert type(trainer.replay_buffer) is ReplayBuffer  # not ReplayBufferAsync
    # DAPO's dynamic sampling reaches verl's sync replay buffer
    assert trainer.replay_buffer.filter_groups_metric == ("reward" if recipe == "dapo_augtree" else None)
    assert trainer.planner is None  # started by init(), before the workers


@pytest.mark.timeout(300)
def test_import_verl_alone_makes_main_ppo_find_the_mode():
    """verl swallows plugin load errors at DEBUG level; prove the entry point works in a fresh interpreter."""
    code = ("import sys, verl\n"
            "assert 'verl.trainer.ppo.v1' not in sys.modules, 'the plugin must not import the trainers eagerly'\n"
            "from verl.trainer.ppo.v1 import get_trainer_cls\n"  # what main_ppo's TaskRunnerV1.run does
            "print(get_trainer_cls('augtree_sync').__qualname__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=280, cwd="/tmp")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "AugTreeSyncTrainer"
