"""Rows with images against verl's stock engine: each vision-language checkpoint of ``replay.vlm.VLMS`` trains two
optimizer steps on 2 gloo ranks with the augtree engine and with verl's stock fsdp2 engine in float32, on a batch as
verl's agent loop writes it (per-row ``multi_modal_inputs`` with ``pixel_values`` and ``image_grid_thw``, position ids
[4, L] from ``get_rope_index``, packed [4, 1, nnz] where the family runs with remove-padding): images of several
sizes, text-only groups beside them, a group whose rows sit on one rank only (the other pads the slot with the dummy
tower call) and a uid whose rows carry two different images (two trees). Log-probs, entropies, losses, grad norms and
every weight, the vision tower's included, must agree, and the tower must run once per tree."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from augtree_verl.groups import Tree, Vision
from augtree_verl.integration.batch_trees import _vision
from augtree_verl.replay import Offload, ReplayOptions, ReplayStats, StepPlan, per_response, replay
from augtree_verl.replay.baseline import flattened_replay
from augtree_verl.replay.rope import RopeRegimes
from augtree_verl.replay.vlm import VLMS
from augtree_verl.testing import harness as H
from tests.families import IMAGE_TOKEN, family_model
from tests.integration.test_engine_families import VLM_REMOVE_PADDING, VLM_WEIGHT_DECAY, _vision_output_as_tensor
from tests.integration.test_engine_parity_dp2 import compare_step
from tests.parity import assert_grads_match, assert_logps_match, grads

pytestmark = pytest.mark.slow  # spawns process groups and builds verl engines

WORLD = 2
STEPS = 2
# uid -> (text tokens before the image, its (t, h, w) patch grid or None for a text prompt, text tokens after it,
# per row the response length and which of the uid's images it carries). Rows are dealt round-robin to the ranks:
# "one" sits on rank 1 alone; "two" carries two images under one prompt (each rank splits it into two trees).
GROUPS = {
    "big": (3, (1, 4, 4), 2, [(3, 0), (5, 0), (4, 0), (2, 0)]),
    "small": (2, (1, 2, 4), 3, [(4, 0), (2, 0), (3, 0)]),
    "text": (6, None, 0, [(4, 0), (2, 0), (3, 0), (1, 0)]),
    "one": (1, (1, 4, 8), 1, [(3, 0)]),
    "two": (2, (1, 2, 4), 2, [(2, 0), (3, 0), (2, 1), (4, 1)]),
}
# The text model's initializer_range where the matrix's 0.02 leaves attention near uniform: Qwen2(.5)-VL's has no
# q/k norms, so its logits stay near 0 and the image tokens' M-RoPE positions would barely move a log-prob (an
# off-by-one M-RoPE shift of the prompt failed these rows at 1.3x and 2x the tolerance; at 0.05, 54x and 111x).
TEXT_INIT = {"qwen2-vl": 0.05, "qwen2.5-vl": 0.05}


def image_rows(model, seed: int) -> list[dict]:
    """``GROUPS``' rows for ``model`` (a tiny ``VLMS`` model: its vision config, ``get_rope_index``): each row's
    ``multi_modal_inputs`` (its own copy, as verl repeats a sample's) and position ids [4, L] as verl's agent loop
    builds them; text tokens are drawn below ``IMAGE_TOKEN``."""
    g = torch.Generator().manual_seed(seed)
    vision = model.config.vision_config
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    merge = vision.spatial_merge_size**2
    rows = []
    for uid, (before, grid, after, responses) in GROUPS.items():
        text = lambda n: torch.randint(3, IMAGE_TOKEN, (n,), generator=g)
        tokens = [] if grid is None else [IMAGE_TOKEN] * (grid[0] * grid[1] * grid[2] // merge)
        prompt = torch.cat([text(before), torch.tensor(tokens, dtype=torch.long), text(after)])
        images = [torch.randn(grid[0] * grid[1] * grid[2], patch_dim, generator=g) for _ in range(2)] if grid else []
        for length, image in responses:
            row = dict(uid=uid, prompt=prompt, response=text(length), advantage=float(torch.randn(1, generator=g)))
            sequence = torch.cat([row["prompt"], row["response"]])[None]
            inputs = {}
            if grid is not None:
                inputs = {"pixel_values": images[image].clone(), "image_grid_thw": torch.tensor([grid])}
                mrope, _ = model.model.get_rope_index(
                    sequence, (sequence == IMAGE_TOKEN).int(), image_grid_thw=inputs["image_grid_thw"]
                )
                row["positions"] = torch.cat([torch.arange(sequence.shape[1])[None], mrope[:, 0]])
                # each image frame's patch count, as verl's agent loop adds it (its MFU metric reads it)
                t, h, w = grid
                inputs["images_seqlens"] = torch.full((t,), h * w)
            row["multi_modal_inputs"] = inputs
            rows.append(row)
    return rows


def _image_trees(rows: list[dict]) -> int:
    """Trees with images among ``rows`` (one rank's): one per uid and image."""
    return sum(tree.vision is not None for tree in image_trees(rows))


def _rank_main(rank: int, port: int, name: str, path: str) -> None:
    H.use_cpu_platform()
    from verl.utils import tensordict_utils as tu

    H.init_process_group(rank=rank, world_size=WORLD, port=port)
    build = dict(weight_decay=VLM_WEIGHT_DECAY, model_settings={"use_remove_padding": VLM_REMOVE_PADDING[name]})
    stock, stock_loss = H.build_engine("fsdp2", path, **build)
    _vision_output_as_tensor(stock)
    ours, our_loss = H.build_engine("augtree", path, engine_knobs={"micro_batch_tokens": 8}, **build)
    model = family_model(name)
    for step in range(STEPS):
        all_rows = image_rows(model, seed=step)
        rows = all_rows[rank::WORLD]
        batch = H.rows_to_batch(
            rows, extra={"multi_modal_inputs": [row["multi_modal_inputs"] for row in rows]}, mrope=True
        )
        tu.assign_non_tensor(
            batch, global_batch_size=len(all_rows), use_remove_padding=stock.model_config.use_remove_padding
        )
        out_ours = compare_step((stock, stock_loss), (ours, our_loss), batch, f"rank {rank} step {step}", step)
        metrics = {k: v.aggregate() for k, v in out_ours["metrics"].items() if k.startswith("augtree/vision/")}
        trees = _image_trees(rows)
        # once per tree: G rows of one image -> one tower forward, not G (verl's: one per micro-batch with images)
        assert metrics["augtree/vision/tower_calls"] == metrics["augtree/vision/trees"] == trees, (rank, metrics)
        assert metrics["augtree/vision/split_trees"] == 1, (rank, metrics)  # "two": two images, two trees
        assert trees < sum(bool(row["multi_modal_inputs"]) for row in rows)
    torch.distributed.destroy_process_group()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(VLM_REMOVE_PADDING))
def test_image_rows_match_stock_engine(name, tmp_path):
    path = str(tmp_path / name)
    family_model(name, **({"initializer_range": TEXT_INIT[name]} if name in TEXT_INIT else {})).save_pretrained(path)
    H.spawn(_rank_main, (H.free_port(), name, path), nprocs=WORLD, timeout_s=540)


def image_trees(rows: list[dict]) -> list[Tree]:
    """``rows`` (``image_rows``) as trees: one per uid and image, its prompt's positions from the rows'."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        inputs = row["multi_modal_inputs"]
        groups.setdefault((row["uid"], inputs["pixel_values"].sum().item() if inputs else None), []).append(row)
    trees = []
    for (uid, _), members in groups.items():
        first = members[0]
        prompt, inputs = first["prompt"], first["multi_modal_inputs"]
        vision = None  # a text prompt (verl's agent loop gives it empty multi_modal_inputs and no M-RoPE rows here)
        if inputs:
            vision = Vision(inputs["pixel_values"], inputs["image_grid_thw"], first["positions"][:, : len(prompt)])
        trees.append(Tree.of_tokens(prompt, [row["response"] for row in members], uid=uid, vision=vision))
    return trees


@pytest.mark.parametrize("name", sorted(VLM_REMOVE_PADDING))
def test_image_trees_replay_as_the_flattened_baseline(name):
    """The oracle without verl: ``replay`` of ``GROUPS``' trees (images of several sizes, a text prompt, a uid with
    two images) against the flattened baseline, each [prompt || response] run with its images as its own sequence:
    log-probs and every gradient, the vision tower's included."""
    model = family_model(name, **({"initializer_range": TEXT_INIT[name]} if name in TEXT_INIT else {}))
    trees = image_trees(image_rows(model, seed=0))
    loss = lambda t, i, logp: (logp * (i + 1 - 2 * t)).mean()  # advantages of both signs
    model.zero_grad(set_to_none=True)
    want = flattened_replay(model, trees, loss, mrope=True)
    want_grads = grads(model)
    model.zero_grad(set_to_none=True)
    got = replay(model, StepPlan.build(trees, rope=RopeRegimes.of(model.config)), per_response(loss))
    assert any(name.startswith("model.visual.") for name in want_grads)
    assert_logps_match(got, want)
    assert_grads_match(grads(model), want_grads)


