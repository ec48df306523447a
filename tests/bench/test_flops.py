import pytest

from augtree_verl.bench.flops import ModelShape, flattened_flops, ideal_speedup, reuse_flops
from augtree_verl.bench.workloads import GroupShape
from augtree_verl.models import load_model

SHAPE = ModelShape(layers=2, hidden=8, q_heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)


def test_counts_by_hand():
    # per token: 2 layers * 2 * (8*2*4 + 2*8*1*4 + 2*4*8 + 3*8*16) = 2304; per key visit: 2 * 4 * 2 * 4 = 64;
    # LM head per scored token: 2 * 8 * 10 = 160.
    g = GroupShape("g", prompt_len=3, response_lens=(2,))
    assert flattened_flops(SHAPE, [g]) == 5 * 2304 + 15 * 64 + 2 * 160
    # prompt: 3 tokens, 6 key visits; response feeds 1 token that sees 4 keys; 2 tokens scored.
    assert reuse_flops(SHAPE, [g]) == 3 * 2304 + 6 * 64 + 1 * 2304 + 4 * 64 + 2 * 160


def test_speedup_limits():
    # One response: reuse only skips the never-read last token.
    assert 1.0 < ideal_speedup(SHAPE, [GroupShape("a", 100, (50,))]) < 1.05
    # Prompt-dominated group of G responses: approaches G.
    assert ideal_speedup(SHAPE, [GroupShape("b", 100_000, (2,) * 8)]) == pytest.approx(8, rel=1e-3)


def test_shape_from_builtin_config():
    shape = ModelShape.from_config(load_model("qwen2-small").config)
    assert (shape.layers, shape.hidden, shape.q_heads, shape.kv_heads, shape.head_dim) == (4, 128, 4, 2, 32)
