"""The three trainer modes with real Ray, a real TransferQueue and the real planner service, on CPU.

Each trainer is built from the GRPO recipe exactly as verl's task runner builds it. Its ``_balance_batch``
runs on rollouts put into the TransferQueue in completion order; what it hands on is read back through
verl's own dispatch path (``kv_batch_meta2batch_meta`` -> ``chunk`` per DP rank -> ``_meta_to_realdata``,
then ``make_iterator`` for the PPO mini-batches), i.e. what each worker receives. Only the actor worker
group (GPU model workers) is absent: ``fixed_dp`` states its data-parallel size instead of asking it. The
rollout workers' reports reach the planner through the same ``PlannerFeed`` they use
(``tests/rollout`` runs the worker itself).
"""

import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import ray
import torch
import transfer_queue as tq
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import load_class_from_fqn
from verl.utils.transferqueue_utils import _meta_to_realdata, kv_batch_meta2batch_meta
from verl.workers.config import RolloutConfig

from augtree_verl.groups import GroupLengths, find_trees
from augtree_verl.plan_field import PLAN_FIELD, group_plan_entries
from augtree_verl.planner import ClusterProfile
from augtree_verl.planner.client import PlannerClient
from augtree_verl.planner.feed import PlannerFeed
from augtree_verl.planner.search import plan_tree
from augtree_verl.rollout.agent_loop import PlannerFeedAgentLoopManager
from augtree_verl.trainer.augtree_async import AugTreeColocateAsyncTrainer, AugTreeSeparateAsyncTrainer
from augtree_verl.trainer.augtree_sync import AugTreeSyncTrainer
from augtree_verl.trainer.group_aware import in_rollout_order

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = str(Path(__file__).resolve().parents[1] / "data" / "qwen2_5_tokenizer")
PARTITION = "train"
N = 4  # rollout.n: responses per prompt
PROFILE = ClusterProfile.default()  # what the workers would publish (here, plan_tree's default)


MODES = {
    "augtree_sync": (AugTreeSyncTrainer, "sync", ReplayBuffer),
    "augtree_colocate_async": (AugTreeColocateAsyncTrainer, "colocate_async", ReplayBufferAsync),
    "augtree_separate_async": (AugTreeSeparateAsyncTrainer, "separate_async", ReplayBufferAsync),
}
# What verl's separate_async asserts at construction: train_batch_size = parameter_sync_step x mini-batch,
# a standalone rollout pool, a non-naive checkpoint engine (never started here).
SEPARATE_ASYNC = [
    "trainer.v1.separate_async.parameter_sync_step=2",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
]


def fixed_dp(trainer_cls, dp_size=2):
    """The trainer with a stated DP size (verl asks its GPU actor worker group, which cannot run here)."""
    return type(f"FixedDP{trainer_cls.__name__}", (trainer_cls,), {"_actor_dp_size": lambda self: dp_size})


def make_trainer(*overrides, recipe="grpo_augtree", mode="augtree_sync"):
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
        config = compose(
            config_name=recipe,
            overrides=[
                f"actor_rollout_ref.rollout.n={N}",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "data.train_batch_size=4",
                "actor_rollout_ref.actor.fsdp_config.cp_degrees=[1,2,4]",
                f"actor_rollout_ref.actor.fsdp_config.planner_name=planner-{uuid.uuid4().hex[:8]}",
                f"trainer.v1.trainer_mode={mode}",
                *(SEPARATE_ASYNC if mode == "augtree_separate_async" else []),
                *overrides,
            ],
        )
    trainer = fixed_dp(MODES[mode][0])(config)
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
        fields.append(
            {
                "uid": uid,
                "prompts": prompts,
                "responses": responses,
                "input_ids": input_ids,
                "attention_mask": torch.ones_like(input_ids),
                "position_ids": torch.arange(p + r),
                "response_mask": torch.ones_like(responses),
                "loss_mask": torch.ones_like(responses),
            }
        )
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
        [uid for uid, (_, rs) in GROUPS.items() for _ in rs] + [pad_uid] * 4
    )  # every sample exactly once
    for uid in GROUPS:
        assert sum(uid in list(td["uid"]) for td in views) == 1  # on exactly one rank
    assert metrics["augtree/balance/groups_split"] == 0.0
    assert metrics["augtree/balance/groups"] == 4.0
    # verl's own balance metrics are still logged, over the new partition: per-rank token sums
    assert metrics["global_seqlen/min"] + metrics["global_seqlen/minmax_diff"] == metrics["global_seqlen/max"]
    assert PLAN_FIELD not in views[0].keys()  # no planner started (init() did not run): no plans in the batch
    tq.kv_clear(keys=balanced.keys, partition_id=PARTITION)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", list(MODES))
