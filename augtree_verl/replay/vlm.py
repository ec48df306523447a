"""Vision-language checkpoints (Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5(-MoE): ``*ForConditionalGeneration``,
``VLMS``): the replay runs their text decoder and LM head, and a prompt with images through their vision tower once
per tree (docs/design.md, "Vision-language checkpoints").

verl loads these checkpoints with their vision tower even for text data. On a text-only row the model's forward
is its text decoder (``model.model.language_model``, config ``config.get_text_config()``) on the token
embeddings, then the outer class's ``lm_head`` (no logit transform), with M-RoPE positions that verl's agent
loop builds as 0..L-1 on every axis (``get_rope_index`` without images). The replay calls exactly these.

A prompt with images (``groups.Vision``) is prefilled as verl's forward (``_get_input_embeds`` in
``verl/models/transformers/qwen2_vl.py``, ``qwen3_vl.py``, ``qwen3_5.py``) computes it: the vision tower
on the prompt's pixels, its merged embeddings scattered into the image-token positions of the token embeddings,
Qwen3-VL(-MoE)'s deepstack outputs added to the first decoder layers' hidden states at those positions, the text
decoder at verl's own position ids (``ImagePrefill``). The tower runs inside the prompt's prefill, so the delayed
prompt backward takes it the summed gradient of every response. The lock-step pads a rank's slot without images
where another rank's has some with verl's dummy 16-patch tower call weighted 0.0 (``dummy_tower``), as verl's
forward runs it on a micro-batch without images: every rank gathers the tower's FSDP units alike. What the engine
adds for verl (its once-a-step dummy, its process-wide patches undone): ``integration.vlm``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from augtree_verl.groups import MROPE_AXES, Tree
from augtree_verl.plan import Plan

# The vision-language classes whose rows, text-only and with images, the replay runs (each tested against verl's stock
# engine: tests/integration/test_engine_families.py, tests/integration/test_engine_images.py)
VLMS = frozenset(
    {
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
    }
)
# verl's dummy vision input on a batch without images: 16 zero patches on a 1 x 4 x 4 grid
DUMMY_GRID_THW = (1, 4, 4)


def is_vlm(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a causal LM, not a PEFT wrapper; FSDP2's subclass of one counts) is of a vision-language
    class of ``VLMS``."""
    return any(k.__name__ in VLMS for k in type(model).__mro__)


def tower_output(output) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """A vision tower's output -> (merged embeddings [n, H], deepstack embeddings [n, H] per injected layer or None):
    transformers 5's output object (``pooler_output``, Qwen3-VL(-MoE)'s ``deepstack_features``) or a tensor (a tower
    made to return its merged embeddings, ``integration.vlm.vision_output_as_tensor``)."""
    if isinstance(output, torch.Tensor):
        return output, None
    return output.pooler_output, getattr(output, "deepstack_features", None)


def dummy_tower(model) -> torch.Tensor:
    """verl's dummy vision forward on a batch without images, weighted 0.0 as verl weights it (its main output and,
    for Qwen3-VL(-MoE), each deepstack output): a scalar 0 whose backward gives the vision parameters zero gradients.
    ``model``: a ``VLMS`` causal LM (under FSDP2 call it through the root, ``integration.fsdp_model``)."""
    visual = model.model.visual
    config = model.config.vision_config
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    t, h, w = DUMMY_GRID_THW
    device = model.get_input_embeddings().weight.device
    pixels = torch.zeros((t * h * w, patch_dim), dtype=visual.dtype, device=device)
    embeds, deepstack = tower_output(visual(pixels, grid_thw=torch.tensor([DUMMY_GRID_THW], device=device)))
    return sum((0.0 * e.mean() for e in deepstack or []), 0.0 * embeds.mean())


