"""A batch's samples as replay trees (one prompt and its responses) and a tree's estimated replay work.

Shared by the trainer (group-aware balance, plans per tree) and the engine (scheduling trees over a CP
group), so neither imports the other. Inputs are per-sample lists in batch order: ``uids``,
``prompt_lens`` and ``response_lens`` (tokens). Samples that share a uid but not a prompt length (e.g.
multi-turn outputs) are separate trees of one group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from verl.utils.seqlen_balancing import calculate_workload


@dataclass(frozen=True)
class Tree:
    """One replay tree: a prompt and the batch samples that respond to it.

    ``samples[i]`` is the batch index of the tree's i-th response, ``response_lens[i]`` its length;
    the order is the order of first appearance in the batch (the order the planner sees).
    """

    tree_id: str
    uid: str
    prompt_len: int
    samples: tuple[int, ...]
    response_lens: tuple[int, ...]


def tree_workload(prompt_len: int, response_lens: Sequence[int]) -> int:
    """Estimated work of replaying one tree with the prompt run once.

    With verl's per-sequence estimate w(s) = ``calculate_workload(s)`` (linear layers + causal
    attention), a flattened group costs sum_i w(P + R_i). Running the prompt once removes G - 1 prompt
    passes and keeps each response's attention to the prompt (the 2·P·R_i cross term of w(P + R_i)),
    so the tree costs sum_i w(P + R_i) - (G - 1)·w(P).
    """
    lens = torch.tensor([prompt_len] + [prompt_len + r for r in response_lens], dtype=torch.int64)
    work = calculate_workload(lens)
    return int(work[1:].sum() - (len(response_lens) - 1) * work[0])


def find_trees(uids: Sequence, prompt_lens: Sequence[int], response_lens: Sequence[int]) -> list[Tree]:
    """Group samples into replay trees keyed by (uid, prompt length); raise ValueError on bad input."""
    if not len(uids) == len(prompt_lens) == len(response_lens):
        raise ValueError(
            f"uids, prompt_lens and response_lens must have one entry per sample, got "
            f"{len(uids)}, {len(prompt_lens)} and {len(response_lens)}")
    members: dict[tuple[str, int], list[int]] = {}
    for i, (uid, p, r) in enumerate(zip(uids, prompt_lens, response_lens)):
        if not isinstance(uid, str) or not uid:
            raise ValueError(f"sample {i} has uid {uid!r}; every sample needs a non-empty string uid")
        if int(p) < 1 or int(r) < 1:
            raise ValueError(
                f"sample {i} of group {uid!r} has prompt_len={p}, response_len={r}; both must be >= 1")
        members.setdefault((uid, int(p)), []).append(i)
    return [Tree(tree_id=f"{uid}|{p}", uid=uid, prompt_len=p, samples=tuple(idx),
                 response_lens=tuple(int(response_lens[i]) for i in idx))
            for (uid, p), idx in members.items()]
