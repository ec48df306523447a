"""Replay units: verl's micro-batches that share trees replay together, within the stock engine's token bound."""

from __future__ import annotations

import random

import torch

from augtree_verl.integration.batch_trees import BatchTrees
from augtree_verl.integration.replay_units import replay_units
from augtree_verl.replay import ReplayTree


def _grouped(prompt_lens: list[int], micro_batches: list[list[tuple[int, int]]]) -> BatchTrees:
    """``micro_batches[m]`` = rows as (tree, response length); trees have the given prompt lengths."""
    out = BatchTrees(trees=[ReplayTree(prompt=torch.zeros(p, dtype=torch.long), responses=[]) for p in prompt_lens],
                     rows=[[] for _ in prompt_lens])
    for m, rows in enumerate(micro_batches):
        for k, (t, r) in enumerate(rows):
            out.trees[t].responses.append(torch.zeros(r, dtype=torch.long))
            out.rows[t].append((m, k))
    return out


def _unit_tokens(grouped: BatchTrees, unit: list[int]) -> int:
    """Tokens of a unit with each tree's prompt counted once."""
    total = 0
    for tree, rows in zip(grouped.trees, grouped.rows):
        lens = [r.shape[0] for r, (m, _) in zip(tree.responses, rows) if m in unit]
        total += (tree.prompt_len + sum(lens)) if lens else 0
    return total


def test_micro_batches_of_one_group_join_while_prompt_sharing_keeps_them_small():
    # Prompt-heavy: two groups of 8 (prompt 1024, responses 64) in micro-batches of 2 rows (2176 tokens each).
    # A whole group is 1024 + 8 * 64 = 1536 tokens, so each group becomes one unit; groups never merge.
    micro_batches = [[(t, 64), (t, 64)] for t in (0, 0, 0, 0, 1, 1, 1, 1)]
    assert replay_units(_grouped([1024, 1024], micro_batches), 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_response_heavy_micro_batches_stay_apart():
    # Prompt 64, responses 1024: two micro-batches of one group would hold 64 + 4 * 1024 > 2 * 1088 tokens.
    micro_batches = [[(0, 1024), (0, 1024)]] * 4
    assert replay_units(_grouped([64], micro_batches), 4) == [[0], [1], [2], [3]]


def test_micro_batches_without_a_shared_tree_stay_apart():
    # Micro-batch 1 would fit in micro-batch 0's unit (12 + 2 <= 20 tokens) but shares no prompt with it.
    micro_batches = [[(0, 2), (0, 2)], [(1, 1)], [(0, 2), (0, 2)]]
    assert replay_units(_grouped([8, 1], micro_batches), 3) == [[0, 2], [1]]


def test_a_micro_batch_joins_the_unit_it_shares_most_prompt_with():
    # Micro-batch 2 holds trees 0 (prompt 4) and 1 (prompt 20): it joins tree 1's unit.
    micro_batches = [[(0, 1), (0, 1)], [(1, 1), (1, 1)], [(0, 1), (1, 1)]]
    assert replay_units(_grouped([4, 20], micro_batches), 3) == [[0], [1, 2]]


def test_units_cover_every_micro_batch_once_within_the_largest_micro_batch():
    rng = random.Random(0)
    for _ in range(200):
        prompt_lens = [rng.randint(1, 50) for _ in range(rng.randint(1, 5))]
        rows = [(t, rng.randint(1, 30)) for t in range(len(prompt_lens)) for _ in range(rng.randint(1, 6))]
        rng.shuffle(rows)
        size = rng.randint(1, 4)
        micro_batches = [rows[i: i + size] for i in range(0, len(rows), size)]
        grouped = _grouped(prompt_lens, micro_batches)
        units = replay_units(grouped, len(micro_batches))
        assert sorted(m for unit in units for m in unit) == list(range(len(micro_batches)))
        assert all(unit == sorted(unit) for unit in units) and [u[0] for u in units] == sorted(u[0] for u in units)
        budget = max(sum(prompt_lens[t] + r for t, r in mb) for mb in micro_batches)
        for unit in units:
            assert len(unit) == 1 or _unit_tokens(grouped, unit) <= budget, (micro_batches, unit)
