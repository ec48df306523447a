"""Models for the benchmark: built-in small configs by name (random weights, seeded, no download) or a local
Hugging Face checkpoint directory.

Built-in shapes are Qwen2 (GQA, the family the workloads were tokenized for) scaled down so a CPU can run a
full update step on real long-context lengths. Token ids are random, so the vocabulary only sets the LM
head's cost: each built-in vocabulary is sized so the LM head is about the same share of a token's FLOPs
as in Qwen2.5-7B (2·3584·152064 vs 28 layers of 466 MFLOP: about 8%), instead of dominating a tiny model.

``qwen3.5-small`` is the hybrid: Qwen3.5's text model (``Qwen3_5ForCausalLM``, model type ``qwen3_5_text``) at
qwen2-small's width, depth, heads and vocabulary (the LM head again about 8% of a token's FLOPs). Qwen3.5 repeats
three Gated DeltaNet (linear-attention) layers and one full-attention layer; its config class's defaults (hidden
4096, 32 layers) have 16 attention heads of 256 = hidden, 4 K/V heads, and per linear layer 16 key heads and 32
value heads of 128 (keys half the hidden size, values all of it), conv kernel 4, rotary on a quarter of each head.
Here: 4 layers (linear, linear, linear, full), 4 attention heads of 32 = hidden 128, 2 K/V heads, and 2 key and 4
value heads of 32 (keys 64 = half the hidden size, values 128), conv kernel 4, rotary on a quarter of each head.
Its context-parallel plans run through the state scan (``cp.state_scan``); its decay parameters are drawn so that
a prompt's state reaches the responses (``LINEAR_DECAY_A``).
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
)

_COMMON = dict(max_position_embeddings=65_536, rope_theta=1_000_000.0, tie_word_embeddings=False)
BUILTIN_MODELS: dict[str, tuple[type, type, dict[str, Any]]] = {
    # name: (config class, model class, shape)
    "qwen2-tiny": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        ),
    ),
    "qwen2-small": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
        ),
    ),
    "qwen2-base": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=2048,
        ),
    ),
    "llama-small": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=512,
        ),
    ),
    "qwen3.5-small": (
        Qwen3_5TextConfig,
        Qwen3_5ForCausalLM,
        dict(
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            vocab_size=512,
        ),
    ),
}
DEFAULT_MODEL = "qwen2-small"
# Gated DeltaNet's per-token decay is exp(-A softplus(a + dt_bias)); transformers draws A from (0, 16), a decay
# near exp(-10) that forgets a prompt within a token or two and leaves the decay parameters' gradients at ~1e-9,
# where the bench's per-parameter gradient check would compare rounding. A from (0.02, 0.2) keeps ~90% of the
# state per token (the range the family matrix's tiny hybrids get too), so the prompt's state reaches
# the responses and every gradient is well above rounding.
LINEAR_DECAY_A = (0.02, 0.2)


def slow_linear_decay(model: torch.nn.Module) -> None:
    """Every Gated DeltaNet layer's decay parameter A drawn from ``LINEAR_DECAY_A`` (torch's current RNG)."""
    with torch.no_grad():
        for module in model.modules():
            a_log = getattr(module, "A_log", None)  # a Gated DeltaNet layer's
            if isinstance(a_log, torch.Tensor):
                a_log.copy_(torch.empty_like(a_log).uniform_(*LINEAR_DECAY_A).log())


def attn_implementation(device: str) -> str:
    """HF attention backend for the flattened baseline: flash-attn on CUDA (SDPA if it is not installed), SDPA
    on CPU."""
    if not device.startswith("cuda"):
        return "sdpa"
    if importlib.util.find_spec("flash_attn") is None:
        warnings.warn(
            "flash-attn is not installed (pip install -e '.[flash-attn]'): the CUDA baseline uses SDPA", stacklevel=2
        )
        return "sdpa"
    return "flash_attention_2"


def load_model(name_or_path: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """A causal LM in train mode: built-in ``name_or_path`` (random weights from ``seed``) or a local HF checkpoint."""
    check_model_name(name_or_path)
    attn = attn_implementation(device)
    if name_or_path in BUILTIN_MODELS:
        config_cls, model_cls, shape = BUILTIN_MODELS[name_or_path]
        config = config_cls(**_COMMON, **shape, attn_implementation=attn)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(config)
            slow_linear_decay(model)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=dtype, attn_implementation=attn, local_files_only=True
        )
    return model.to(device=device, dtype=dtype).train()


def check_model_name(name_or_path: str) -> None:
    """Raise ``ValueError`` unless ``name_or_path`` is a built-in model or a local directory."""
    if name_or_path not in BUILTIN_MODELS and not Path(name_or_path).is_dir():
        raise ValueError(
            f"--model {name_or_path!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
            "nor a local Hugging Face checkpoint directory"
        )


def vocab_size(model) -> int:
    return model.get_input_embeddings().num_embeddings
