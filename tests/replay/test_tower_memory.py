"""The vision tower's share of the replay's memory estimate (``ReplayMemory.tower``, ``VisionShape``): per image
patch against a measurement of the tower's forward, in the guard's refusal by name, and read from each
vision-language class's config."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import transformers as tf

from augtree_verl import StepPlan, Tree
from augtree_verl.groups import MROPE_AXES, Vision
from augtree_verl.model_shape import VisionShape
from augtree_verl.replay.memory import GIB, ReplayMemory, ReplayMemoryError
from augtree_verl.replay.vlm import VLMS
from tests.families import PARITY, family_model
from tests.replay.test_memory import FACTOR, LiveTensorBytes

# Images of 8 x 16 and 16 x 16 patches on a 4-block tower with 2 x 2 patches (24 values a row, not the released
# 1,176: the pixel row would outweigh the tiny blocks, so that a wrong block count still passed). The per-patch bytes
# are the slope between the two: it cancels what does not grow with the patches (the parameters' views, which the
# meter sees as new storages). CPU's attention saves a log-sum-exp per head, not the N^2 probabilities (flash
# attention for CPU), so the slope has no N^2 term.
GRIDS = ((1, 8, 16), (1, 16, 16))
DEPTH = 4


def _model(name: str, checkpointing: bool):
    """Family ``name``'s tiny model with its tower made ``DEPTH`` blocks on 2 x 2 patches, checkpointing as HF sets
    it for the whole model (the tower's blocks included)."""
    model = family_model(name)
    vision = copy.deepcopy(model.config.vision_config)
    vision.depth, vision.patch_size = DEPTH, 2
    model.config.vision_config = vision
    model.model.visual = type(model.model.visual)._from_config(vision).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _memory(model, checkpointing: bool = False, train: bool = True, budget_bytes: int = 0) -> ReplayMemory:
    return ReplayMemory.of(
        model.config, dtype=torch.float32, checkpointing=checkpointing, train=train, budget_bytes=budget_bytes
    )


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_tower_estimate_is_within_a_factor_of_the_measured_bytes(name, checkpointing):
    """What the tower's forward leaves alive (grad enabled, its output kept: what the delayed prompt backward
    needs), the pixel rows counted as the tower's dtype copy of them, per patch against ``ReplayMemory.tower``."""
    model = _model(name, checkpointing)
    patch_dim = VisionShape.of(model.config).patch_dim
    live = []
    for grid in GRIDS:
        with LiveTensorBytes() as meter:
            pixels = torch.randn(grid[0] * grid[1] * grid[2], patch_dim)
            output = model.model.visual(pixels, grid_thw=torch.tensor([grid]))
            live.append((pixels.shape[0], meter.now))
        del pixels, output
    (n1, bytes1), (n2, bytes2) = live
    measured = (bytes2 - bytes1) / (n2 - n1)
    estimate = _memory(model, checkpointing).tower
    ratio = estimate / measured
    assert 1 / FACTOR <= ratio <= FACTOR, f"{name}: estimate {estimate} B/patch, measured {measured:.0f} (x{ratio:.2f})"


def _image_tree(prompt: int = 64, grid: tuple[int, int, int] = (1, 64, 64), images: bool = True) -> Tree:
    """A tree whose prompt has one image of ``grid`` patches (2 x 2 patches: 24 values a row), two responses."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (prompt,), generator=g)
    patches = grid[0] * grid[1] * grid[2]
    vision = Vision(
        pixels=torch.zeros(patches, 24),
        grid_thw=torch.tensor([grid]),
        positions=torch.arange(prompt).expand(MROPE_AXES, -1),
    )
    responses = [torch.randint(3, 100, (n,), generator=g) for n in (30, 20)]
    return Tree.of_tokens(ids, responses, uid="img", samples=[0, 1], vision=vision if images else None)


def test_a_budget_the_text_fits_but_the_tower_does_not_is_refused_by_name():
    model = _model("qwen2.5-vl", checkpointing=False)
    tree = _image_tree()
    root = StepPlan.build([tree]).slots[0].node
    memory = _memory(model)
    text_only, _ = memory.peak(root, offload=False)
    patches = tree.vision.pixels.shape[0]
    assert memory.peak(root, offload=False, patches=patches)[0] == text_only + patches * memory.tower
    with pytest.raises(ReplayMemoryError) as error:
        StepPlan.build([tree], memory=_memory(model, budget_bytes=text_only))
    message = str(error.value)
    assert "tree 0 (uid 'img', samples [0, 1])" in message, message
    tower = f"of which {patches * memory.tower / GIB:.3g} GiB the vision tower's activations for {patches} image"
    assert tower in message, message
    StepPlan.build([_image_tree(images=False)], memory=_memory(model, budget_bytes=text_only))
    # forward only: nothing held after the tower's call, one block's working set during the root's call
    forward = _memory(model, train=False)
    assert forward.peak(root, offload=False, patches=patches)[0] == (
        forward.peak(root, offload=False)[0] + patches * forward.tower
    )


def test_a_7b_tower_at_1024_pixels_is_gigabytes():
    """Qwen2.5-VL-7B's tower (32 blocks of 1280, MLP 3420) in bf16: a 1024 x 1024 image's ~5,300 patches keep
    gigabytes without checkpointing, each block's input with it."""
    config = tf.Qwen2_5_VLConfig(vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420))
    memory = ReplayMemory.of(config, dtype=torch.bfloat16, checkpointing=False, train=True, budget_bytes=0)
    assert 5300 * memory.tower > 2 * GIB
    checkpointed = ReplayMemory.of(config, dtype=torch.bfloat16, checkpointing=True, train=True, budget_bytes=0)
    assert checkpointed.tower == 2 * (1176 + 32 * 1280 + 4 * 1280)
    assert (
        ReplayMemory.of(tf.Qwen2Config(), dtype=torch.bfloat16, checkpointing=True, train=True, budget_bytes=0).tower
        == 0
    )


