"""PlannerFeedWorker: a real verl TransferQueue agent-loop worker (Ray actor, real TransferQueue) reporting
finished groups to a real planner actor. The LLM is replaced by ``FixedAgentLoop`` (no rollout server runs
on CPU here); everything from verl's ``generate_sequences`` through ``_run_prompt``, the sessions and
``_agent_loop_postprocess`` into the TransferQueue is verl's code.
"""

import shutil
import time
import uuid
from pathlib import Path

import pytest
import ray
import torch
import transfer_queue as tq
from hydra import compose, initialize_config_dir
from tensordict import NonTensorData, NonTensorStack, TensorDict
from transformers import Qwen2Config

from augtree_verl.groups import GroupLengths
from augtree_verl.planner import ClusterProfile
from augtree_verl.planner.service import start_planner_service
from augtree_verl.rollout.agent_loop import OpenGroup, PlannerFeedAgentLoopManager, PlannerFeedWorker

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = str(Path(__file__).resolve().parents[1] / "data" / "qwen2_5_tokenizer")
N = 3
ACTOR_START_TIMEOUT_S = 240


def model_dir(tmp_path) -> str:
    """A model folder as verl's HFModelConfig reads it: a tiny Qwen2 config and the Qwen2.5 tokenizer."""
    path = tmp_path / "model"
    if path.exists():
        return str(path)
    shutil.copytree(TOKENIZER, path)
    Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=151936,
        architectures=["Qwen2ForCausalLM"],
    ).save_pretrained(path)
    return str(path)


def worker_config(tmp_path, planner_name, *overrides):
    loops = tmp_path / "agent_loops.yaml"
    loops.write_text("- name: fixed\n  _target_: tests.rollout.fixed_agent_loop.FixedAgentLoop\n")
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
        return compose(
            config_name="grpo_augtree",
            overrides=[
                f"actor_rollout_ref.model.path={model_dir(tmp_path)}",
                f"actor_rollout_ref.rollout.n={N}",
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
                f"actor_rollout_ref.actor.fsdp_config.planner_name={planner_name}",
                *overrides,
            ],
        )


def prompts(groups, validate=False, leaves=0):
    """The batch verl's trainer hands the agent-loop manager: one row per prompt, with our test fields."""
    uids = list(groups)
    batch = TensorDict({"test_prompt_len": torch.tensor([groups[u][0] for u in uids])}, batch_size=[len(uids)])
    batch["uid"] = NonTensorStack(*uids)
    batch["index"] = NonTensorStack(*range(len(uids)))
    batch["test_response_lens"] = NonTensorStack(*[list(groups[u][1]) for u in uids])
    batch["agent_name"] = NonTensorData("fixed")
    batch["test_leaves"] = NonTensorData(leaves)
    batch["global_steps"] = NonTensorData(1)
    if validate:
        batch["validate"] = NonTensorData(True)
    return batch


def wait_until_settled(uids, partition, timeout_s=120):
    """verl's per-uid status tags once every group is finished or failed."""
    deadline = time.monotonic() + timeout_s
    while True:
        tags = tq.kv_list(partition_id=partition).get(partition, {})
        status = {u: tags.get(u, {}).get("status") for u in uids}
        if all(s in ("finished", "failure") for s in status.values()):
            return status
        assert time.monotonic() < deadline, f"groups not settled: {status}"
        time.sleep(0.2)


def test_group_lengths_report_in_session_then_index_order():
    group = OpenGroup(2)
    assert not group.add(1, [(10, 7), (10, 3)])
    assert group.add(0, [(10, 5)])
    assert group.report() == GroupLengths(10, [5, 7, 3])
    multi = OpenGroup(1)
    multi.add(0, [(10, 5), (15, 4)])
    assert multi.report() is None  # two prompt lengths: two trees, the trainer plans them
    empty = OpenGroup(1)
    empty.add(0, [(10, 5), (10, 0)])
    assert empty.report() is None  # an empty response: no plan takes it (logged, not raised)


def test_manager_runs_the_feed_worker():
    assert PlannerFeedAgentLoopManager.__mro__[1].__name__ == "AgentLoopManagerTQ"
    assert PlannerFeedWorker.__mro__[1].__name__ == "AgentLoopWorkerTQ"