def test_image_tokens_not_matching_the_grid_are_refused_naming_the_tree():
    """The replay checks each tree's image tokens against its ``image_grid_thw`` before any model call."""
    model = family_model("qwen2.5-vl")
    row = next(row for row in image_rows(model, seed=0) if row["uid"] == "small")
    prompt = torch.cat([row["prompt"], torch.tensor([IMAGE_TOKEN])])  # one image token too many
    inputs = row["multi_modal_inputs"]
    vision = Vision(inputs["pixel_values"], inputs["image_grid_thw"], row["positions"][:, : len(prompt)])
    tree = Tree.of_tokens(prompt, [row["response"]], uid="small", samples=[4], vision=vision)
    with pytest.raises(ValueError, match=r"tree 0 \(uid 'small', batch rows \[4\]\): 3 image tokens .*\[\[1, 2, 4\]\]"):
        replay(model, StepPlan.build([tree], rope=RopeRegimes.of(model.config)))


def _replay_grads(model, tree: Tree, offload: Offload | None) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of one training replay of ``tree`` (loss: the sum of its log-probs)."""
    model.zero_grad(set_to_none=True)
    plan = StepPlan.build([tree], rope=RopeRegimes.of(model.config))
    replay(model, plan, per_response(lambda t, i, logp: logp.sum()), ReplayOptions(offload=offload))
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_offload_moves_the_vision_tower_activations_and_stays_exact():
    """The tower runs inside the prompt's prefill, so prompt offload moves what it saves too (counted in
    ``offloaded_bytes``, more than the same tokens without images), and the gradients, the tower's included, stay
    those of the replay without offload."""
    model = family_model("qwen2.5-vl")
    rows = [row for row in image_rows(model, seed=0) if row["uid"] == "big"]
    prompt, inputs = rows[0]["prompt"], rows[0]["multi_modal_inputs"]
    vision = Vision(inputs["pixel_values"], inputs["image_grid_thw"], rows[0]["positions"][:, : len(prompt)])
    tree = Tree.of_tokens(prompt, [row["response"] for row in rows], uid="big", vision=vision)
    want = _replay_grads(model, tree, None)
    assert any(name.startswith("model.visual.") for name in want)
    moved = {}
    for images in (True, False):
        stats = ReplayStats()
        got = _replay_grads(
            model, tree if images else dataclasses.replace(tree, vision=None), Offload(stats, min_bytes=0)
        )
        moved[images] = stats.offloaded_bytes
        if images:
            assert got.keys() == want.keys()
            assert_grads_match(got, want)
    assert moved[True] > moved[False] > 0


def test_images_seqlens_not_matching_the_grid_are_refused_naming_the_row():
    """verl's agent loop adds each image frame's patch count (``images_seqlens``); the engine reads the grid, so a
    count that disagrees with it is bad input, named, not ignored."""
    model = family_model("qwen2.5-vl")
    row = next(row for row in image_rows(model, seed=0) if row["uid"] == "small")
    p, r = len(row["prompt"]), len(row["response"])
    assert _vision(row["multi_modal_inputs"], row["positions"], p, r, "row 4", "cpu") is not None
    bad = {**row["multi_modal_inputs"], "images_seqlens": row["multi_modal_inputs"]["images_seqlens"] + 1}
    with pytest.raises(ValueError, match=r"row 4: images_seqlens .* do not match image_grid_thw"):
        _vision(bad, row["positions"], p, r, "row 4", "cpu")


def test_every_vision_language_class_has_an_image_row():
    """``test_image_rows_match_stock_engine`` runs one tiny model of each class the replay takes images on."""
    assert {type(family_model(name)).__name__ for name in VLM_REMOVE_PADDING} == VLMS
