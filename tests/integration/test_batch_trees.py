"""Regrouping verl rows into replay trees: by (uid, prompt), any order, across micro-batches."""

from __future__ import annotations

import pytest
import torch
from verl.utils import tensordict_utils as tu

from augtree_verl.integration.batch_trees import build_trees
from augtree_verl.testing import harness as H


def _row(uid, prompt, response):
    return dict(uid=uid, prompt=torch.tensor(prompt), response=torch.tensor(response), advantage=1.0)


def test_rows_group_by_uid_and_prompt_across_micro_batches():
    rows = [_row("a", [1, 2, 3], [4]), _row("b", [5], [6, 7]), _row("a", [1, 2, 3], [8, 9]),
            _row("a", [1, 2, 4], [10]),  # same uid, other prompt: its own tree
            _row("c", [7, 7], [1]), _row("a", [1, 2, 3], [11, 12, 13]), _row("b", [5], [2])]
    rows.append(_row("pad", [0, 0], [0]))  # a padding sample (response masked out) is a tree of its own
    batch = H.rows_to_batch(rows)
    micro_batches = tu.chunk_tensordict(batch, 4)  # rows (0,1) (2,3) (4,5) (6,7)
    grouped = build_trees(micro_batches)
    as_lists = [(u, t.prompt.tolist(), [r.tolist() for r in t.responses]) for u, t in zip(grouped.uids, grouped.trees)]
    assert as_lists == [("a", [1, 2, 3], [[4], [8, 9], [11, 12, 13]]), ("b", [5], [[6, 7], [2]]),
                        ("a", [1, 2, 4], [[10]]), ("c", [7, 7], [[1]]), ("pad", [0, 0], [[0]])]
    assert grouped.rows[0] == [(0, 0), (1, 0), (2, 1)]
    assert all(grouped.slot[row] == (t, i) for t, rows_t in enumerate(grouped.rows) for i, row in enumerate(rows_t))


def test_non_contiguous_positions_are_rejected_naming_the_row():
    batch = H.rows_to_batch([_row("a", [1, 2], [3]), _row("b", [4], [5, 6])])
    batch["position_ids"] = torch.nested.as_nested_tensor([torch.tensor([0, 1, 2]), torch.tensor([0, 1, 5])],
                                                          layout=torch.jagged)
    with pytest.raises(ValueError, match=r"micro-batch 0 row 1 \(uid 'b'\): position_ids"):
        build_trees([batch])
