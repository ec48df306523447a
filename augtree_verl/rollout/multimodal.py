"""A rollout request's images as the vision-language model takes them (the ``hf`` rollout's multimodal half).

verl's agent loop sends a multimodal request as vLLM takes it: ``prompt_ids`` with each image's placeholder
already expanded (``<|image_pad|>`` once per merged patch, by the model's processor) and ``image_data``, the
images themselves (PIL, as verl's dataset loads them). ``prompt_inputs`` turns them into what the model's forward
needs beside the ids:

- ``model_inputs``: the processor's image features, ``pixel_values`` [patches, C * T * P * P] and
  ``image_grid_thw`` [images, 3], as verl's trainer computes them for ``multi_modal_inputs``;
- ``positions`` [4, 1, L]: the rope positions, a text row (0..L-1) over the model's three multimodal rows
  (``processor.get_rope_index``, which verl binds to Qwen-VL processors), stacked as verl's agent loop stacks
  them for the trainer; and ``rope_delta``, the offset of the multimodal rows after the prompt (a response token
  at index t of the sequence sits at t + rope_delta on those rows);
- ``digest``: a hash of the features, so two prompts whose ids agree (same text, same image sizes) but whose
  images differ are told apart (the server keys its prefills and request seeds by ids and digest).

Processors without ``get_rope_index`` (models with 1-D positions) get ``positions`` None: the model positions
the tokens itself. Videos and audio are refused, naming the request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from verl.utils.tokenizer import get_processor_token_id

# mm_token_type_ids, as transformers' get_rope_index reads them: text 0, image 1.
TEXT_TOKEN, IMAGE_TOKEN = 0, 1


@dataclass(frozen=True)
class PromptInputs:
    """What a prompt adds to its ids for the model's forward (see the module docstring)."""

    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    positions: torch.Tensor | None = None
    rope_delta: int = 0
    digest: str = ""


def prompt_inputs(
    processor, prompt_ids: list[int], request_id: str, *, image_data=None, video_data=None, audio_data=None, **kwargs
) -> PromptInputs | None:
    """The inputs of one request's prompt; None for a text model (no processor). ``kwargs``: the request's
    ``mm_processor_kwargs`` for the image processor."""
    if video_data or audio_data:
        raise ValueError(f"the hf rollout takes images only; request {request_id} has video or audio")
    if processor is None:
        if image_data:
            raise ValueError(f"request {request_id} has images but the model has no processor (a text model)")
        return None
    model_inputs = {}
    if image_data:
        features = processor.image_processor(images=list(image_data), return_tensors="pt", **kwargs)
        model_inputs = {key: features[key] for key in ("pixel_values", "image_grid_thw")}
    if not hasattr(processor, "get_rope_index"):
        return PromptInputs(model_inputs, digest=_digest(model_inputs))
    ids = torch.tensor([prompt_ids])
    token_types = torch.full_like(ids, TEXT_TOKEN)
    token_types[ids == get_processor_token_id(processor, "image")] = IMAGE_TOKEN
    rope, delta = processor.get_rope_index(
        input_ids=ids,
        mm_token_type_ids=token_types,
        image_grid_thw=model_inputs.get("image_grid_thw"),
        attention_mask=torch.ones_like(ids),
    )
    positions = torch.cat([torch.arange(len(prompt_ids)).view(1, 1, -1), rope], dim=0)
    return PromptInputs(model_inputs, positions, int(delta.flatten()[0]), _digest(model_inputs))


def decode_positions(inputs: PromptInputs | None, index: int) -> torch.Tensor | None:
    """The positions [4, 1, 1] of the token at sequence index ``index`` after the prompt (None: the model's own)."""
    if inputs is None or inputs.positions is None:
        return None
    return torch.tensor([index] + [index + inputs.rope_delta] * 3).view(4, 1, 1)


def _digest(model_inputs: dict[str, torch.Tensor]) -> str:
    if not model_inputs:
        return ""
    digest = hashlib.sha256()
    for key in sorted(model_inputs):
        digest.update(key.encode())
        digest.update(model_inputs[key].contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]
