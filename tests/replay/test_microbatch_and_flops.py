import pytest
from transformers import Qwen2Config

from augtree_verl.replay.flops import ideal_speedup, step_flops
from augtree_verl.replay.microbatch import split_micro_batches


@pytest.mark.parametrize("lengths,budget", [([5, 1, 9, 9, 3], 18), ([1] * 7, 1), ([100, 2], 50), ([4, 4, 4], 1000)])
def test_micro_batches_cover_each_response_once_within_budget(lengths, budget):
    batches = split_micro_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget


def test_micro_batches_group_similar_lengths():
    assert split_micro_batches([2, 10, 3, 9], 20) == [[1, 3], [2, 0]]


def test_flops_reuse_removes_the_repeated_prompt():
    cfg = Qwen2Config(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    # One response: the schedules differ only by the response's last token (not fed in replay).
    assert step_flops(cfg, 50, [10], True) < step_flops(cfg, 50, [10], False)
    assert ideal_speedup(cfg, 50, [10]) == pytest.approx(1.0, abs=0.05)
    # Prompt-dominated groups approach G.
    assert ideal_speedup(cfg, 100_000, [2] * 8) == pytest.approx(8.0, rel=0.01)
