"""What the engine does for verl's handling of a vision-language checkpoint's text-only rows (``replay.vlm``).

verl's patched forward runs a dummy 16-patch vision forward on every text-only micro-batch and adds ``0.0 *`` its
mean, so that every rank gathers the vision tower's FSDP units alike and its parameters get zero (not absent)
gradients, which weight decay and the optimizer state see; the engine mirrors it with one such call per training
step (``replay.vlm.dummy_tower``, through the FSDP2 root: ``integration.fsdp_model``), and the replay with one in
each lock-step slot where some rank's prompt has images (``replay.vlm``).

verl 0.9.1 patches some of these classes' forwards process-wide when it builds a model (``apply_monkey_patch``):
Qwen3.5's decoder layer and Gated DeltaNet (for packed rows; the patched linear attention never continues from
a state), and, with ``use_remove_padding``, Qwen2(.5)-VL's attention (flash attention only, past transformers'
attention interface). For the replay's own model these modules get back transformers' forwards, captured when
this module is imported (before verl builds any engine: the engine backend imports it), as instance forwards
(``prepare_for_replay``): the same computation for unpacked rows, through the replay's hooks. verl 0.9.1's
text-only forward for Qwen2(.5)-VL also fails under transformers 5 (``vision_output_as_tensor``): the engine
gives its own model's vision tower the output that forward reads.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

import torch

from augtree_verl.replay.vlm import is_vlm, tower_output

# transformers' modules and classes whose forward verl 0.9.1 replaces for these models (module docstring).
PATCHED_BY_VERL = {
    "transformers.models.qwen2_vl.modeling_qwen2_vl": ("Qwen2VLAttention",),
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl": ("Qwen2_5_VLAttention",),
    "transformers.models.qwen3_5.modeling_qwen3_5": ("Qwen3_5DecoderLayer", "Qwen3_5GatedDeltaNet"),
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": ("Qwen3_5MoeDecoderLayer", "Qwen3_5MoeGatedDeltaNet"),
}
# The classes whose text-only forward in verl 0.9.1 reads the vision tower's output as a tensor
VISION_OUTPUT_READ_AS_TENSOR = frozenset({"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"})


def _transformers_forwards() -> dict[str, types.FunctionType]:
    """class name -> its forward as transformers defines it (``PATCHED_BY_VERL``), read now."""
    found = {}
    for module_name, names in PATCHED_BY_VERL.items():
        module = importlib.import_module(module_name)
        for name in names:
            forward = vars(getattr(module, name))["forward"]
            if forward.__module__ != module_name:
                raise RuntimeError(
                    f"augtree_verl.integration.vlm was imported after {forward.__module__} replaced {name}.forward; "
                    "import augtree_verl.integration before building any verl engine"
                )
            found[name] = forward
    return found


_ORIGINAL_FORWARDS = _transformers_forwards()


def prepare_for_replay(model: torch.nn.Module) -> None:
    """Give every module of ``model`` whose class forward verl replaced (``PATCHED_BY_VERL``) transformers' forward
    as its own (an instance attribute, so other models of the process keep verl's); and a Qwen2(.5)-VL vision tower
    the output verl's text-only forward can read (``vision_output_as_tensor``)."""
    for module in model.modules():
        original = next((f for k in type(module).__mro__ if (f := _ORIGINAL_FORWARDS.get(k.__name__))), None)
        if original is not None and type(module).forward is not original:
            module.forward = types.MethodType(original, module)
    if verl_reads_vision_output_as_tensor(model):
        vision_output_as_tensor(model)


def verl_reads_vision_output_as_tensor(model: torch.nn.Module) -> bool:
    """Whether verl 0.9.1's text-only forward of ``model``'s class reads its vision tower's output as a tensor
    (``VISION_OUTPUT_READ_AS_TENSOR``)."""
    return any(k.__name__ in VISION_OUTPUT_READ_AS_TENSOR for k in type(model).__mro__)


def vision_output_as_tensor(model: Any) -> None:
    """Make the vision tower of ``model`` (a ``VLMS`` model) return its merged embeddings (the first of
    ``replay.vlm.tower_output``, as of verl's ``unpack_visual_output``) rather than transformers 5's output object:
    what verl's image path takes of it anyway, and what verl 0.9.1's text-only dummy forward for Qwen2(.5)-VL reads
    (it calls ``.mean()`` on the output, an AttributeError on the object: neither engine could run a text-only
    batch)."""
    model.model.visual.register_forward_hook(lambda module, args, output: tower_output(output)[0])


def trains_vision_tower(model: Any) -> bool:
    """Whether ``model`` is a ``VLMS`` model with a vision tower that has trainable parameters."""
    return is_vlm(model) and any(p.requires_grad for p in model.model.visual.parameters())
