"""Models for the benchmark: built-in small configs by name (random weights, seeded, no download) or a local
Hugging Face checkpoint directory.

Built-in shapes are Qwen2 (GQA, the family the workloads were tokenized for) scaled down so a CPU can run a
full update step on real long-context lengths. Token ids are random, so the vocabulary only sets the LM
head's cost: each built-in vocabulary is sized so the LM head is about the same share of a token's FLOPs
as in Qwen2.5-7B (2·3584·152064 vs 28 layers of 466 MFLOP: about 8%), instead of dominating a tiny model.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

_COMMON = dict(max_position_embeddings=65_536, rope_theta=1_000_000.0, tie_word_embeddings=False)
BUILTIN_MODELS = {
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
}
DEFAULT_MODEL = "qwen2-small"


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
