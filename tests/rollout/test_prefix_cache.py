"""The ``hf`` server's shared prefill of a group's prompt (``PrefixCache``), without Ray: the server object
answers a group's requests with the tokens of a prefill per request, and drops what it no longer needs."""

from __future__ import annotations

import asyncio

import pytest
import torch
from omegaconf import OmegaConf
from verl.workers.config import RolloutConfig

from augtree_verl.cpu_loop.task import TaskConfig, save_model
from augtree_verl.rollout.hf_server import HFRolloutServer, PrefixCache, request_seed
from augtree_verl.rollout.sampling import decode, prefill
from tests.parity import tiny_model

GROUP = 4
PROMPTS = [list(range(10, 40)), list(range(50, 70))]
SMALL = TaskConfig(hidden_size=32, num_layers=1, max_positions=1024, max_words=512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("prefix") / "m", SMALL)


def _server(model_dir, n=GROUP):
    config = RolloutConfig(name="hf", prompt_length=64, response_length=8, tensor_model_parallel_size=1, n=n)
    return HFRolloutServer(config, OmegaConf.create({"path": str(model_dir)}), replica_rank=0)


def _generate(server, prompt):
    return asyncio.run(
        server.generate(prompt_ids=prompt, sampling_params={"temperature": 1.0, "logprobs": True}, request_id="r")
    )


def _own_prefill(server, prompt, global_steps, index):
    """The request's response as a prefill per request gives it (the server's seed for it)."""
    config = server._sampling_config(len(prompt), {"temperature": 1.0})
    seed = request_seed(server.config.seed, global_steps, prompt, index)
    return decode(
        server.model,
        prefill(server.model, prompt),
        config,
        stop_ids=server.stop_ids,
        generator=torch.Generator().manual_seed(seed),
    )


def test_interleaved_groups_get_the_tokens_of_a_prefill_per_request(model_dir):
    server = _server(model_dir)
    order = [0, 1, 0, 0, 1, 1, 0, 1]  # two groups' requests, interleaved as the agent loop's tasks run
    got = {0: [], 1: []}
    for p in order:
        out = _generate(server, PROMPTS[p])
        got[p].append((out.token_ids, out.log_probs))
    for p, responses in got.items():
        want = [_own_prefill(server, PROMPTS[p], 0, i) for i in range(GROUP)]
        assert responses == want  # the tokens and their log-probs, bit for bit
    stats = asyncio.run(server.prefix_cache_stats())
    assert stats == {"misses": 2, "hits": 6, "completed": 2, "entries": 0, "prompts_counted": 2}


def test_new_weights_drop_the_prefills_of_the_old(model_dir):
    server = _server(model_dir)
    _generate(server, PROMPTS[0])
    assert len(server.prefixes) == 1
    weights = {name: torch.randn_like(tensor) for name, tensor in server.model.state_dict().items()}
    asyncio.run(server.load_weights(weights, global_steps=1))
    stats = asyncio.run(server.prefix_cache_stats())
    assert stats["entries"] == 0 and stats["prompts_counted"] == 0
    out = _generate(server, PROMPTS[0])
    assert (out.token_ids, out.log_probs) == _own_prefill(server, PROMPTS[0], 1, 0)


def test_the_least_recently_used_prompt_leaves_beyond_the_bound_and_is_prefilled_again():
    model = tiny_model("llama-mha").eval()
    cache = PrefixCache(max_entries=1, group_size=3)
    first = cache.get(model, PROMPTS[0])
    cache.get(model, PROMPTS[1])  # evicts prompt 0
    again = cache.get(model, PROMPTS[0])  # a miss: prefilled again, the same prefill
    assert dict(cache.counts) == {"misses": 3, "evicted": 2} and len(cache) == 1
    assert torch.equal(first.last_logits, again.last_logits)
    cache.clear()
    assert len(cache) == 0


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(max_entries=0, group_size=2), "max_entries must be at least 1, got 0"),
        (dict(max_entries=2, group_size=0), "group_size must be at least 1, got 0"),
    ],
)
def test_bad_bounds_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        PrefixCache(**bad)
