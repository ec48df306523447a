"""``ModelShape.of``: the sizes read from configs that name them differently, and a refusal by name where a size
the replay needs has no name it knows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers as tf

from augtree_verl.model_shape import MLP_FALLBACK_FACTOR, ModelShape


def test_dense_gqa():
    config = tf.Qwen2Config(  # Qwen2.5-7B's shape
        num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944
    )
    shape = ModelShape.of(config)
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads) == (28, 28, 4)
    assert shape.head_dim == shape.value_head_dim == 3584 // 28
    assert shape.mlp_size == 18944
    assert shape.kv_width == 4 * 2 * 128
    # 2 x (QKV + output projections + SwiGLU) per layer: the formula the planner has always used
    h, d = 3584, 128
    assert shape.linear_flops == 28 * (2 * h * (28 + 2 * 4) * d + 2 * 28 * d * h + 6 * h * 18944)
    assert shape.attention_pair_flops == 28 * 4 * 28 * d


def test_multi_head_latent_attention_reads_qk_and_v_widths():
    """DeepSeek-V3's ``head_dim`` is its rope part (64): the query/key width is ``qk_head_dim`` (192)."""
    shape = ModelShape.of(tf.DeepseekV3Config())
    assert (shape.head_dim, shape.value_head_dim) == (192, 128)
    assert shape.kv_width == 128 * (192 + 128)
    assert shape.attention_pair_flops == 61 * 2 * 128 * (192 + 128)
    assert shape.mlp_size == 2048 * 8 + 2048 * 1  # 8 routed experts and the shared one
    # DeepSeek-V2 names no qk_head_dim: its two parts, nope 128 + rope 64
    v2 = ModelShape.of(tf.DeepseekV2Config())
    assert (v2.head_dim, v2.value_head_dim) == (192, 128)


def test_multi_head_latent_attention_without_qk_head_dim():
    """DeepSeek-V2's config keeps only the query/key width's parts: 128 without rope and 64 with it."""
    shape = ModelShape.of(tf.DeepseekV2Config())
    assert (shape.head_dim, shape.value_head_dim) == (128 + 64, 128)


def test_configs_without_intermediate_size():
    assert ModelShape.of(tf.LongcatFlashConfig()).mlp_size > 0
    assert ModelShape.of(tf.OPTConfig()).mlp_size == 3072  # ffn_dim
    gpt2 = tf.GPT2Config()  # n_inner None: 4 x hidden
    assert ModelShape.of(gpt2).mlp_size == MLP_FALLBACK_FACTOR * gpt2.n_embd
    assert ModelShape.of(gpt2).num_layers == gpt2.n_layer


def test_moe_with_shared_expert_width():
    shape = ModelShape.of(tf.Qwen3NextConfig())
    config = tf.Qwen3NextConfig()
    expected = config.moe_intermediate_size * config.num_experts_per_tok + config.shared_expert_intermediate_size
    assert shape.mlp_size == expected
    assert len(shape.linear_layers) == config.layer_types.count("linear_attention") > 0


def test_multimodal_config_reads_its_text_config():
    config = tf.Qwen2_5_VLConfig()
    assert ModelShape.of(config).hidden_size == config.get_text_config(decoder=True).hidden_size


def test_missing_size_is_refused_by_name():
    with pytest.raises(ValueError, match=r"model 'odd' has no heads under a name augtree knows"):
        ModelShape.of(SimpleNamespace(model_type="odd", num_hidden_layers=2, hidden_size=8, vocab_size=10))