@pytest.mark.timeout(600)
def test_finished_training_groups_reach_the_planner_in_session_order(ray_tq, tmp_path):
    name = f"planner-{uuid.uuid4().hex[:8]}"
    planner = start_planner_service(name, degrees=(1, 2, 4, 8), profile=ClusterProfile.default())
    ray.get(planner.config.remote(), timeout=ACTOR_START_TIMEOUT_S)
    config = worker_config(tmp_path, name)
    worker = ray.remote(PlannerFeedWorker).remote(config, None)
    ok_a, ok_b, failed = (f"{kind}-{uuid.uuid4().hex[:6]}" for kind in ("ok", "ok", "failed"))
    groups = {ok_a: (300, [40, 900, 15]), ok_b: (9100, [120, 64, 33]), failed: (50, [3, 0, 4])}  # one session raises
    ray.get(worker.generate_sequences.remote(prompts(groups)), timeout=ACTOR_START_TIMEOUT_S)
    status = wait_until_settled(list(groups), "train")
    assert [s for s in status.values()] == ["finished", "finished", "failure"]
    val = {f"val-{uuid.uuid4().hex[:6]}": (80, [5] * N)}
    ray.get(worker.generate_sequences.remote(prompts(val, validate=True)), timeout=120)
    wait_until_settled(list(val), "val")

    state = ray.get(planner.state.remote(), timeout=30)
    assert state["reported"] == 2 and state["queue_depth"] == 2  # not the failed group, not validation
    ok = {u: g for u, g in groups.items() if u.startswith("ok")}
    requests = {u: GroupLengths(p, rs) for u, (p, rs) in ok.items()}
    reply = ray.get(planner.take.remote(requests, [], 0.0), timeout=30)  # the lengths exactly as the rollout made them
    assert set(reply["results"]) == set(ok) and all("plan" in r for r in reply["results"].values())
    # the samples the trainer will read carry the same lengths, under keys {uid}_{session}_{index}
    for uid, (p, rs) in ok.items():
        keys = [f"{uid}_{s}_0" for s in range(N)]
        data = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["prompts", "responses"])
        assert [data["responses"][i].numel() for i in range(N)] == rs
        assert all(data["prompts"][i].numel() == p for i in range(N))
    ray.kill(worker)


@pytest.mark.timeout(600)
def test_a_branching_loops_leaves_are_samples_of_their_own_in_leaf_order(ray_tq, tmp_path):
    """A session returning ``Leaves`` (one tree of N leaves in session 0): leaf j becomes the sample of session j,
    and the planner gets the group's lengths in that order."""
    name = f"planner-{uuid.uuid4().hex[:8]}"
    planner = start_planner_service(name, degrees=(1, 2, 4, 8), profile=ClusterProfile.default())
    ray.get(planner.config.remote(), timeout=ACTOR_START_TIMEOUT_S)
    worker = ray.remote(PlannerFeedWorker).remote(worker_config(tmp_path, name), None)
    uid = f"tree-{uuid.uuid4().hex[:6]}"
    ray.get(worker.generate_sequences.remote(prompts({uid: (200, [30] * N)}, leaves=N)), timeout=ACTOR_START_TIMEOUT_S)
    assert wait_until_settled([uid], "train") == {uid: "finished"}
    keys = [f"{uid}_{s}_0" for s in range(N)]
    data = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["responses"])
    assert [data["responses"][i].numel() for i in range(N)] == [30 + j for j in range(N)]
    assert not [
        key for key in tq.kv_list(partition_id="train")["train"] if key.startswith(uid + "_") and key not in keys
    ]
    reply = ray.get(planner.take.remote({uid: GroupLengths(200, [30 + j for j in range(N)])}, [], 0.0), timeout=30)
    assert "plan" in reply["results"][uid]
    ray.kill(worker)


@pytest.mark.timeout(600)
def test_no_planner_no_report_and_the_rollout_still_finishes(ray_tq, tmp_path):
    absent = f"absent-{uuid.uuid4().hex[:8]}"
    worker = ray.remote(PlannerFeedWorker).remote(worker_config(tmp_path, absent), None)
    groups = {f"g-{uuid.uuid4().hex[:6]}": (30, [4, 5, 6])}
    ray.get(worker.generate_sequences.remote(prompts(groups)), timeout=ACTOR_START_TIMEOUT_S)
    assert list(wait_until_settled(list(groups), "train").values()) == ["finished"]
    assert ray.get(worker.__ray_call__.remote(lambda w: w.planner_feed.not_sent), timeout=30) == 1
    off = ray.remote(PlannerFeedWorker).remote(
        worker_config(tmp_path, absent, "actor_rollout_ref.actor.fsdp_config.use_planner=false"), None
    )
    assert ray.get(off.__ray_call__.remote(lambda w: w.planner_feed), timeout=ACTOR_START_TIMEOUT_S) is None
    ray.kill(worker)
    ray.kill(off)