def test_plans_made_during_the_rollout_reach_every_worker_and_survive_a_dead_planner(ray_tq, mode):
    trainer = make_trainer(
        "actor_rollout_ref.actor.fsdp_config.planner_timeout_s=30.0",
        "actor_rollout_ref.actor.fsdp_config.planner_ttl_s=1800.0",
        "actor_rollout_ref.actor.fsdp_config.planner_max_entries=4096",
        mode=mode,
    )
    trainer.planner = trainer._start_planner(PROFILE)
    assert isinstance(trainer.planner, PlannerClient)
    # init() starts the planner long before the first step; here, wait until its actor is up.
    config = ray.get(ray.get_actor(trainer.planner.name).config.remote(), timeout=240)
    assert (config["ttl_s"], config["max_entries"]) == (1800.0, 4096)  # the engine config's bounds reach it
    feed = PlannerFeed(trainer.planner.name)
    groups = {**GROUPS, "rag": (9100, [120, 64, 900, 33])}
    for step in range(2):
        uids = {name: f"{name}-{step}" for name in groups}  # verl's uids are fresh each step
        step_groups = {uids[name]: group for name, group in groups.items()}
        if step == 1:
            ray.kill(ray.get_actor(trainer.planner.name))
        for uid, (p, rs) in step_groups.items():  # reported as each group finishes
            feed.report(uid, GroupLengths(p, rs))
        if step == 0:
            wait_for_reports(trainer.planner.name, len(step_groups))
        batch = put_rollouts(step_groups, seed=step)
        metrics = {}
        balanced = trainer._balance_batch(batch, metrics=metrics)
        assert len(balanced) == 16  # 4 groups x 4: no padding needed
        views, _ = worker_views(balanced, dp_size=2, mini_batch_per_rank=4)
        for td in views:
            trees = group_plan_entries(list(td[PLAN_FIELD]))
            uids_here = list(td["uid"])
            for tree_id, tree in trees.items():
                uid, prompt_len = tree_id.split("|")
                prompt_len = int(prompt_len)
                assert tree.complete and {uids_here[p] for p in tree.positions} == {uid}
                # response i of the plan is session i of the rollout, wherever the batch put it
                response_lens = [td["responses"][p].numel() for p in tree.positions]
                assert response_lens == step_groups[uid][1]
                assert all(td["prompts"][p].numel() == prompt_len for p in tree.positions)
                assert tree.plan == plan_tree(prompt_len, response_lens, degrees=(1, 2, 4))
                tree.plan.check_responses(len(tree.positions), tree=tree_id)
        assert sum(len(group_plan_entries(list(td[PLAN_FIELD]))) for td in views) == 4
        assert metrics["augtree/planner/plans"] == 4.0
        if step == 0:
            assert metrics["augtree/planner/plans_from_rollout"] == 4.0
            assert metrics["augtree/planner/plans_in_process"] == 0.0
            assert metrics["augtree/planner/queue_depth"] == 0.0
        else:
            assert metrics["augtree/planner/plans_in_process"] == 4.0
            assert metrics["augtree/planner/unreachable"] == 1.0
        assert metrics["augtree/planner/plan_wait_s"] < 30.0
        tq.kv_clear(keys=balanced.keys, partition_id=PARTITION)


def batch_plans(balanced):
    """tree_id -> (Plan, response lengths in the plan's order) over what every worker receives."""
    views, _ = worker_views(balanced, dp_size=2, mini_batch_per_rank=4)
    return {
        tree_id: (tree.plan, [td["responses"][p].numel() for p in tree.positions])
        for td in views
        for tree_id, tree in group_plan_entries(list(td[PLAN_FIELD])).items()
    }


# One group the planner splits over CP ranks (MoveQ, degree 4 of (1, 2, 4)) besides the one-device ones.
CP_GROUPS = {**GROUPS, "rag": (9100, [120, 64, 900, 33])}


@pytest.mark.timeout(300)
def test_use_planner_false_plans_every_group_in_process_without_a_service(ray_tq):
    trainer = make_trainer("actor_rollout_ref.actor.fsdp_config.use_planner=false")
    trainer.planner = trainer._start_planner(PROFILE)
    name = trainer.config.actor_rollout_ref.actor.fsdp_config.planner_name
    assert isinstance(trainer.planner, PlannerClient) and trainer.planner_actor is None
    with pytest.raises(ValueError):
        ray.get_actor(name)  # no planner service was started
    batch = put_rollouts(CP_GROUPS, seed=4)
    metrics = {}
    balanced = trainer._balance_batch(batch, metrics=metrics)
    plans = batch_plans(balanced)
    assert len(plans) == 4
    for tree_id, (plan, response_lens) in plans.items():  # the same planner, CP plans included
        assert plan == plan_tree(int(tree_id.split("|")[1]), response_lens, degrees=(1, 2, 4))
    assert max(plan.degree for plan, _ in plans.values()) == 4
    assert metrics["augtree/planner/plans_in_process"] == 4.0
    assert metrics["augtree/planner/plans_from_rollout"] == metrics["augtree/planner/unreachable"] == 0.0
    tq.kv_clear(keys=balanced.keys, partition_id=PARTITION)


