"""``groups``' work estimate is verl's (the stock trainer balances by it), without importing verl at the ground
floor."""

from __future__ import annotations

import torch
from verl.utils.seqlen_balancing import calculate_workload

from augtree_verl.groups import sequence_workload, tree_workload


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
