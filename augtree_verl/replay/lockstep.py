"""The lock-step shape of one step on one rank: its slots, agreed over an FSDP group.

A slot is one tree's (or trie's) parts: one prompt forward, ``calls`` response calls (one decoder call and
one LM-head call each, and in training a backward each), and in training one delayed prompt backward. FSDP2
(ZeRO-3) all-gathers a layer's parameters in every model call and reduce-scatters its gradient in every
backward, with collectives of the same size for every layer: if two ranks issue different call sequences,
layer i on one rank is paired with layer j on another (silently wrong weights, not a hang). So the ranks
of a group agree on one shape and pad with one-token dummy calls.

Phases by CP degree, largest first (C, ..., 2, then 1); degree d > 1 has two. The first holds the
context-parallel trees of degree d: slot j holds, on every member of a d-subgroup, that subgroup's j-th
tree (ordered by (most CP steps over its members, index), which every member computes identically from
the shared trees and plans); its calls are the steps of the tree's CP schedule (``cp.schedule``). The
second holds the tries whose root runs context-parallel over a d-subgroup (``replay.cp_trie``): the
root's ring prefill, this member's share of its children (``cp_trie_schedule``) in the shape every
member's fits in, then the root's delayed backward. Phase 1 holds each rank's own tries (``replay.trie``:
its trees' rows, shared prefixes found from the tokens; a group is a depth-1 trie), the largest (by calls)
first. A trie slot's ``shape`` nests: its root's prefill (and one LM-head call where
it scores tokens), its leaves' micro-batches (``calls``), then each inner child's shape in turn, then the
delayed backward. Per phase the number of slots is the most any rank has, and per slot the shape every
rank's fits in (CP: the most calls, two small all-reduces; tries: the node-by-node maximum of the shapes,
one all-gather); a rank short of work pads with dummy slots (``Slot.tree is None``), dummy nodes and dummy
calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from augtree_verl.cp.schedule import CPTreeSchedule, cp_tree_schedule
from augtree_verl.replay.cp_trie_schedule import CPTrieShare, cp_trie_shares
from augtree_verl.replay.trie import StepTrie, TrieNode


@dataclass(frozen=True)
class Shape:
    """A trie node's lock-step shape: its prefill (with an LM-head call when ``scored``, through the vision tower
    when ``tower``: a prompt's images or, where another rank's has them, the dummy tower call, ``replay.vlm``),
    ``calls`` leaf calls, then each of ``children``' shapes."""

    scored: bool = False
    calls: int = 0
    children: tuple[Shape, ...] = ()
    tower: bool = False

    @classmethod
    def of(cls, node: TrieNode, *, tower: bool = False) -> Shape:
        """``node``'s own shape (its ``micro_batches`` set); ``tower``: its prefill runs a prompt's images."""
        return cls(node.score_from is not None, len(node.micro_batches), tuple(cls.of(c) for c in node.inner), tower)

    def union(self, other: Shape) -> Shape:
        """The smallest shape both fit in (children matched by position)."""
        n = max(len(self.children), len(other.children))
        kids = [
            (self.children[j] if j < len(self.children) else Shape()).union(
                other.children[j] if j < len(other.children) else Shape()
            )
            for j in range(n)
        ]
        return Shape(self.scored or other.scored, max(self.calls, other.calls), tuple(kids), self.tower or other.tower)

    @property
    def total_calls(self) -> int:
        return self.calls + sum(c.total_calls for c in self.children)


@dataclass
class TrieSlot:
    """A trie on one device (phase 1; a group is a depth-1 trie): its root ``node`` (its inner nodes'
    ``micro_batches`` set) in the lock-step ``shape`` every rank's fits in. Run by ``tree_run.TrieRun``."""

    node: TrieNode
    shape: Shape
    degree: int = 1

    @property
    def trees(self) -> list[int]:
        return self.node.trees()

    @property
    def own_calls(self) -> int:
        return len(self.node.micro_batches)


@dataclass
class CPTreeSlot:
    """One tree context-parallel over a subgroup of ``degree`` ranks: this member's CP ``schedule`` of it, padded to
    the ``calls`` every member agreed (its steps, then dummy calls). Run by ``cp_tree.CPTreeRun``."""

    tree: int
    degree: int
    schedule: CPTreeSchedule
    calls: int = 0

    @property
    def trees(self) -> list[int]:
        return [self.tree]

    @property
    def own_calls(self) -> int:
        return len(self.schedule.steps)


@dataclass
class CPTrieSlot:
    """A trie whose root runs context-parallel over a subgroup of ``degree`` ranks (``replay.cp_trie``): its root
    ``node``, this member's ``share`` of the root's children, in the ``shape`` every member's fits in. Run by
    ``cp_trie.CPTrieRun``."""

    node: TrieNode
    degree: int
    share: CPTrieShare
    shape: Shape

    @property
    def trees(self) -> list[int]:
        return self.node.trees()

    @property
    def own_calls(self) -> int:
        return len(self.share.batches)


@dataclass
class DummySlot:
    """Padding where a rank has fewer slots in a phase than another: a one-token prefill, the ``shape``'s dummy
    calls and dummy children, one delayed backward (no trees). Run by ``tree_run.TrieRun``."""

    degree: int
    shape: Shape = field(default_factory=Shape)

    @property
    def trees(self) -> list[int]:
        return []

    @property
    def own_calls(self) -> int:
        return 0


Slot = TrieSlot | CPTreeSlot | CPTrieSlot | DummySlot  # one tree's or trie's place in the lock-step sequence


