"""The schedule of a trie whose root runs context-parallel (``replay.cp_trie``): pure data from the trie and
the degree (no model, no tensors), read by the lock-step shape (``replay.lockstep``), the run
(``replay.cp_trie``) and the planner's cost model, so that it is written once.

A member of the root's subgroup replays its share of the root's children on one device: the root's leaf
micro-batches and inner subtrees, dealt heaviest first to the member with the least work so far.
"""

from __future__ import annotations

from dataclasses import dataclass

from augtree_verl.replay.trie import TrieNode


@dataclass(frozen=True)
class CPTrieShare:
    """Member ``member``'s part of a trie with a context-parallel root of ``degree`` members: ``batches``
    (indices into ``root.micro_batches``) and ``inner`` (indices into ``root.inner``), in the order it runs
    them."""

    member: int
    degree: int
    batches: tuple[int, ...]
    inner: tuple[int, ...]


def cp_trie_refusal(root: TrieNode) -> str | None:
    """Why ``root``'s trie cannot run with a context-parallel root (None: it can): the root must hand every
    token it holds to its children, scoring none and ending no row."""
    if not root.children:
        return "its root has no children"
    if root.score_from is not None or root.ends:
        return "rows score or end inside its root"
    return None


def cp_trie_shares(root: TrieNode, degree: int) -> list[CPTrieShare]:
    """Every member's share of ``root``'s children (its ``micro_batches`` must be set, ``lockstep``): the leaf
    micro-batches (work: rows x longest row) and the inner subtrees (work: their ``weight``), heaviest first,
    each to the member with the least work so far (ties: the lowest member). The same on every member."""
    leaves = root.leaves
    items = [(len(mb) * max(leaves[k].length for k in mb), 0, b) for b, mb in enumerate(root.micro_batches)]
    items += [(child.weight, 1, j) for j, child in enumerate(root.inner)]
    load = [0] * degree
    picked: list[tuple[list[int], list[int]]] = [([], []) for _ in range(degree)]
    for work, kind, index in sorted(items, key=lambda item: (-item[0], item[1], item[2])):
        member = min(range(degree), key=lambda m: (load[m], m))
        load[member] += work
        picked[member][kind].append(index)
    return [CPTrieShare(m, degree, tuple(sorted(b)), tuple(sorted(i))) for m, (b, i) in enumerate(picked)]
