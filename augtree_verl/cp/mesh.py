"""The one source of context-parallel group facts (torchtitan ``ParallelDims`` style), and which ranks
replay which tree.

With C = max(cp_degrees), rank r is CP rank ``r % C`` of data-parallel rank ``r // C`` (a CP group is C
consecutive ranks, e.g. one node's GPUs). The engine reports the data-parallel rank and size to verl, so
verl's dispatch hands every rank of a CP group the same samples. Inside a CP group:

- a tree whose plan has degree d > 1 runs context-parallel on one of the C / d subgroups of d
  consecutive ranks;
- every other tree runs on one rank of the group.

``schedule_trees`` chooses each tree's degree (the plan's, or 1 where that finishes the group's trees
sooner) and its subgroup (or rank), heaviest tree first onto the least loaded choice, identically on every
rank (it only reads the trees and plans, which every rank of the group shares).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from augtree_verl.cp.comm import warm_up
from augtree_verl.plan import Plan


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
            raise ValueError(f"cp_degrees {list(self.degrees)}: the largest degree {size} must divide the "
                             f"world size {world}")
        self.dp_size, self.dp_rank, self.cp_rank = world // size, rank // size, rank % size
        self.dp_group = dist.group.WORLD
        if size > 1:
            self.dp_group, _ = dist.new_subgroups_by_enumeration(
                [[c + k * size for k in range(self.dp_size)] for c in range(size)])
            warm_up(self.dp_group)
        self.subgroups = {}
        for d in self.degrees:
            if d > 1:
                self.subgroups[d], _ = dist.new_subgroups_by_enumeration(
                    [[first + j for j in range(d)] for first in range(0, world, d)])
                warm_up(self.subgroups[d])

    @classmethod
    def whole_world(cls) -> CPMesh:
        """The world as one CP group (no new process group: ``subgroups[world]`` is the world's group);
        what ``replay`` uses for context-parallel plans when it is given no mesh."""
        mesh = cls.__new__(cls)
        world, rank = dist.get_world_size(), dist.get_rank()
        mesh.degrees, mesh.cp_size = (1, world) if world > 1 else (1,), world
        mesh.dp_size, mesh.dp_rank, mesh.cp_rank = 1, 0, rank
        mesh.dp_group = dist.group.WORLD
        mesh.subgroups = {world: dist.group.WORLD} if world > 1 else {}
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


def schedule_trees(trees: Sequence, plans: Sequence[Plan | None], cp_size: int) -> tuple[list[int], list[int]]:
    """(degree, subgroup index) per tree, for one CP group of ``cp_size`` ranks that replays ``trees``
    (anything with ``prompt_len`` and ``response_lens``, e.g. ``replay.ReplayTree``).

    The planner plans each tree alone; a CP group holding several trees may finish sooner running some of
    them on one rank each, side by side. When every plan carries the planner's estimates (``est_time_s``,
    and ``est_single_s`` for a plan of degree d > 1), trees are demoted to degree 1 in order of their
    parallel efficiency T_1 / (d T_d), least efficient first, and the number of demotions with the
    smallest estimated makespan (``place_trees``) wins (none, on a tie). Otherwise (no planner estimates),
    the planned degrees stand and trees are placed by ``tree_workload``.
    """
    degrees = [plan.degree if plan is not None else 1 for plan in plans]
    if not all(plan is not None and plan.est_time_s is not None for plan in plans):
        return degrees, place_by_workload(trees, degrees, cp_size)
    multi = [plan.est_time_s for plan in plans]
    single = [plan.est_time_s if plan.degree == 1 else plan.est_single_s for plan in plans]
    demotable = sorted((t for t in range(len(plans)) if degrees[t] > 1 and single[t] is not None),
                       key=lambda t: (single[t] / (degrees[t] * multi[t]), t))
    best = None
    for k in range(len(demotable) + 1):
        if k:
            degrees[demotable[k - 1]] = 1
        works = [single[t] if degrees[t] == 1 else multi[t] * degrees[t] for t in range(len(plans))]
        placement, makespan = place_trees(works, degrees, cp_size)
        if best is None or makespan < best[0]:
            best = (makespan, list(degrees), placement)
    return best[1], best[2]


def place_by_workload(trees: Sequence, degrees: Sequence[int], cp_size: int) -> list[int]:
    """``place_trees`` with each tree's work estimated by ``groups.tree_workload``."""
    from augtree_verl.groups import tree_workload  # lazy: groups needs verl, the replay engine does not

    works = [float(tree_workload(tree.prompt_len, tree.response_lens)) for tree in trees]
    return place_trees(works, degrees, cp_size)[0]


def place_trees(works: Sequence[float], degrees: Sequence[int], cp_size: int) -> tuple[list[int], float]:
    """(subgroup per tree, makespan): the subgroup (of ``degrees[t]`` consecutive CP ranks; index 0 ..
    cp_size / d - 1) each tree runs on, and the most work any rank gets.

    Longest-processing-time first: each tree, heaviest first, goes to the subgroup whose busiest member
    has the least work so far, and adds ``works[t] / d`` to every member. Ties go to the lowest index.
    """
    for t, d in enumerate(degrees):
        if d < 1 or cp_size % d:
            raise ValueError(f"tree {t}: degree {d} does not divide the CP group size {cp_size}")
    load = [0.0] * cp_size
    placement = [0] * len(works)
    for t in sorted(range(len(works)), key=lambda t: (-works[t], t)):
        d = degrees[t]
        best = min(range(cp_size // d), key=lambda s: (max(load[s * d: (s + 1) * d]), s))
        placement[t] = best
        for r in range(best * d, (best + 1) * d):
            load[r] += works[t] / d
    return placement, max(load, default=0.0)