def span_positions(tree: Tree, start: int, end: int, rows: int) -> torch.Tensor:
    """The position ids of tokens [start, end) of ``tree``'s rows, for a call of ``rows`` rows: [rows, S] (start ..
    end - 1) for a text prompt; [MROPE_AXES, rows, S] for a prompt with images: verl's over the prompt
    (``Vision.positions``), after it text position k and M-RoPE positions k + ``Vision.shift``."""
    device = tree.prompt.device
    text = torch.arange(start, end, device=device)
    if tree.vision is None:
        return text[None].expand(rows, -1)
    prompt = tree.vision.positions.to(device)
    after = torch.arange(max(start, prompt.shape[1]), end, device=device)
    axes = torch.stack([after] + [after + tree.vision.shift] * (MROPE_AXES - 1))
    return torch.cat([prompt[:, start:end], axes], dim=1)[:, None].expand(-1, rows, -1)


class ImagePrefill:
    """A prompt's prefill through a ``VLMS`` causal LM ``model`` with its vision tower (the module docstring);
    ``route(fn)``: how a call reaches the model (``integration.fsdp_model`` routes it through the FSDP2 root)."""

    def __init__(self, model, route: Callable[[Callable], Callable] | None = None):
        self.model = model
        self.forward = route(self._forward) if route is not None else self._forward

    def check(self, index: int, tree: Tree) -> None:
        """``ValueError`` naming tree ``index`` (its uid and batch rows) where its prompt's image tokens are not the
        merged patches of its ``image_grid_thw`` (or its pixel rows not its patches)."""
        vision, config = tree.vision, self.model.config
        where = f"tree {index} (uid {tree.uid!r}, batch rows {list(tree.samples)})"
        assert vision is not None
        grid = vision.grid_thw.tolist()
        patches = sum(t * h * w for t, h, w in grid)
        merged = patches // config.vision_config.spatial_merge_size**2
        tokens = int((tree.prompt == config.image_token_id).sum())
        if tokens != merged or vision.pixels.shape[0] != patches:
            raise ValueError(
                f"{where}: {tokens} image tokens (id {config.image_token_id}) and pixel_values of "
                f"{vision.pixels.shape[0]} patches, but image_grid_thw {grid} gives {patches} patches merged into "
                f"{merged} tokens"
            )

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, tree: Tree | None, ctx) -> torch.Tensor:
        """ids [1, P], positions [MROPE_AXES, 1, P] (or [1, P]) -> final hidden states [1, P, H]: ``tree``'s images
        (None: ``dummy_tower``'s zero added to the embeddings) in the text decoder's input embeddings."""
        inner = self.model.model
        embeds = inner.get_input_embeddings()(ids)
        extra = {}
        if tree is None or tree.vision is None:
            embeds = embeds + dummy_tower(self.model)
        else:
            visual = inner.visual
            images, deepstack = tower_output(
                visual(tree.vision.pixels.type(visual.dtype), grid_thw=tree.vision.grid_thw)
            )
            mask = ids == self.model.config.image_token_id
            embeds = embeds.masked_scatter(mask[..., None].expand_as(embeds), images.to(embeds.dtype))
            if deepstack is not None:
                extra = dict(visual_pos_masks=mask, deepstack_visual_embeds=deepstack)
        return inner.language_model(
            inputs_embeds=embeds, position_ids=positions, attention_mask=None, use_cache=False, augtree_ctx=ctx, **extra
        ).last_hidden_state


def demote_image_plans(trees: Sequence[Tree], plans: Sequence[Plan | None]) -> tuple[list[Plan | None], int]:
    """(``plans`` with the plan of degree > 1 of every tree with images replaced by the one-device plan carrying its
    one-rank estimate, how many were replaced): the context-parallel replay runs no vision tower."""
    demoted = [t for t, p in enumerate(plans) if p is not None and p.degree > 1 and trees[t].vision is not None]
    out = list(plans)
    for t in demoted:
        out[t] = Plan(est_time_s=plans[t].est_single_s)
    return out, len(demoted)
