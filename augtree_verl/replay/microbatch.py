"""Token-budget micro-batching of a tree's responses (padded rows)."""

from __future__ import annotations

DEFAULT_MICRO_BATCH_TOKENS = 8192  # a response micro-batch's token budget (rows x longest row)


def split_micro_batches(lengths: list[int], budget_tokens: int) -> list[list[int]]:
    """Group response indices so that rows x longest row <= ``budget_tokens`` (a lone row may exceed it).

    Responses are taken longest first, so each micro-batch holds rows of similar length and padding
    stays small. Returns lists of indices into ``lengths``; every index appears exactly once.
    """
    if budget_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        # Rows are sorted longest first, so the first row of a batch is its longest.
        if batches and (len(batches[-1]) + 1) * max(lengths[batches[-1][0]], 1) <= budget_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
