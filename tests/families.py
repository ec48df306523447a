"""The family matrix: one tiny random model per Hugging Face family the README lists (built from config
classes, no download), each with the feature values that make its family-specific code change the result.

``PARITY`` families replay exactly (log-probs and gradients against the flattened baseline, and for the ones
``tests/integration/test_engine_families.py`` picks, against verl's stock engine) and pass the start-up
probe; ``REFUSED`` families are refused by name at engine build (``replay.model_check``), with the match the
refusal's message must contain.

Random tiny models have small logits (|logit| ~ 0.1), so each family's logit transform is set where it
changes them visibly: Granite's ``logits_scaling`` 0.25 and Cohere's ``logit_scale`` 4 scale them 4x,
Gemma's ``final_logit_softcapping`` 0.1 caps them hard (the released configs' values, 16, 0.0625 and 30,
act the same way on a trained model's logits of magnitude ~10-30).
"""

from __future__ import annotations

import torch
import transformers as tf

from augtree_verl.models import slow_linear_decay

VOCAB = 128
_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_FULL = dict(layer_types=["full_attention"] * 2)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_LINEAR = dict(
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    layer_types=["linear_attention", "full_attention"],
)
# Multi-head latent attention: q/k of width D_k = qk_nope + qk_rope = 8 + 4 = 12 (D_v = 8) or 4 + 4 = 8 (D_v = 12),
# through low-rank K/V (and query) projections; K/V are expanded to every query head, as in the released configs
# (num_key_value_heads = num_attention_heads). One dense layer, then an MoE layer with a shared expert.
_MLA = dict(
    num_key_value_heads=4, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16
)
_MLA_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)
_MLA_V3 = dict(**_MLA, **_MLA_MOE, first_k_dense_replace=1, n_group=1, topk_group=1)
# Mistral 4's YaRN with its Llama-4 query scaling 1 + beta log(1 + floor(position / original)): an original context
# of 8 scales the queries of every position from 8 on, which the responses reach only with their true positions.
_MISTRAL4_ROPE = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=64.0,
    original_max_position_embeddings=8,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale_all_dim=1.0,
    mscale=1.0,
    llama_4_scaling_beta=0.1,
    partial_rotary_factor=0.5,
)

# Vision-language checkpoints (text-only rows): the matrix's text shape goes into ``text_config``, a one-block vision
# tower beside it. M-RoPE sections of the 4 frequency pairs of head_dim 8 (text-only rows have equal positions on
# every axis, so the split changes nothing but must fit the head).
_MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1])
_VISION_2 = dict(depth=1, embed_dim=32, num_heads=4, hidden_size=32)  # Qwen2-VL: merged to hidden_size
_VISION_25 = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, fullatt_block_indexes=[0]
)
# Qwen3-VL's and Qwen3.5's tower; Qwen3-VL also injects the deepstack merger of block 0 into the first layers
_VISION_3 = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, num_position_embeddings=64
)
_DEEPSTACK = dict(deepstack_visual_indexes=[0])


# Their special tokens inside the matrix's vocabulary (the released ids lie beyond it); text rows never draw them
# (``IMAGE_TOKEN`` and above: ``tests/integration/test_engine_images.py``)
IMAGE_TOKEN = 120
_VLM_TOKENS = dict(image_token_id=IMAGE_TOKEN, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)


def _vlm(vision: dict, **text) -> dict:
    return dict(text_config={"head_dim": 8, "rope_parameters": _MROPE, **text}, vision_config=vision, **_VLM_TOKENS)


ABSENT = object()  # a family's kwarg of this value drops that size of ``_SHAPE``: its config has no such attribute

# Phi-3's longrope: short factors up to original_max_position_embeddings, long ones beyond (``replay.rope``), the
# threshold small enough that the matrix's trees and the probe cross it; factors far apart, so a row computed in the
# wrong regime is off by far more than rounding.
_LONGROPE = dict(
    original_max_position_embeddings=12,
    rope_parameters=dict(
        rope_type="longrope",
        rope_theta=10000.0,
        original_max_position_embeddings=12,
        short_factor=[1.0, 1.2, 1.5, 2.0],
        long_factor=[3.0, 5.0, 8.0, 13.0],
    ),
)

