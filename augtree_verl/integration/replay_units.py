"""Which of verl's micro-batches a training step replays together: one autograd graph, one backward per unit.

A unit's graph holds the activations of all its trees (each prompt once, every response) until its backward,
so the unit plays the role a micro-batch plays in verl's stock engine: it bounds activation memory. verl's
micro-batches split groups (a fixed number of rows each, or rows balanced by tokens under dynamic batch
size); micro-batches that hold samples of the same tree join one unit, so that tree's prompt runs once for
all of them, while the unit's tokens (each prompt counted once, plus every response) stay within the largest
micro-batch's tokens (prompt + response per sample: what the stock engine holds at once). A tree spread over
several units is replayed in parts, its prompt once per part; the result is exact either way.
"""

from __future__ import annotations

from augtree_verl.integration.batch_trees import BatchTrees


def replay_units(grouped: BatchTrees, num_micro_batches: int) -> list[list[int]]:
    """Partition micro-batches ``0 .. num_micro_batches - 1`` (of ``grouped``'s rows) into units.

    Greedy in micro-batch order: a micro-batch joins the unit it shares the most prompt tokens with, if the
    merged unit stays within the budget; otherwise it opens a unit. Returns the units, each a sorted list of
    micro-batch indices, ordered by their first micro-batch; every index appears exactly once.
    """
    trees_in: list[set[int]] = [set() for _ in range(num_micro_batches)]
    response_tokens = [0] * num_micro_batches
    sequence_tokens = [0] * num_micro_batches
    for t, rows in enumerate(grouped.rows):
        prompt_len = grouped.trees[t].prompt_len
        for (m, _), response in zip(rows, grouped.trees[t].responses):
            trees_in[m].add(t)
            response_tokens[m] += response.shape[0]
            sequence_tokens[m] += prompt_len + response.shape[0]
    budget = max(sequence_tokens, default=0)

    def prompt_tokens(trees) -> int:
        return sum(grouped.trees[t].prompt_len for t in trees)

    units: list[tuple[list[int], set[int], int]] = []  # (micro-batches, trees, tokens with each prompt once)
    for m in range(num_micro_batches):
        own = prompt_tokens(trees_in[m]) + response_tokens[m]
        best, best_shared = None, 0
        for u, (_, trees, tokens) in enumerate(units):
            shared = prompt_tokens(trees_in[m] & trees)
            if shared > best_shared and tokens + own - shared <= budget:
                best, best_shared = u, shared
        if best is None:
            units.append(([m], set(trees_in[m]), own))
        else:
            members, trees, tokens = units[best]
            units[best] = (members + [m], trees | trees_in[m], tokens + own - best_shared)
    return [members for members, _, _ in units]
