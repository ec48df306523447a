"""Group-aware data-parallel balance: keep a group's samples on one rank, balance estimated replay work.

verl's stock balance (``PPOTrainer._balance_batch``) spreads *samples* over data-parallel ranks by
sequence-length workload, so the G responses of one prompt land on different ranks and every rank
replays the prompt again. AugTree replays a prompt once per group on a rank, so the unit of balance is
the group (all samples with one ``uid``), and its work counts the prompt once.

Inputs are per-sample lists (one entry per sample of the batch, in batch order): ``uids``,
``prompt_lens`` and ``response_lens`` (tokens). Samples that share a uid but not a prompt length (e.g.
multi-turn outputs) are separate *trees* of one group: they stay together on a rank but each tree
pays its own prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

from augtree_verl.groups import find_trees, tree_workload


class WorkModel:
    """Work of any subset of the batch's samples: its trees' workloads, each prompt counted once per subset."""

    def __init__(self, uids, prompt_lens, response_lens):
        self.uids, self.prompt_lens, self.response_lens = uids, prompt_lens, response_lens

    def __call__(self, samples: Sequence[int]) -> int:
        by_tree: dict[tuple[str, int], list[int]] = {}
        for i in samples:
            by_tree.setdefault((self.uids[i], int(self.prompt_lens[i])), []).append(int(self.response_lens[i]))
        return sum(tree_workload(p, rs) for (_, p), rs in by_tree.items())


def _units_by_uid(samples: Sequence[int], uids: Sequence) -> list[list[int]]:
    units: dict[str, list[int]] = {}
    for i in samples:
        units.setdefault(uids[i], []).append(i)
    return list(units.values())


def _pack(units: list[list[int]], work: WorkModel, num_bins: int, capacity: int) -> list[list[int]]:
    """Put ``units`` (sample lists) into ``num_bins`` bins of exactly ``capacity`` samples each.

    Units stay whole where they fit. When all units have one size that divides the capacity (the usual
    GRPO batch: every group has n samples), verl's Karmarkar-Karp partition balances unit workloads
    with equal unit counts per bin. Otherwise (padding samples, uneven groups): largest units first (they
    are the hard ones to fit; heavier first among equals), each into the least-loaded bin with room;
    units that fit nowhere are split last, into the bins with the most room first, so they break into
    as few pieces as possible.
    """
    unit_work = [work(u) for u in units]
    sizes = {len(u) for u in units}
    if len(sizes) == 1 and capacity % next(iter(sizes)) == 0:
        parts = get_seqlen_balanced_partitions(unit_work, k_partitions=num_bins, equal_size=True)
        return [[i for u in sorted(part) for i in units[u]] for part in parts]

    bins: list[list[int]] = [[] for _ in range(num_bins)]
    load = [0] * num_bins
    deferred = []
    for u in sorted(range(len(units)), key=lambda u: (-len(units[u]), -unit_work[u], u)):
        fits = [b for b in range(num_bins) if capacity - len(bins[b]) >= len(units[u])]
        if not fits:
            deferred.append(units[u])
            continue
        b = min(fits, key=lambda b: (load[b], b))
        bins[b].extend(units[u])
        load[b] += unit_work[u]
    for unit in deferred:
        rest = list(unit)
        while rest:
            b = max(range(num_bins), key=lambda b: (capacity - len(bins[b]), -load[b], -b))
            piece, rest = rest[: capacity - len(bins[b])], rest[capacity - len(bins[b]) :]
            bins[b].extend(piece)
            load[b] += work(piece)
    return bins


def balance_groups(
    uids: Sequence, prompt_lens: Sequence[int], response_lens: Sequence[int], num_ranks: int, num_mini_batches: int = 1
) -> list[list[int]]:
    """Assign every sample to a data-parallel rank, keeping groups (same uid) on one rank where possible.

    Returns ``num_ranks`` lists of batch indices, each of ``N / num_ranks`` samples. verl hands rank r the
    r-th contiguous chunk of the reordered batch and each rank cuts its chunk into ``num_mini_batches``
    contiguous PPO mini-batches, one optimizer step each, all ranks in lockstep. So the balance is done
    per mini-batch: groups are first spread over mini-batches, then each mini-batch over ranks, and rank
    r's list is its slot of mini-batch 0, then of mini-batch 1, and so on.
    """
    find_trees(uids, prompt_lens, response_lens)  # raises on bad per-sample input, naming the sample
    n = len(uids)
    if num_ranks < 1 or num_mini_batches < 1:
        raise ValueError(f"num_ranks={num_ranks} and num_mini_batches={num_mini_batches} must be >= 1")
    if n == 0 or n % (num_ranks * num_mini_batches):
        raise ValueError(
            f"batch of {n} samples does not split into {num_mini_batches} mini-batches x {num_ranks} ranks "
            f"of equal size (verl pads the batch to a multiple of both before balancing)"
        )
    work = WorkModel(uids, prompt_lens, response_lens)
    mini_batches = _pack(_units_by_uid(range(n), uids), work, num_mini_batches, n // num_mini_batches)
    slot = n // (num_mini_batches * num_ranks)
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    for mini_batch in mini_batches:
        for r, part in enumerate(_pack(_units_by_uid(mini_batch, uids), work, num_ranks, slot)):
            ranks[r].extend(part)
    return ranks


def split_groups(uids: Sequence, partitions: Sequence[Sequence[int]]) -> int:
    """How many groups (uids) have samples on more than one partition."""
    homes: dict[str, set[int]] = {}
    for r, part in enumerate(partitions):
        for i in part:
            homes.setdefault(uids[i], set()).add(r)
    return sum(len(h) > 1 for h in homes.values())