VLM_FAMILIES = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "qwen3.5-vl", "qwen3.5-moe-vl"]


@pytest.mark.parametrize("name", VLM_FAMILIES)
def test_vision_shape_of_each_vlm_class(name):
    """The tiny model's tower (the matrix's sizes: width 32, MLP 64, or Qwen2-VL's 4 x 32) and the class's
    default config, against the modules transformers builds from them."""
    config_cls, model_cls, _ = PARITY[name]
    assert model_cls.__name__ in VLMS
    model = family_model(name)
    visual = model.model.visual
    shape = VisionShape.of(model.config)
    block = visual.blocks[0]
    fc1 = getattr(block.mlp, "fc1", None) or getattr(block.mlp, "linear_fc1", None) or block.mlp.up_proj
    assert (shape.depth, shape.width, shape.mlp_size) == (
        len(visual.blocks),
        block.norm1.weight.shape[0],
        fc1.out_features,
    )
    assert shape.heads == block.attn.num_heads
    assert shape.patch_dim == visual.patch_embed.proj.weight[0].numel()
    assert shape.mergers == 1 + len(getattr(visual, "deepstack_merger_list", ()))
    default = VisionShape.of(config_cls())
    vision = config_cls().vision_config
    assert default.width == (vision.embed_dim if name == "qwen2-vl" else vision.hidden_size)
    assert default.mlp_size == (vision.mlp_ratio * vision.embed_dim if name == "qwen2-vl" else vision.intermediate_size)
    assert sorted(VLM_FAMILIES) == sorted(n for n, (_, m, _) in PARITY.items() if m.__name__ in VLMS)


def test_text_config_has_no_tower_and_a_missing_size_is_refused_by_name():
    assert VisionShape.of(tf.Qwen2Config()) is None
    vision = SimpleNamespace(model_type="odd_vision", depth=2, hidden_size=8, num_heads=2, in_channels=3)
    vision.temporal_patch_size, vision.patch_size = 2, 14
    with pytest.raises(ValueError, match=r"model 'odd_vision' has no vision MLP size .*intermediate_size, mlp_ratio"):
        VisionShape.of(SimpleNamespace(vision_config=vision))
    del vision.depth
    with pytest.raises(ValueError, match=r"model 'odd_vision' has no vision depth under a name augtree knows"):
        VisionShape.of(SimpleNamespace(vision_config=vision))
