"""The ``hf`` rollout's server (a real Ray actor) and its weight-sync adapter, as verl's agent loop and
workers call them."""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM
from verl.workers.config import RolloutConfig

from augtree_verl.cpu_loop.task import TaskConfig, save_model
from augtree_verl.rollout.hf import HFServerAdapter, server_name
from augtree_verl.rollout.hf_server import HFRolloutServer
from augtree_verl.rollout.sampling import SamplingConfig, decode, prefill

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

PROMPT_LENGTH, RESPONSE_LENGTH = 64, 8
PROMPT = list(range(10, 40))
SMALL = TaskConfig(hidden_size=32, num_layers=1, max_positions=1024, max_words=512)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-rollout")
    return (save_model(root / "a", SMALL), save_model(root / "b", TaskConfig(**{**SMALL.__dict__, "seed": 1})))


@pytest.fixture(scope="module")
def server(models):
    ray.init(num_cpus=2, include_dashboard=False)
    config = RolloutConfig(
        name="hf", prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH, tensor_model_parallel_size=1
    )
    handle = (
        ray.remote(HFRolloutServer)
        .options(name=server_name(0), num_cpus=0)
        .remote(config=config, model_config=OmegaConf.create({"path": str(models[0])}), replica_rank=0)
    )
    ray.get(handle.wake_up.remote())
    yield handle
    ray.shutdown()


def _generate(server, prompt=PROMPT, **params):
    return ray.get(
        server.generate.remote(prompt_ids=prompt, sampling_params={"temperature": 1.0, **params}, request_id="r")
    )


def _greedy(model_dir, max_tokens):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return decode(
        model,
        prefill(model, PROMPT),
        SamplingConfig(max_tokens=max_tokens, temperature=0),
        stop_ids=set(),
        generator=torch.Generator(),
    )[0]


def test_generate_answers_the_token_output_contract(server):
    out = _generate(server, logprobs=True)
    assert 1 <= len(out.token_ids) <= RESPONSE_LENGTH and len(out.log_probs) == len(out.token_ids)
    assert out.stop_reason == "completed" and out.extra_fields["global_steps"] == 0
    assert _generate(server).log_probs is None  # only when asked, as vLLM
    assert len(_generate(server, max_tokens=3).token_ids) <= 3


def test_a_groups_requests_differ_and_repeat_after_a_weight_sync(server, models):
    """Requests for one prompt get distinct seeds; the sequence restarts at each weight version."""
    weights = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).state_dict()
    ray.get(server.load_weights.remote(weights, 0))
    group = [_generate(server).token_ids for _ in range(4)]
    assert len({tuple(g) for g in group}) > 1
    ray.get(server.load_weights.remote(weights, 0))
    assert [_generate(server).token_ids for _ in range(4)] == group


def test_adapter_ships_the_actors_weights_and_step(server, models, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    adapter = HFServerAdapter(RolloutConfig(name="hf", tensor_model_parallel_size=1), OmegaConf.create({}), None)
    assert adapter.replica_rank == 0 and adapter.is_leader_rank
    new = AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32).state_dict()
    asyncio.run(adapter.update_weights(iter(new.items()), global_steps=3))
    out = _generate(server, temperature=0)
    assert out.extra_fields["global_steps"] == 3
    assert out.token_ids == _greedy(models[1], len(out.token_ids))
    assert out.token_ids != _greedy(models[0], len(out.token_ids))
    asyncio.run(
        adapter.update_weights(
            iter(AutoModelForCausalLM.from_pretrained(models[0]).state_dict().items()), global_steps=0
        )
    )


def test_incomplete_weights_are_refused(server, models):
    weights = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).state_dict()
    weights.pop("lm_head.weight")
    with pytest.raises(ValueError, match=r"weights missing \['lm_head.weight'\]"):
        ray.get(server.load_weights.remote(weights, 1))


def test_a_prompt_without_room_to_generate_is_refused_as_vllm_does(server):
    with pytest.raises(ValueError, match=r"prompt length \(72\) leaves no room"):
        _generate(server, prompt=list(range(72)))


def test_sampling_it_cannot_apply_is_refused(server):
    with pytest.raises(ValueError, match="repetition_penalty=1.2"):
        _generate(server, repetition_penalty=1.2)


def test_images_for_a_text_model_are_refused(server):
    with pytest.raises(ValueError, match="request img has images but the model has no processor"):
        ray.get(server.generate.remote(prompt_ids=PROMPT, sampling_params={}, request_id="img", image_data=["x"]))