# name: (config class, model class, config kwargs)
PARITY = {
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=8)),
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "llama-tied": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3-moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(head_dim=8, **_MOE)),
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, {}),
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, dict(logits_scaling=0.25)),
    "cohere": (tf.CohereConfig, tf.CohereForCausalLM, dict(logit_scale=4.0, tie_word_embeddings=True)),
    # Gemma2/3 with every layer full attention and no attention soft-capping: their final soft-capping,
    # embedding scale and (Gemma3) query scalar are all in the replay's path.
    "gemma2": (
        tf.Gemma2Config,
        tf.Gemma2ForCausalLM,
        dict(head_dim=8, final_logit_softcapping=0.1, attn_logit_softcapping=None, **_FULL),
    ),
    "gemma3": (
        tf.Gemma3TextConfig,
        tf.Gemma3ForCausalLM,
        dict(head_dim=8, final_logit_softcapping=0.1, query_pre_attn_scalar=8, **_FULL),
    ),
    "mistral-no-window": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=None)),
    # Hybrid Gated DeltaNet + attention: the prompt's per-layer state is K/V or (conv window, recurrent state)
    "qwen3.5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM, dict(_LINEAR)),
    "qwen3.5-moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM, dict(**_LINEAR, **_MOE)),
    "qwen3-next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, dict(**_LINEAR, **_MOE)),
    # Multi-head latent attention, value width apart from the query/key width (D_v < D_k but Mistral 4's D_v > D_k)
    "deepseek-v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, dict(**_MLA, **_MLA_MOE, first_k_dense_replace=1)),
    "deepseek-v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, _MLA_V3),
    "mistral4": (
        tf.Mistral4Config,
        tf.Mistral4ForCausalLM,
        dict(_MLA_V3, qk_nope_head_dim=4, v_head_dim=12, rope_parameters=_MISTRAL4_ROPE),
    ),
    # LongCat-Flash: two attention sublayers per layer (num_layers 1: 2 attention layers), no intermediate_size
    # (ffn_hidden_size), zero-computation experts among the routed ones, LoRA scales sqrt(hidden / rank) of 2 (q)
    # and sqrt(2) (kv); its head_dim is the rope part. Its router's float32 gradient is the worst conditioned of
    # the matrix: over seeds the flattened baseline itself lies up to 1e-5 of it from float64 (as far as the
    # replay does; in float64 throughout both agree to 1e-14), so this seed's 3e-6 is the margin under RTOL.
    "longcat-flash": (
        tf.LongcatFlashConfig,
        tf.LongcatFlashForCausalLM,
        dict(
            _MLA,
            q_lora_rank=8,
            num_layers=1,
            head_dim=4,
            intermediate_size=ABSENT,
            ffn_hidden_size=64,
            expert_ffn_hidden_size=32,
            n_routed_experts=4,
            zero_expert_num=2,
            moe_topk=2,
        ),
    ),
    "phi3-longrope": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(_LONGROPE)),
    # Vision-language checkpoints on text-only rows (``replay.vlm``): the text decoder and LM head, M-RoPE
    "qwen2-vl": (tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration, _vlm(_VISION_2)),
    "qwen2.5-vl": (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration, _vlm(_VISION_25)),
    "qwen3-vl": (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration, _vlm(dict(_VISION_3, **_DEEPSTACK))),
    "qwen3-vl-moe": (
        tf.Qwen3VLMoeConfig,
        tf.Qwen3VLMoeForConditionalGeneration,
        _vlm(dict(_VISION_3, **_DEEPSTACK), **_MOE),
    ),
    "qwen3.5-vl": (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration, _vlm(_VISION_3, **_LINEAR)),
    "qwen3.5-moe-vl": (
        tf.Qwen3_5MoeConfig,
        tf.Qwen3_5MoeForConditionalGeneration,
        _vlm(_VISION_3, **_LINEAR, **_MOE),
    ),
}
REFUSED = {
    "gemma2-default": (
        tf.Gemma2Config,
        tf.Gemma2ForCausalLM,
        dict(head_dim=8, sliding_window=4),
        r"'gemma2'.*layer 0.*(logit soft-capping|sliding-window)",
    ),
    "gemma3-sliding": (
        tf.Gemma3TextConfig,
        tf.Gemma3ForCausalLM,
        dict(head_dim=8, sliding_window=4),
        r"'gemma3_text'.*sliding-window attention",
    ),
    "mistral-window": (
        tf.MistralConfig,
        tf.MistralForCausalLM,
        dict(sliding_window=4),
        r"'mistral'.*sliding-window attention",
    ),
    "qwen2-window": (
        tf.Qwen2Config,
        tf.Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=0),
        r"'qwen2'.*sliding-window attention",
    ),
    "gpt-oss": (
        tf.GptOssConfig,
        tf.GptOssForCausalLM,
        dict(head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=4, attn_implementation="eager"),
        r"'gpt_oss'.*attention sinks",
    ),
    "olmo-hybrid": (
        tf.OlmoHybridConfig,
        tf.OlmoHybridForCausalLM,
        dict(_LINEAR),
        r"'olmo_hybrid'.*layer 0: linear attention outside Qwen3NextGatedDeltaNet.*'linear_attention'",
    ),
    # attention modules that never call transformers' attention interface (ALiBi, own kernels)
    "falcon": (
        tf.FalconConfig,
        tf.FalconForCausalLM,
        {},
        r"'falcon'.*layers 0-1: attention outside transformers' attention interface .*FalconAttention",
    ),
    "mpt": (
        tf.MptConfig,
        tf.MptForCausalLM,
        dict(d_model=32, n_heads=4, n_layers=2, attn_implementation="eager"),
        r"'mpt'.*layers 0-1: attention outside transformers' attention interface .*MptAttention",
    ),
    # Llama 4's text model: get_decoder() returns the causal LM itself; chunked attention layers
    "llama4-text": (
        tf.Llama4TextConfig,
        tf.Llama4ForCausalLM,
        dict(
            head_dim=8,
            num_local_experts=2,
            intermediate_size_mlp=64,
            no_rope_layers=[1, 1],
            attention_chunk_size=8,
            layer_types=["chunked_attention", "full_attention"],
        ),
        r"'llama4_text'.*get_decoder\(\) returns the model itself.*layer 0: chunked attention .*attention_chunk_size=8",
    ),
    "gemma4-kv-sharing": (
        tf.Gemma4TextConfig,
        tf.Gemma4ForCausalLM,
        dict(head_dim=8, global_head_dim=8, num_kv_shared_layers=1, **_FULL),
        r"'gemma4_text'.*layer 1: K/V shared across layers .*num_kv_shared_layers=1",
    ),
    # DeepSeek sparse attention: an indexer keeps the top index_topk keys of each query
    "glm-moe-dsa": (
        tf.GlmMoeDsaConfig,
        tf.GlmMoeDsaForCausalLM,
        dict(
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            index_topk=4,
            index_head_dim=8,
            index_n_heads=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
        r"'glm_moe_dsa'.*layers 0-1: per-query key selection .*index_topk=4",
    ),
    # dynamic NTK: frequencies of each call beyond max_position_embeddings, kept for the calls after it
    "llama-dynamic-rope": (
        tf.LlamaConfig,
        tf.LlamaForCausalLM,
        dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
        r"'llama'.*rope whose frequencies depend on the engine's earlier calls .*rope_type 'dynamic'",
    ),
    "gpt2-dropout": (
        tf.GPT2Config,
        tf.GPT2LMHeadModel,
        dict(n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.1),
        r"'gpt2'.*layers 0-1: dropout in training .*p=0.1",
    ),
    # a vision-language model outside ``replay.vlm.VLMS``
    "glm4v": (
        tf.Glm4vConfig,
        tf.Glm4vForConditionalGeneration,
        _vlm(dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32)),
        r"'glm4v'.*a multimodal model .*Qwen2VL, Qwen2_5_VL, Qwen3VL, Qwen3VLMoe, Qwen3_5, Qwen3_5Moe, and no other.*"
        r"Glm4vForConditionalGeneration: .*vision_config",
    ),
}


def family_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, **sizes):
    """Family ``name``'s tiny model (``PARITY`` or ``REFUSED``), random weights from ``seed``, train mode;
    ``sizes`` override config values."""
    config_cls, model_cls, kwargs = (PARITY.get(name) or REFUSED[name])[:3]
    torch.manual_seed(seed)
    if "text_config" in kwargs:  # a vision-language checkpoint: the matrix's shape (and ``sizes``) is its text model's
        text = {**_SHAPE, **kwargs["text_config"], **sizes}
        tied = text.pop("tie_word_embeddings")  # the outer class's LM head
        kwargs = dict(kwargs, text_config=text, tie_word_embeddings=tied)
    else:
        kwargs = {**_SHAPE, **kwargs, **sizes}
    config = config_cls(**{k: v for k, v in {"attn_implementation": "sdpa", **kwargs}.items() if v is not ABSENT})
    model = model_cls(config)
    slow_linear_decay(model)  # a prompt's state reaches the responses (``augtree_verl.models.LINEAR_DECAY_A``)
    return model.to(dtype).train()