@pytest.mark.timeout(300)
def test_force_primitive_pins_the_plans_of_the_service_and_of_the_trainer(ray_tq):
    trainer = make_trainer(
        "actor_rollout_ref.actor.fsdp_config.force_primitive=ring",
        "actor_rollout_ref.actor.fsdp_config.planner_timeout_s=30.0",
    )
    trainer.planner = trainer._start_planner(PROFILE)
    config = ray.get(ray.get_actor(trainer.planner.name).config.remote(), timeout=240)
    assert config["force_primitive"] == "ring"
    feed = PlannerFeed(trainer.planner.name)
    for uid in ("long", "mid"):  # planned by the service; "short" and padding here
        feed.report(uid, GroupLengths(*GROUPS[uid]))
    wait_for_reports(trainer.planner.name, 2)
    batch = put_rollouts(GROUPS, seed=5)
    metrics = {}
    balanced = trainer._balance_batch(batch, metrics=metrics)
    plans = batch_plans(balanced)
    assert len(plans) == 4
    for tree_id, (plan, response_lens) in plans.items():
        prompt_len = int(tree_id.split("|")[1])
        assert plan == plan_tree(prompt_len, response_lens, degrees=(1, 2, 4), force_primitive="ring"), tree_id
    # the planner left alone would choose otherwise for these groups
    assert all(plan_tree(p, rs, degrees=(1, 2, 4)).primitive != "ring" for p, rs in GROUPS.values())
    assert metrics["augtree/planner/plans_from_rollout"] == 2.0 and metrics["augtree/planner/plans_in_process"] == 2.0
    assert metrics["augtree/planner/plans_ring"] == 4.0
    tq.kv_clear(keys=balanced.keys, partition_id=PARTITION)


class SlowPlanner:
    """A planner actor that never answers in time."""

    async def config(self):
        import asyncio

        await asyncio.sleep(120)


@pytest.mark.timeout(300)
def test_planner_timeout_s_bounds_the_trainers_wait_for_the_service(ray_tq):
    trainer = make_trainer("actor_rollout_ref.actor.fsdp_config.planner_timeout_s=0.5")
    name = trainer.config.actor_rollout_ref.actor.fsdp_config.planner_name
    slow = ray.remote(SlowPlanner).options(name=name, num_cpus=0).remote()
    ray.get(slow.__ray_ready__.remote(), timeout=240)
    trainer.planner = trainer._start_planner(PROFILE)  # finds the slow actor under the name
    batch = put_rollouts(GROUPS, seed=6)
    metrics = {}
    balanced = trainer._balance_batch(batch, metrics=metrics)
    assert len(batch_plans(balanced)) == 4  # all planned by the trainer
    assert metrics["augtree/planner/unreachable"] == 1.0 and metrics["augtree/planner/plans_in_process"] == 4.0
    # waited the configured 0.5 s (the default is 2 s), then planned in-process
    assert 0.5 <= metrics["augtree/planner/plan_wait_s"] < 1.5
    ray.kill(slow)
    tq.kv_clear(keys=balanced.keys, partition_id=PARTITION)


def wait_for_reports(name, count, timeout_s=60):
    actor = ray.get_actor(name)
    deadline = time.monotonic() + timeout_s
    while ray.get(actor.state.remote(), timeout=30)["reported"] < count:
        assert time.monotonic() < deadline, "the planner did not receive the reports"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_padding_rows_and_unreported_groups_are_planned_by_the_trainer(ray_tq):
    trainer = make_trainer("actor_rollout_ref.actor.fsdp_config.planner_timeout_s=30.0")
    trainer.planner = trainer._start_planner(PROFILE)
    ray.get(ray.get_actor(trainer.planner.name).config.remote(), timeout=240)
    feed = PlannerFeed(trainer.planner.name)
    feed.report("long", GroupLengths(*GROUPS["long"]))
    feed.report("mid", GroupLengths(700, [800, 20, 60]))  # one sample of "mid" failed after the report
    wait_for_reports(trainer.planner.name, 2)
    batch = put_rollouts(GROUPS, seed=3)  # "short" was never reported
    metrics = {}
    balanced = trainer._balance_batch(batch, metrics=metrics)
    assert len(balanced) == 16  # 12 + 4 padding rows
    views, _ = worker_views(balanced, dp_size=2, mini_batch_per_rank=4)
    planned = {t: tree for td in views for t, tree in group_plan_entries(list(td[PLAN_FIELD])).items()}
    assert len(planned) == 4 and all(tree.complete for tree in planned.values())
    assert metrics["augtree/planner/plans_from_rollout"] == 1.0  # "long"
    assert metrics["augtree/planner/plans_in_process"] == 3.0  # "mid" (lengths differ), "short", padding
    assert metrics["augtree/planner/mismatched"] == 1.0 and metrics["augtree/planner/missing"] == 1.0
    tq.kv_clear(keys=balanced.keys, partition_id=PARTITION)


