"""Regroup a verl batch (rows in any order, split into verl's micro-batches) into replay trees.

A tree is one (uid, prompt): samples that share a uid but not a prompt become separate trees, a group of
one is a tree of one response, and a group whose samples land in different micro-batches is still one tree
(its prompt runs once per rank). Samples of a group on another rank form that rank's own tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from augtree_verl.replay import ReplayTree

Row = tuple[int, int]  # (micro-batch index, row within the micro-batch)


@dataclass
class BatchTrees:
    """``trees[t]`` with ``rows[t][i]`` the batch row of its response i; ``slot[row] = (t, i)``."""

    trees: list[ReplayTree] = field(default_factory=list)
    rows: list[list[Row]] = field(default_factory=list)
    uids: list[str] = field(default_factory=list)
    slot: dict[Row, tuple[int, int]] = field(default_factory=dict)


def sequence_lengths(micro_batch: TensorDict) -> tuple[list[int], list[int]]:
    """Per row, (prompt length, response length), read the way verl's ``no_padding_2_padding`` reads them."""
    prompts, responses = micro_batch["prompts"], micro_batch["responses"]
    if prompts.is_nested:
        return prompts.offsets().diff().tolist(), responses.offsets().diff().tolist()
    mask = micro_batch["attention_mask"]  # V0 layout: [left-padded prompt | right-padded response]
    width = prompts.shape[1]
    return mask[:, :width].sum(dim=1).tolist(), mask[:, width:].sum(dim=1).tolist()


def build_trees(micro_batches: list[TensorDict]) -> BatchTrees:
    """Group every row of ``micro_batches`` into trees; ValueError naming the row for malformed input."""
    out = BatchTrees()
    index: dict[tuple[str, bytes], int] = {}
    for m, mb in enumerate(micro_batches):
        uids = [str(u) for u in mb["uid"]]
        prompt_lens, response_lens = sequence_lengths(mb)
        sequences = mb["input_ids"].unbind()
        positions = mb["position_ids"].unbind()
        for k, (seq, pos) in enumerate(zip(sequences, positions)):
            p, r = prompt_lens[k], response_lens[k]
            where = f"micro-batch {m} row {k} (uid {uids[k]!r})"
            if seq.dim() != 1 or seq.shape[0] != p + r:
                raise ValueError(f"{where}: input_ids has shape {tuple(seq.shape)} but prompt + response is {p} + {r}")
            if p < 1 or r < 1:
                raise ValueError(f"{where}: prompt length {p} and response length {r} must both be >= 1")
            if pos.dim() != 1 or not torch.equal(pos, torch.arange(p + r, device=pos.device)):
                raise ValueError(f"{where}: position_ids must be 0..{p + r - 1} (text-only, unpadded sequences)")
            prompt = seq[:p]
            key = (uids[k], prompt.cpu().numpy().tobytes())
            t = index.get(key)
            if t is None:
                t = index[key] = len(out.trees)
                out.trees.append(ReplayTree(prompt=prompt, responses=[]))
                out.rows.append([])
                out.uids.append(uids[k])
            out.slot[(m, k)] = (t, len(out.rows[t]))
            out.trees[t].responses.append(seq[p:])
            out.rows[t].append((m, k))
    return out
