"""Regroup a verl batch (rows in any order, split into verl's micro-batches) into replay trees.

A tree is one ``groups.tree_id`` (uid, prompt length), the trainer's; samples under one id whose prompt
tokens differ become separate trees (``groups.find_trees``), a group of one is a tree of one response, and
a group whose samples land in different micro-batches is still one tree (its prompt runs once per rank).
Samples of a group on another rank form that rank's own tree. Rows are numbered through the micro-batches
in order (``Tree.samples``). Each row carries the length of the call verl's stock engine runs it in
(``Tree.call_lens``): its micro-batch's longest row, as the stock engine packs a micro-batch's rows into one
call (positions restarting at each row), which is what a length-dependent rope sees (``replay.rope``).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from augtree_verl.groups import MROPE_AXES, Tree, find_trees


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
    for m, mb in enumerate(micro_batches):
        mb_uids = [str(u) for u in mb["uid"]]
        mb_prompt_lens, mb_response_lens = sequence_lengths(mb)
        call_lens += [max(p + r for p, r in zip(mb_prompt_lens, mb_response_lens))] * len(mb_uids)
        for k, (seq, pos) in enumerate(zip(mb["input_ids"].unbind(), mb["position_ids"].unbind())):
            p, r = mb_prompt_lens[k], mb_response_lens[k]
            where = f"micro-batch {m} row {k} (uid {mb_uids[k]!r})"
            if seq.dim() != 1 or seq.shape[0] != p + r:
                raise ValueError(f"{where}: input_ids has shape {tuple(seq.shape)} but prompt + response is {p} + {r}")
            if p < 1 or r < 1:
                raise ValueError(f"{where}: prompt length {p} and response length {r} must both be >= 1")
            if not _text_positions(pos, p + r):
                raise ValueError(
                    f"{where}: position_ids must be 0..{p + r - 1} (text-only, unpadded sequences; a vision-language "
                    f"model's [{MROPE_AXES}, L] M-RoPE positions 0..{p + r - 1} on every axis), got shape "
                    f"{tuple(pos.shape)}"
                )
            uids.append(mb_uids[k])
            prompt_lens.append(p)
            response_lens.append(r)
            sequences.append(seq)
    return find_trees(uids, prompt_lens, response_lens, sequences, call_lens)


def _text_positions(positions: torch.Tensor, length: int) -> bool:
    """Whether a row's verl position ids are the replay's own (0..length-1 for every token): [L], or a
    vision-language model's [MROPE_AXES, L] on a text-only row (verl's agent loop: text positions and
    ``get_rope_index``'s three M-RoPE axes, each 0..L-1 without images). The replay reads nothing else of them."""
    want = torch.arange(length, device=positions.device)
    if positions.dim() == 2 and positions.shape[0] == MROPE_AXES:
        want = want.expand(MROPE_AXES, -1)
    return positions.shape == want.shape and torch.equal(positions, want)