def test_trees_follow_the_rollouts_session_order_whatever_the_batch_order():
    keys = ["u_2_0", "v_0_0", "u_0_0", "u_1_1", "u_1_0", "v_1_0"]
    uids = [k.split("_")[0] for k in keys]
    lens = [30, 7, 10, 21, 20, 8]
    trees = {t.uid: in_rollout_order(t, keys) for t in find_trees(uids, [100] * 6, lens)}
    assert trees["u"].samples == (2, 4, 3, 0) and trees["u"].response_lens == (10, 20, 21, 30)
    assert trees["v"].samples == (1, 5)
    odd = find_trees(["w", "w"], [5, 5], [1, 2])[0]
    assert in_rollout_order(odd, ["w_x_0", "w_0_0"]) == odd  # not verl's key form: batch order stays


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
@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_is_verls_trainer_under_its_own_name(recipe, mode):
    trainer = make_trainer(recipe=recipe, mode=mode)
    _, verl_mode, replay_buffer = MODES[mode]
    assert trainer.registered_trainer_mode == mode
    assert trainer.trainer_mode == verl_mode
    assert type(trainer.replay_buffer) is replay_buffer
    # DAPO's dynamic sampling reaches verl's replay buffer
    assert trainer.replay_buffer.filter_groups_metric == ("reward" if recipe == "dapo_augtree" else None)
    assert trainer.planner is None  # started by init(), before the workers
    if mode == "augtree_separate_async":
        assert trainer.parameter_sync_step == 2  # read from trainer.v1.separate_async


@pytest.mark.timeout(300)
def test_import_verl_alone_makes_main_ppo_find_the_mode():
    """verl swallows plugin load errors at DEBUG level; prove the entry point works in a fresh interpreter."""
    code = (
        "import sys, verl\n"
        "assert 'verl.trainer.ppo.v1' not in sys.modules, 'the plugin must not import the trainers eagerly'\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"  # what main_ppo's TaskRunnerV1.run does
        "print(*(get_trainer_cls(m).__qualname__ for m in ('augtree_sync', 'augtree_colocate_async',\n"
        "                                                  'augtree_separate_async')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=280, cwd="/tmp")
    assert out.returncode == 0, out.stderr[-2000:]
    assert (
        out.stdout.strip().splitlines()[-1]
        == "AugTreeSyncTrainer AugTreeColocateAsyncTrainer AugTreeSeparateAsyncTrainer"
    )


@pytest.mark.timeout(300)
def test_separate_asyncs_actor_worker_accepts_strategy_augtree_in_a_fresh_interpreter():
    """verl's DetachActorWorker saves/restores the actor on the CPU by strategy; augtree gets FSDP2's handlers."""
    code = (
        "import verl\n"
        "from omegaconf import OmegaConf\n"
        "from verl.experimental.separation.engine_workers import DetachActorWorker\n"
        "from verl.utils import fsdp_utils\n"
        "def handlers(strategy):\n"
        "    worker = object.__new__(DetachActorWorker)\n"  # its __init__ builds the model: not needed here
        "    worker.config, worker._strategy_handlers = OmegaConf.create({'actor': {'strategy': strategy}}), None\n"
        "    return worker._get_strategy_handlers()\n"
        "assert handlers('augtree') == (fsdp_utils.fsdp2_sharded_save_to_cpu,\n"
        "                               fsdp_utils.fsdp2_sharded_load_from_cpu)\n"
        "assert handlers('fsdp2') == handlers('augtree')\n"
        "try:\n"
        "    handlers('unknown')\n"
        "except NotImplementedError as err:\n"
        "    print('refused', err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=280, cwd="/tmp")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "refused Unsupported strategy: unknown"


@pytest.mark.parametrize("recipe", ["grpo_augtree", "dapo_augtree"])
def test_recipes_run_the_planner_feed_agent_loop_manager(recipe):
    rollout = make_trainer(recipe=recipe).config.actor_rollout_ref.rollout
    # what main_ppo's init_agent_loop_manager does with the key
    assert (
        load_class_from_fqn(rollout.agent.agent_loop_manager_class, "AgentLoopManager") is PlannerFeedAgentLoopManager
    )
    assert isinstance(omega_conf_to_dataclass(rollout), RolloutConfig)  # the rollout config accepts the key