def lockstep_slots(
    trie: StepTrie,
    plans: list,
    *,
    mesh=None,
    subgroups=None,
    cp_roots: Sequence[tuple[TrieNode, int]] = (),
    group=None,
    device: torch.device | None = None,
) -> list[Slot]:
    """This rank's slots, in execution order (see the module docstring).

    ``trie``: the step's (its ``trees``, and the tries of the trees this rank runs on one device, ``trie.of``);
    ``plans[t]``: a ``Plan`` or None; ``mesh`` (``cp.mesh.CPMesh``) and ``subgroups[t]`` (the subgroup
    index of tree t, a CP rank for degree 1; see ``step_plan.assign_subgroups``) when any tree runs
    context-parallel, else every tree is this rank's and runs on one device. ``cp_roots``: (root, degree d)
    of the tries whose root runs context-parallel (``replay.cp_trie``; their trees' subgroups are of degree
    d, and their plans are not run). With ``group`` (a process group) the shape is agreed over it (int64
    all-reduces on ``device``, the model's, and one all-gather of the trie shapes); without, no padding.
    """
    trees = trie.trees
    in_cp_trie = {t for root, _ in cp_roots for t in root.trees()}
    degrees = [plan.degree if plan is not None else 1 for plan in plans]
    phases: list[tuple[int, bool, Sequence[Slot]]] = []  # (degree, shaped slots (tries), slots)
    for d in sorted(mesh.degrees if mesh is not None else (1,), reverse=True):
        if d == 1:
            mine = [
                t
                for t in range(len(trees))
                if degrees[t] == 1 and t not in in_cp_trie and (mesh is None or subgroups[t] == mesh.cp_rank)
            ]
            tries = [
                TrieSlot(root, Shape.of(root, tower=trees[root.trees()[0]].vision is not None))
                for root in trie.of(mine)
            ]
            tries.sort(key=lambda s: (-s.shape.total_calls, s.trees[0]))
            phases.append((1, True, tries))
            continue
        here = mesh.subgroup_index(d)
        mine = [t for t in range(len(trees)) if degrees[t] == d and subgroups[t] == here and t not in in_cp_trie]

        def schedule(t, rank):
            return cp_tree_schedule(plans[t], trees[t].prompt_len, list(trees[t].response_lens), rank)

        key = {t: max(len(schedule(t, r).steps) for r in range(d)) for t in mine}
        cp_trees = [
            CPTreeSlot(t, d, schedule(t, mesh.subgroup_rank(d))) for t in sorted(mine, key=lambda t: (-key[t], t))
        ]
        phases.append((d, False, cp_trees))
        roots = [root for root, rd in cp_roots if rd == d and subgroups[root.trees()[0]] == here]
        cp_tries = [_cp_trie_slot(root, d, mesh.subgroup_rank(d)) for root in roots]
        cp_tries.sort(key=lambda s: (-s.shape.total_calls, s.trees[0]))
        phases.append((d, True, cp_tries))
    if group is None:
        for _, _, slots in phases:
            for s in slots:
                if isinstance(s, CPTreeSlot):
                    s.calls = s.own_calls
        return [s for _, _, slots in phases for s in slots]
    agreed = torch.tensor([len(slots) for _, _, slots in phases], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=group)
    counts: list[int] = agreed.tolist()
    agreed = torch.zeros(sum(counts), dtype=torch.int64, device=device)
    start = 0
    for (_, _, slots), n in zip(phases, counts):
        agreed[start : start + len(slots)] = torch.tensor([s.own_calls for s in slots], dtype=torch.int64)
        start += n
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=group)
    calls: list[int] = agreed.tolist()
    shaped_phases = [(slots, n) for (_, shaped, slots), n in zip(phases, counts) if shaped]
    shapes = iter(_agreed_shapes(shaped_phases, group))  # type: ignore[arg-type]  # shaped: tries only
    out: list[Slot] = []
    start = 0
    for (d, shaped, slots), n in zip(phases, counts):
        phase_shapes = next(shapes) if shaped else []
        for j in range(n):
            slot = slots[j] if j < len(slots) else DummySlot(d)
            if isinstance(slot, CPTreeSlot):
                slot.calls = calls[start + j]
            elif shaped:
                slot.shape = phase_shapes[j]
            else:  # a dummy CP tree: a one-token prefill, the agreed calls, a backward
                slot.shape = Shape(calls=calls[start + j])
            out.append(slot)
        start += n
    return out


def _cp_trie_slot(root: TrieNode, degree: int, member: int) -> CPTrieSlot:
    """The slot of a trie whose root runs context-parallel over ``degree`` members, on ``member``: its share
    (``cp_trie_schedule``) in the shape every member's fits in."""
    shares = cp_trie_shares(root, degree)
    shape = Shape()
    for share in shares:
        shape = shape.union(Shape(False, len(share.batches), tuple(Shape.of(root.inner[j]) for j in share.inner)))
    return CPTrieSlot(root, degree, shares[member], shape)


def _agreed_shapes(phases: list[tuple[Sequence[TrieSlot | CPTrieSlot], int]], group) -> list[list[Shape]]:
    """Per phase of trie slots (its slots, its agreed count), slot j's shape on every rank of ``group``: the
    union of the ranks' (one ``all_gather_object`` for all phases)."""
    gathered: list[list[list[Shape]] | None] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, [[s.shape for s in slots] for slots, _ in phases], group=group)
    out = []
    for p, (_, count) in enumerate(phases):
        agreed = []
        for j in range(count):
            shape = Shape()
            for ranks in gathered:
                if ranks is not None and j < len(ranks[p]):
                    shape = shape.union(ranks[p][j])
            agreed.append(shape)
        out.append(agreed)
    return out
