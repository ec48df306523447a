"""Attention features the replay kernels do not implement are refused with the model, layer and feature named,
on real transformers models (tiny random configs): Gemma2's logit soft-capping, gpt-oss's attention sinks,
attention dropout in training mode, sliding windows."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM, Qwen2Config, Qwen2ForCausalLM

from augtree_verl import StepPlan, Tree, per_response, replay

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


def _trees():
    g = torch.Generator().manual_seed(0)
    return [Tree.of_tokens(torch.randint(0, 64, (6,), generator=g), [torch.randint(0, 64, (3,), generator=g)])]


def _loss(t, i, logp):
    return -logp.mean()


@pytest.mark.parametrize(
    "model,train,match",
    [
        (
            lambda: Gemma2ForCausalLM(Gemma2Config(**TINY, attn_logit_softcapping=50.0, sliding_window=4)),
            False,
            r"model 'gemma2', layer 0: .*logit soft-capping \(softcap=50.0\).*sliding-window attention",
        ),
        (
            lambda: GptOssForCausalLM(
                GptOssConfig(**TINY, num_local_experts=2, num_experts_per_tok=1, sliding_window=4)
            ),
            False,
            r"model 'gpt_oss', layer 0: .*attention sinks \(s_aux=tensor \(4,\)\)",
        ),
        (
            lambda: Qwen2ForCausalLM(Qwen2Config(**TINY, attention_dropout=0.1)),
            True,
            r"model 'qwen2', layer 0: .*attention dropout \(dropout=0.1\)",
        ),
        (
            lambda: Qwen2ForCausalLM(
                Qwen2Config(**TINY, use_sliding_window=True, sliding_window=4, max_window_layers=0)
            ),
            False,
            r"model 'qwen2', layer 0: .*sliding-window attention \(sliding_window=4\)",
        ),
    ],
)
def test_unsupported_attention_features_are_refused(model, train, match):
    torch.manual_seed(0)
    m = model().train(train)
    with pytest.raises(ValueError, match=match):
        replay(m, StepPlan.build(_trees()), per_response(_loss))


def test_plain_qwen2_in_training_mode_replays():
    m = Qwen2ForCausalLM(Qwen2Config(**TINY)).train()  # attention_dropout 0.0: dropout=0.0 is not a feature
    assert replay(m, StepPlan.build(_trees()), per_response(_loss))[0][0].shape == (3,)
