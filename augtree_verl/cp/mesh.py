"""The one source of context-parallel group facts (torchtitan ``ParallelDims`` style): ``CPLayout``, the facts,
validated, and ``CPMesh``, a layout with its process groups, built apart from it.

With C = max(cp_degrees), rank r is CP rank ``r % C`` of data-parallel rank ``r // C`` (a CP group is C
consecutive ranks, e.g. one node's GPUs). The engine reports the data-parallel rank and size to verl, so
verl's dispatch hands every rank of a CP group the same samples. Inside a CP group:

- a tree whose plan has degree d > 1 runs context-parallel on one of the C / d subgroups of d
  consecutive ranks;
- every other tree runs on one rank of the group.

Which tree runs on which subgroup is the step plan's choice (``replay.step_plan.assign_subgroups``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from augtree_verl.cp.comm import warm_up


@dataclass(frozen=True)
class CPLayout:
    """Rank ``rank`` of ``world`` ranks in CP groups of the largest of ``degrees`` (the engine's ``cp_degrees``,
    sorted, each dividing the largest); ``ValueError`` naming the value where they do not fit."""

    degrees: tuple[int, ...]
    world: int
    rank: int

    @classmethod
    def of(cls, degrees: Sequence[int], world: int, rank: int) -> CPLayout:
        layout = cls(tuple(sorted(set(degrees))), world, rank)
        if not layout.degrees or layout.degrees[0] < 1:
            raise ValueError(f"cp_degrees {list(degrees)}: every degree must be >= 1")
        size = layout.cp_size
        for d in layout.degrees:
            if size % d:
                raise ValueError(f"cp_degrees {list(layout.degrees)}: degree {d} does not divide the largest, {size}")
        if world % size:
            raise ValueError(
                f"cp_degrees {list(layout.degrees)}: the largest degree {size} must divide the world size {world}"
            )
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside the world of {world} ranks")
        return layout

    @property
    def cp_size(self) -> int:
        """C: the ranks of one CP group."""
        return self.degrees[-1]

    @property
    def dp_size(self) -> int:
        return self.world // self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp_size

    def subgroup_rank(self, degree: int) -> int:
        """This rank's index inside its subgroup of ``degree`` ranks."""
        return self.cp_rank % degree

    def subgroup_index(self, degree: int) -> int:
        """Which of its CP group's subgroups of ``degree`` ranks this rank belongs to."""
        return self.cp_rank // degree


@dataclass
class CPMesh:
    """A ``CPLayout`` and its process groups: ``dp_group`` (the ranks of the same CP rank across data-parallel
    ranks), ``groups[d]`` (this rank's subgroup of d consecutive ranks, for each degree d > 1). ``build`` makes
    them (collective); ``for_planning`` has none (None each: what a step plan reads to plan off a cluster)."""

    layout: CPLayout
    dp_group: object = None
    groups: dict[int, object] = field(default_factory=dict)

    @classmethod
    def build(cls, degrees: Sequence[int]) -> CPMesh:
        """This rank's mesh for ``degrees``, its process groups made. Every rank must call it at the same point
        (``dist.new_subgroups_by_enumeration`` is collective); each new group is warmed up with one all-reduce
        (``cp.comm.warm_up``) before any P2P runs on it."""
        layout = CPLayout.of(degrees, dist.get_world_size(), dist.get_rank())
        size, world = layout.cp_size, layout.world
        dp_group = dist.group.WORLD
        if size > 1:
            dp_group, _ = dist.new_subgroups_by_enumeration(
                [[c + k * size for k in range(layout.dp_size)] for c in range(size)]
            )
            warm_up(dp_group)
        groups = {}
        for d in layout.degrees:
            if d > 1:
                groups[d], _ = dist.new_subgroups_by_enumeration(
                    [[first + j for j in range(d)] for first in range(0, world, d)]
                )
                warm_up(groups[d])
        return cls(layout, dp_group, groups)

    @classmethod
    def whole_world(cls) -> CPMesh:
        """The world as one CP group (no new process group: ``groups[world]`` is the world's group);
        what ``replay`` uses for context-parallel plans when it is given no mesh."""
        world = dist.get_world_size()
        layout = CPLayout.of((1, world), world, dist.get_rank())
        return cls(layout, dist.group.WORLD, {world: dist.group.WORLD} if world > 1 else {})

    @classmethod
    def for_planning(cls, degrees: Sequence[int], cp_rank: int) -> CPMesh:
        """Rank ``cp_rank`` of one CP group (no data parallelism) without process groups: what a step plan
        reads, to plan off a cluster (the cost model, benchmarks, tests)."""
        layout = CPLayout.of(degrees, max(degrees), cp_rank)
        return cls(layout, None, {d: None for d in layout.degrees if d > 1})

    # the layout's facts, read through the mesh
    @property
    def degrees(self) -> tuple[int, ...]:
        return self.layout.degrees

    @property
    def cp_size(self) -> int:
        return self.layout.cp_size

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank

    @property
    def cp_rank(self) -> int:
        return self.layout.cp_rank

    def subgroup_rank(self, degree: int) -> int:
        return self.layout.subgroup_rank(degree)

    def subgroup_index(self, degree: int) -> int:
        return self.layout.subgroup_index(degree)

    def group_of(self, degree: int):
        """This rank's subgroup of ``degree`` ranks (None for degree 1)."""
        return self.groups.get(degree) if degree > 1 else None

    @property
    def cp_group(self):
        """The whole CP group of this rank (None without context parallelism)."""
        return self.groups.get(self.cp_size)
