"""The CPU rollout's decoder against Hugging Face's own greedy decoding, and its seeded sampling."""

import pytest
import torch

from augtree_verl.rollout.sampling import SamplingConfig, decode, prefill
from tests.parity import tiny_model

PROMPT = [5, 17, 42, 8, 99, 3]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-mha").eval()


def _sample(model, config, seed=0, stop_ids=frozenset()):
    """One response with its own prefill of PROMPT."""
    return decode(
        model, prefill(model, PROMPT), config, stop_ids=set(stop_ids), generator=torch.Generator().manual_seed(seed)
    )


def test_greedy_is_hugging_faces_greedy(model):
    tokens, logps = _sample(model, SamplingConfig(max_tokens=12, temperature=0))
    want = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(PROMPT) :].tolist()
    assert tokens == want
    # the log-probs are those of a full forward over prompt + response (position j scores token j + 1)
    full = torch.log_softmax(model(torch.tensor([PROMPT + tokens])).logits[0].float(), -1)
    expected = full[len(PROMPT) - 1 : -1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logps), expected, rtol=0, atol=1e-5)


def _greedy(model, max_tokens=8):
    return _sample(model, SamplingConfig(max_tokens=max_tokens, temperature=0))[0]


def test_top_k_one_is_greedy(model):
    assert _sample(model, SamplingConfig(max_tokens=8, top_k=1))[0] == _greedy(model)


def test_seeded_sampling_is_reproducible_and_seeds_differ(model):
    config = SamplingConfig(max_tokens=16, temperature=1.0)
    assert _sample(model, config, seed=1) == _sample(model, config, seed=1)
    assert _sample(model, config, seed=1)[0] != _sample(model, config, seed=2)[0]


def test_top_p_keeps_the_nucleus(model):
    """With a tiny top_p only the most likely token survives: sampling is greedy."""
    assert _sample(model, SamplingConfig(max_tokens=8, top_p=1e-6))[0] == _greedy(model)


def test_stops_after_a_stop_token_and_keeps_it(model):
    tokens, _ = _sample(model, SamplingConfig(max_tokens=12, temperature=0))
    stop = tokens[3]
    got, logps = _sample(model, SamplingConfig(max_tokens=12, temperature=0), stop_ids={stop})
    assert got == tokens[: tokens.index(stop) + 1] and len(logps) == len(got)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=4, temperature=-1), "temperature"),
        (dict(max_tokens=4, top_p=0), "top_p"),
    ],
)
def test_bad_sampling_knobs_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**bad)


def test_empty_prompt_is_refused(model):
    with pytest.raises(ValueError, match="non-empty prompt"):
        prefill(model, [])


def test_responses_from_one_shared_prefill_are_those_of_a_prefill_each(model):
    """A group's responses decoded from one prefill (each from its own copy of the cache) are, token by token,
    the responses of a prefill per request with the same seeds; decoding leaves the shared prefill as it was."""
    config = SamplingConfig(max_tokens=10, temperature=0.5)  # sharp enough that a wrong context changes tokens
    seeds = range(4)
    each = [_sample(model, config, seed=seed) for seed in seeds]
    shared = prefill(model, PROMPT)
    keys = [layer.keys.clone() for layer in shared.cache.layers]
    got = [
        decode(model, shared, config, stop_ids=set(), generator=torch.Generator().manual_seed(seed)) for seed in seeds
    ]
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in each]
    assert [logps for _, logps in got] == [logps for _, logps in each]
    assert len({tuple(tokens) for tokens, _ in got}) > 1
    assert all(torch.equal(layer.keys, k) for layer, k in zip(shared.cache.layers, keys))
