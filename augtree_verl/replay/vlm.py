"""Vision-language checkpoints (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5: ``*ForConditionalGeneration``) on text-only
rows: the replay runs their text decoder and LM head (docs/design.md, "Vision-language checkpoints").

verl loads these checkpoints with their vision tower even for text data. On a text-only row the model's forward
is its text decoder (``model.model.language_model``, config ``config.get_text_config()``) on the token
embeddings, then the outer class's ``lm_head`` (no logit transform), with M-RoPE positions that verl's agent
loop builds as 0..L-1 on every axis (``get_rope_index`` without images). The replay calls exactly these
(``TEXT_VLMS``). What the engine adds for verl (its dummy vision forward, its process-wide patches undone):
``integration.vlm``.
"""

from __future__ import annotations

import torch

# The vision-language classes whose text-only rows the replay runs.
TEXT_VLMS = frozenset(
    {
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
    }
)


def is_text_vlm(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a causal LM, not a PEFT wrapper; FSDP2's subclass of one counts) is of a vision-language
    class of ``TEXT_VLMS``."""
    return any(k.__name__ in TEXT_VLMS for k in type(model).__mro__)
