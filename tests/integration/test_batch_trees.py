"""Regrouping verl rows into replay trees: by tree id (uid, prompt length) and prompt, any order, across
micro-batches."""

from __future__ import annotations

import pytest
import torch
from verl.utils import tensordict_utils as tu

from augtree_verl.integration.batch_trees import build_trees
from augtree_verl.testing import harness as H


def _row(uid, prompt, response):
    return dict(uid=uid, prompt=torch.tensor(prompt), response=torch.tensor(response), advantage=1.0)


def test_rows_group_by_uid_and_prompt_across_micro_batches():
    rows = [
        _row("a", [1, 2, 3], [4]),
        _row("b", [5], [6, 7]),
        _row("a", [1, 2, 3], [8, 9]),
        _row("a", [1, 2, 4], [10]),  # same uid, other prompt: its own tree
        _row("c", [7, 7], [1]),
        _row("a", [1, 2, 3], [11, 12, 13]),
        _row("b", [5], [2]),
    ]
    rows.append(_row("pad", [0, 0], [0]))  # a padding sample (response masked out) is a tree of its own
    batch = H.rows_to_batch(rows)
    micro_batches = tu.chunk_tensordict(batch, 4)  # rows (0,1) (2,3) (4,5) (6,7)
    trees = build_trees(micro_batches)
    as_lists = [(t.uid, t.prompt.tolist(), [r.tolist() for r in t.responses]) for t in trees]
    assert as_lists == [
        ("a", [1, 2, 3], [[4], [8, 9], [11, 12, 13]]),
        ("b", [5], [[6, 7], [2]]),
        ("a", [1, 2, 4], [[10]]),
        ("c", [7, 7], [[1]]),
        ("pad", [0, 0], [[0]]),
    ]
    # rows numbered through the micro-batches; the two prompts of group "a" share the trainer's tree id
    assert [t.samples for t in trees] == [(0, 2, 5), (1, 6), (3,), (4,), (7,)]
    assert [t.tree_id for t in trees] == ["a|3", "b|1", "a|3", "c|2", "pad|2"]
    assert [t.response_lens for t in trees] == [(1, 2, 3), (2, 1), (1,), (1,), (1,)]
    # each row's stock-engine call: its micro-batch's longest row (4, 5, 6 and 3 tokens)
    assert [t.call_lens for t in trees] == [(4, 5, 6), (4, 3), (5,), (6,), (3,)]


def test_non_contiguous_positions_are_rejected_naming_the_row():
    batch = H.rows_to_batch([_row("a", [1, 2], [3]), _row("b", [4], [5, 6])])
    batch["position_ids"] = torch.nested.as_nested_tensor(
        [torch.tensor([0, 1, 2]), torch.tensor([0, 1, 5])], layout=torch.jagged
    )
    with pytest.raises(ValueError, match=r"micro-batch 0 row 1 \(uid 'b'\): position_ids"):
        build_trees([batch])
