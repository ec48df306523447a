"""The one source of context-parallel group facts (torchtitan ``ParallelDims`` style).

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

import torch.distributed as dist

from augtree_verl.cp.comm import warm_up


class CPMesh:
    """This rank's place in the (data-parallel x context-parallel) layout; builds the process groups.

    Every rank must construct it at the same point (``dist.new_subgroups_by_enumeration`` is collective);
    each new group is warmed up with one all-reduce (``cp.comm.warm_up``) before any P2P runs on it.
    ``degrees``: the engine's ``cp_degrees``, each dividing the largest (``AugTreeEngineConfig`` checks that).
    ``subgroups[d]``: this rank's subgroup of d consecutive ranks, for each degree d > 1 in ``degrees``.
    """

    def __init__(self, degrees: Sequence[int]):
        self.degrees = tuple(sorted(set(degrees)))
        self.cp_size = size = self.degrees[-1]
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % size:
            raise ValueError(
                f"cp_degrees {list(self.degrees)}: the largest degree {size} must divide the world size {world}"
            )
        self.dp_size, self.dp_rank, self.cp_rank = world // size, rank // size, rank % size
        self.dp_group = dist.group.WORLD
        if size > 1:
            self.dp_group, _ = dist.new_subgroups_by_enumeration(
                [[c + k * size for k in range(self.dp_size)] for c in range(size)]
            )
            warm_up(self.dp_group)
        self.subgroups = {}
        for d in self.degrees:
            if d > 1:
                self.subgroups[d], _ = dist.new_subgroups_by_enumeration(
                    [[first + j for j in range(d)] for first in range(0, world, d)]
                )
                warm_up(self.subgroups[d])

    @classmethod
    def whole_world(cls) -> CPMesh:
        """The world as one CP group (no new process group: ``subgroups[world]`` is the world's group);
        what ``replay`` uses for context-parallel plans when it is given no mesh."""
        world = dist.get_world_size()
        mesh = cls.layout((1, world), dist.get_rank())
        mesh.dp_group = dist.group.WORLD
        mesh.subgroups = {world: dist.group.WORLD} if world > 1 else {}
        return mesh

    @classmethod
    def layout(cls, degrees: Sequence[int], cp_rank: int) -> CPMesh:
        """Rank ``cp_rank`` of one CP group (no data parallelism) without process groups (every
        ``subgroups[d]`` and ``dp_group`` None): what a step plan reads, to plan off a cluster (benchmarks,
        tests)."""
        mesh = cls.__new__(cls)
        mesh.degrees = tuple(sorted(set(degrees)))
        mesh.cp_size, mesh.dp_size, mesh.dp_rank, mesh.cp_rank = mesh.degrees[-1], 1, 0, cp_rank
        mesh.dp_group, mesh.subgroups = None, {d: None for d in mesh.degrees if d > 1}
        return mesh

    def group_of(self, degree: int):
        """This rank's subgroup of ``degree`` ranks (None for degree 1)."""
        return self.subgroups.get(degree) if degree > 1 else None

    def subgroup_rank(self, degree: int) -> int:
        """This rank's index inside its subgroup of ``degree`` ranks."""
        return self.cp_rank % degree

    @property
    def cp_group(self):
        """The whole CP group of this rank (None without context parallelism)."""
        return self.subgroups.get(self.cp_size)

    def subgroup_index(self, degree: int) -> int:
        """Which of its CP group's subgroups of ``degree`` ranks this rank belongs to."""
        return self.cp_rank // degree
