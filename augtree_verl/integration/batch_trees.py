"""Regroup a verl batch (rows in any order, split into verl's micro-batches) into replay trees.

A tree is one ``groups.tree_id`` (uid, prompt length), the trainer's; samples under one id whose prompt
tokens differ become separate trees (``groups.find_trees``), a group of one is a tree of one response, and
a group whose samples land in different micro-batches is still one tree (its prompt runs once per rank).
Samples of a group on another rank form that rank's own tree. Rows are numbered through the micro-batches
in order (``Tree.samples``). Each row carries the length of the call verl's stock engine runs it in
(``Tree.call_lens``): its micro-batch's longest row, as the stock engine packs a micro-batch's rows into one
call (positions restarting at each row), which is what a length-dependent rope sees (``replay.rope``).

A row whose ``multi_modal_inputs`` hold images (``pixel_values``, ``image_grid_thw``) carries them with its prompt's
M-RoPE position ids from the batch (``groups.Vision``); rows of one uid and prompt whose images or positions differ
become separate trees (``vision_splits`` counts them). Its response positions must continue the prompt's on every
axis, which is what the replay computes for them (``replay.vlm.span_positions``).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from augtree_verl.groups import MROPE_AXES, Tree, Vision, find_trees
from augtree_verl.replay.memory import STOCK_ENGINE


def sequence_lengths(micro_batch: TensorDict) -> tuple[list[int], list[int]]:
    """Per row, (prompt length, response length), read the way verl's ``no_padding_2_padding`` reads them."""
    prompts, responses = micro_batch["prompts"], micro_batch["responses"]
    if prompts.is_nested:
        return prompts.offsets().diff().tolist(), responses.offsets().diff().tolist()
    mask = micro_batch["attention_mask"]  # V0 layout: [left-padded prompt | right-padded response]
    width = prompts.shape[1]
    return mask[:, :width].sum(dim=1).tolist(), mask[:, width:].sum(dim=1).tolist()


def build_trees(micro_batches: list[TensorDict]) -> list[Tree]:
    """Group every row of ``micro_batches`` into trees with tokens; ValueError naming the row for malformed
    input."""
    uids: list[str] = []
    prompt_lens: list[int] = []
    response_lens: list[int] = []
    sequences: list[torch.Tensor] = []
    call_lens: list[int] = []
    visions: list[Vision | None] = []
    for m, mb in enumerate(micro_batches):
        mb_uids = [str(u) for u in mb["uid"]]
        mb_prompt_lens, mb_response_lens = sequence_lengths(mb)
        call_lens += [max(p + r for p, r in zip(mb_prompt_lens, mb_response_lens))] * len(mb_uids)
        inputs = tu.get(mb, "multi_modal_inputs", default=None) or [None] * len(mb_uids)
        for k, (seq, pos) in enumerate(zip(mb["input_ids"].unbind(), mb["position_ids"].unbind())):
            p, r = mb_prompt_lens[k], mb_response_lens[k]
            where = f"micro-batch {m} row {k} (uid {mb_uids[k]!r})"
            if seq.dim() != 1 or seq.shape[0] != p + r:
                raise ValueError(f"{where}: input_ids has shape {tuple(seq.shape)} but prompt + response is {p} + {r}")
            if p < 1 or r < 1:
                raise ValueError(f"{where}: prompt length {p} and response length {r} must both be >= 1")
            vision = _vision(inputs[k], pos, p, r, where, seq.device)
            if vision is None and not _text_positions(pos, p + r):
                raise ValueError(
                    f"{where}: position_ids must be 0..{p + r - 1} (text-only, unpadded sequences; a vision-language "
                    f"model's [{MROPE_AXES}, L] M-RoPE positions 0..{p + r - 1} on every axis), got shape "
                    f"{tuple(pos.shape)}"
                )
            uids.append(mb_uids[k])
            prompt_lens.append(p)
            response_lens.append(r)
            sequences.append(seq)
            visions.append(vision)
    return find_trees(uids, prompt_lens, response_lens, sequences, call_lens, visions)


def vision_splits(trees: list[Tree]) -> int:
    """How many of ``trees`` (``build_trees``') with images are a second or later tree of one uid and prompt, split
    from the first because their images (or positions) differ."""
    prompts = {(tree.uid, tree.prompt.cpu().numpy().tobytes()) for tree in trees if tree.vision is not None}
    return sum(tree.vision is not None for tree in trees) - len(prompts)


def _vision(inputs: dict | None, positions: torch.Tensor, p: int, r: int, where: str, device) -> Vision | None:
    """A row's images (``groups.Vision``, on ``device``) from its ``multi_modal_inputs`` and position ids [MROPE_AXES,
    p + r]; None for a text row (verl's agent loop gives one an empty dict). ``ValueError`` naming the row (``where``)
    for videos, other inputs, or positions that are not M-RoPE ones continuing the prompt's through the response."""
    if not inputs:
        return None
    if set(inputs) - {"images_seqlens"} != {"pixel_values", "image_grid_thw"}:
        raise ValueError(
            f"{where}: multi_modal_inputs with {', '.join(sorted(inputs))}; the augtree engine replays images "
            f"(pixel_values, image_grid_thw) only; train videos and other inputs on verl's stock engine: {STOCK_ENGINE}"
        )
    if positions.dim() != 2 or positions.shape[0] != MROPE_AXES:
        raise ValueError(
            f"{where}: a row with images needs [{MROPE_AXES}, L] position ids, got {tuple(positions.shape)}"
        )
    # verl's agent loop adds each image frame's patch count (its MFU metric reads them): the grid's, or a bad row.
    grid = inputs["image_grid_thw"]
    if "images_seqlens" in inputs and not torch.equal(
        torch.as_tensor(inputs["images_seqlens"]).cpu(),
        torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).cpu(),
    ):
        raise ValueError(f"{where}: images_seqlens {inputs['images_seqlens']} do not match image_grid_thw {grid}")
    vision = Vision(inputs["pixel_values"].to(device), grid.to(device), positions[:, :p])
    text = torch.arange(p, p + r, device=positions.device)
    want = torch.stack([text] + [text + vision.shift] * (MROPE_AXES - 1))
    if not torch.equal(positions[0, :p], torch.arange(p, device=positions.device)) or not torch.equal(
        positions[:, p:], want
    ):
        raise ValueError(
            f"{where}: position_ids must be 0..{p + r - 1} on the text axis and continue the prompt's M-RoPE positions "
            f"(from {p + vision.shift}) through the response on every axis, as verl's agent loop builds them"
        )
    return vision


def _text_positions(positions: torch.Tensor, length: int) -> bool:
    """Whether a row's verl position ids are the replay's own (0..length-1 for every token): [L], or a
    vision-language model's [MROPE_AXES, L] on a text-only row (verl's agent loop: text positions and
    ``get_rope_index``'s three M-RoPE axes, each 0..L-1 without images). The replay reads nothing else of them."""
    want = torch.arange(length, device=positions.device)
    if positions.dim() == 2 and positions.shape[0] == MROPE_AXES:
        want = want.expand(MROPE_AXES, -1)
    return positions.shape == want.shape and torch.equal(positions, want)
