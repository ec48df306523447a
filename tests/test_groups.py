"""``groups``' work estimate is verl's (the stock trainer balances by it), without importing verl at the ground
floor; ``GroupLengths`` checks a tree's lengths once, naming the bad value."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from verl.utils.seqlen_balancing import calculate_workload

from augtree_verl.groups import GroupLengths, Tree, sequence_workload, tree_workload


def test_sequence_workload_is_verls():
    lens = torch.tensor([1, 7, 1024, 32768], dtype=torch.int64)
    assert torch.equal(sequence_workload(lens), calculate_workload(lens))


def test_tree_workload_counts_the_prompt_once():
    w = lambda s: int(calculate_workload(torch.tensor([s]))[0])
    assert tree_workload(100, [5, 7]) == w(105) + w(107) - w(100)


def test_ground_floor_imports_no_verl():
    import subprocess
    import sys

    code = "import sys, augtree_verl.groups, augtree_verl.model_shape, augtree_verl.plan; print('verl' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_group_lengths_hold_ints_and_compare_by_value():
    lengths = GroupLengths(np.int64(300), [40, np.int32(50)])
    assert (lengths.prompt_len, lengths.response_lens) == (300, (40, 50))
    assert type(lengths.prompt_len) is int and all(type(r) is int for r in lengths.response_lens)
    assert lengths == GroupLengths(300, (40, 50)) != GroupLengths(300, (50, 40))
    assert pickle.loads(pickle.dumps(lengths)) == lengths  # what Ray does with it
    with pytest.raises(AttributeError):
        lengths.prompt_len = 1  # frozen


@pytest.mark.parametrize(
    "prompt_len, response_lens, message",
    [
        (0, [5], "prompt_len must be a positive int, got 0"),
        (-3, [5], "prompt_len must be a positive int, got -3"),
        (True, [5], "prompt_len must be a positive int, got True"),
        (10.0, [5], "prompt_len must be a positive int, got 10.0"),
        ("10", [5], "prompt_len must be a positive int, got '10'"),
        (10, [], "response_lens is empty: a tree needs at least one response"),
        (10, 5, "response_lens must be a sequence of positive ints, got 5"),
        (10, [5, 0], r"response_lens\[1\] must be a positive int, got 0"),
        (10, [5, 7, False], r"response_lens\[2\] must be a positive int, got False"),
        (10, [2.5], r"response_lens\[0\] must be a positive int, got 2.5"),
    ],
)
def test_group_lengths_name_the_bad_value(prompt_len, response_lens, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        GroupLengths(prompt_len, response_lens)


def test_a_trees_lengths_name_the_tree():
    assert Tree(uid="a", prompt_len=10, response_lens=(5, 7)).lengths == GroupLengths(10, [5, 7])
    with pytest.raises(ValueError, match=r"^tree 'b\|10' \(group 'b'\): response_lens\[1\] must be a positive int"):
        _ = Tree(uid="b", prompt_len=10, response_lens=(5, 0)).lengths
