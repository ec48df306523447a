"""``plan_tree``: choose the context-parallel plan of one replay tree (docs/design.md §6).

Candidates: for each degree d, the ring fallback (b = 0) and, for each lane count s (s divides d, s <= G),
TreeMoveKV and MoveQ. Lane semantics (what the CP primitives execute):
- TreeMoveKV: s independent lanes of m = d/s ranks; a lane prefills the prompt over its m ranks, then replays
  its responses one per round (largest first). Responses go to lanes by balanced makespan; the tree's time is
  prefill + the slowest lane. Rounds b = the most responses any lane holds.
- MoveQ: the prompt lives on all d ranks; each round, the s lanes replay one response each and every owner
  scores all of the round's queries. Rounds are lock-step, so the tree's time is prefill + sum over rounds of
  (slowest lane + shared owner work); sorting responses by length and filling rounds in that order minimises
  the sum of round maxima (exchange argument), so no search is needed. b = ceil(G / s).
- Ring: each [prompt || response] in turn over all d ranks.
- d = 1 (any primitive): the single-device engine, which prefills once and packs the responses into padded
  micro-batches of up to ``DEFAULT_MICRO_BATCH_TOKENS`` (``CostModel.one_device``): one call per micro-batch.

Filters: groups of ranks must not straddle nodes (a group either fits in a node and tiles it, or is a whole
number of nodes), and the per-rank memory estimate must fit ``memory_per_rank_bytes``.

Choice: a plan's cost in rank-seconds is d * T. Let A be the smallest rank-seconds of any plan that fits.
A plan is admissible when its parallel efficiency A / (d * T) is at least ``min_parallel_efficiency``; the
plan returned is the fastest admissible one (ties: fewer ranks). Extra ranks must earn their keep: otherwise
a short group would spread over every rank to save milliseconds. Both minimisations are branch and bound:
candidates are visited by a lower bound on their time (exact for ring, MoveQ and TreeMoveKV with one lane or
one response per lane; otherwise prefill + max(largest load, mean lane load, sum of the s-th and (s+1)-th
largest loads), valid before the lanes are assigned) and the visit stops once no remaining bound can win.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from augtree_verl.groups import GroupLengths, positive_int
from augtree_verl.plan import PRIMITIVES, Plan
from augtree_verl.planner.cost import CostModel, cost_model
from augtree_verl.planner.partition import balanced_lanes
from augtree_verl.planner.profile import ClusterProfile

_PRIMITIVE_ORDER = {name: i for i, name in enumerate(PRIMITIVES)}
_DEFAULT_PROFILE: ClusterProfile | None = None


@dataclass
class _Candidate:
    degree: int
    primitive: str
    lanes: int
    memory: float
    bound: float  # lower bound on est. time (exact for ring and MoveQ)
    parts: tuple[float, float, float] | None = None  # (prefill, replay, comm) once exact

    @property
    def time(self) -> float:
        return sum(self.parts)

    def key(self):
        return (self.time, self.degree, _PRIMITIVE_ORDER[self.primitive], self.lanes)


def plan_tree(
    prompt_len: int,
    response_lens,
    *,
    degrees,
    profile: ClusterProfile | None = None,
    force_primitive: str | None = None,
) -> Plan:
    """The plan for one tree (a prompt of ``prompt_len`` tokens and responses of ``response_lens`` tokens).

    ``degrees``: the CP degrees it may use. ``force_primitive`` restricts the choice to one primitive.
    Raises ``ValueError`` for bad input (lengths: ``GroupLengths``), or when no plan fits in a rank's memory.
    """
    lengths = GroupLengths(prompt_len, response_lens)
    degrees = _check_degrees(degrees)
    if force_primitive is not None and force_primitive not in PRIMITIVES:
        raise ValueError(f"force_primitive must be one of {PRIMITIVES} or None, got {force_primitive!r}")
    if profile is None:
        profile = _default_profile()
    elif not isinstance(profile, ClusterProfile):
        raise ValueError(f"profile must be a ClusterProfile or None, got {type(profile).__name__}")
    search = _Search(cost_model(profile), lengths)
    candidates = search.candidates(degrees, force_primitive)
    if not candidates:
        raise ValueError(
            f"no candidate plan for degrees {degrees} with ranks_per_node="
            f"{profile.ranks_per_node}"
            + (f" and force_primitive={force_primitive!r}" if force_primitive else "")
            + ": every degree breaks the topology rules"
        )
    budget = profile.memory_per_rank_bytes
    fitting = [c for c in candidates if c.memory <= budget]
    if not fitting:
        smallest = min(candidates, key=lambda c: c.memory)
        raise ValueError(
            f"no plan fits in memory: the smallest plan ({smallest.primitive}, d={smallest.degree}, "
            f"lanes={smallest.lanes}) needs {smallest.memory / 2**30:.2f} GiB per rank but a rank has "
            f"{budget / 2**30:.2f} GiB (ClusterProfile.memory_per_rank_bytes); allow larger degrees"
        )
    best = search.choose(fitting, profile.min_parallel_efficiency)
    single = [c for c in fitting if c.degree == 1]
    for c in single:
        if c.parts is None:
            search.exact(c)
    return replace(search.to_plan(best), est_single_s=min((c.time for c in single), default=None))


def estimate(
    prompt_len: int, response_lens, *, degree: int, primitive: str, lanes: int, profile: ClusterProfile
) -> Plan:
    """The plan of one candidate (``degree`` ranks, ``primitive``, ``lanes``; any memory) with its estimate,
    whether or not the planner would choose it; ``ValueError`` when no such candidate exists."""
    search = _Search(cost_model(profile), GroupLengths(prompt_len, response_lens))
    found = [c for c in search.candidates((degree,), primitive) if c.lanes == lanes]
    if not found:
        raise ValueError(
            f"no candidate {primitive}(d={degree}, lanes={lanes}) for {search.G} responses with "
            f"ranks_per_node={profile.ranks_per_node}"
        )
    if found[0].parts is None:
        search.exact(found[0])
    return search.to_plan(found[0])


def _default_profile() -> ClusterProfile:
    global _DEFAULT_PROFILE
    if _DEFAULT_PROFILE is None:
        _DEFAULT_PROFILE = ClusterProfile.default()
    return _DEFAULT_PROFILE


def _check_degrees(degrees) -> tuple[int, ...]:
    try:
        values = list(degrees)
    except TypeError:
        raise ValueError(f"degrees must be a sequence of positive ints, got {degrees!r}") from None
    if not values:
        raise ValueError("degrees is empty: give at least one CP degree")
    return tuple(sorted({positive_int(d, f"degrees[{i}]") for i, d in enumerate(values)}))


def _node_aligned(ranks: int, ranks_per_node: int) -> bool:
    if ranks <= ranks_per_node:
        return ranks_per_node % ranks == 0
    return ranks % ranks_per_node == 0


class _Search:
    """Candidate enumeration, bounds and exact times for one tree.

    Per-response costs are computed once for every group size k the candidates need, as [K, G] arrays
    (K sizes x G responses); a candidate then costs a few scalar operations.
    """

    def __init__(self, cost: CostModel, lengths: GroupLengths):
        P, R = lengths.prompt_len, np.array(lengths.response_lens, dtype=np.float64)  # R: float64 [G]
        self.cost, self.P, self.R = cost, P, R
        self.G = R.shape[0]
        self.R_max, self.R_sum = float(R.max()), float(R.sum())
        self.by_length = np.argsort(-R, kind="stable")  # longest first
        self.one_device_s = cost.one_device(P, R)  # any plan of degree 1 runs this
        self.one_device_memory = cost.one_device_memory(P, R)
        self._labels: dict[tuple[int, int], np.ndarray] = {}

    # ---- enumeration -----------------------------------------------------------------------------
    def candidates(self, degrees, force_primitive) -> list[_Candidate]:
        rpn = self.cost.profile.ranks_per_node
        allowed = PRIMITIVES if force_primitive is None else (force_primitive,)
        grid = []  # (d, [s...]) that obey topology
        for d in degrees:
            if _node_aligned(d, rpn):
                grid.append((d, [s for s in range(1, min(d, self.G) + 1) if d % s == 0 and _node_aligned(d // s, rpn)]))
        if not grid:
            return []
        self._tabulate(sorted({d for d, _ in grid} | {d // s for d, lanes in grid for s in lanes}), grid, allowed)
        out = []
        for d, lanes in grid:
            if "ring" in allowed:
                out.append(self._ring(d))
            for s in lanes:
                if "tree_move_kv" in allowed:
                    out.append(self._tree_move_kv(d, s))
                if "move_q" in allowed:
                    out.append(self._move_q(d, s))
        return out

    def _tabulate(self, sizes: list[int], grid, allowed) -> None:
        """Per group size k: prefill, ring, TreeMoveKV and MoveQ-lane costs of every response."""
        cost, P, R = self.cost, self.P, self.R
        self.row = {k: i for i, k in enumerate(sizes)}
        k = np.array(sizes, dtype=np.float64)
        pre_compute, pre_comm = cost.prefill(P, k)
        self.pre = list(zip(pre_compute.tolist(), pre_comm.tolist()))
        k = k[:, None]
        if "ring" in allowed:
            compute, comm = cost.ring_sequences(P, R, k)
            self.ring = list(zip(compute.sum(1).tolist(), comm.sum(1).tolist()))
        if "tree_move_kv" in allowed:
            self.tree_compute, self.tree_comm = cost.tree_responses(P, R, k)
            self.tree_load = self.tree_compute + self.tree_comm
            desc = -np.sort(-self.tree_load, axis=1)
            self.tree_desc = desc.tolist()  # loads, largest first, per size
            self.tree_sum = desc.sum(1).tolist()
            heaviest = self.tree_load.argmax(1)[:, None]
            self.tree_one_lane = list(zip(self.tree_compute.sum(1).tolist(), self.tree_comm.sum(1).tolist()))
            self.tree_heaviest = list(
                zip(
                    np.take_along_axis(self.tree_compute, heaviest, 1)[:, 0].tolist(),
                    np.take_along_axis(self.tree_comm, heaviest, 1)[:, 0].tolist(),
                )
            )
        if "move_q" in allowed:
            compute, comm = cost.moveq_lane(R[self.by_length], k)
            lane_counts = {s for _, lanes in grid for s in lanes}
            # Per lane count s and size m: the rounds' slowest lanes (every s-th response by length).
            self.moveq_rounds = {
                s: list(zip(compute[:, ::s].sum(1).tolist(), comm[:, ::s].sum(1).tolist())) for s in lane_counts
            }

    def _one_device_parts(self) -> tuple[float, float, float]:
        pre_compute, pre_comm = self.pre[self.row[1]]
        return pre_compute, self.one_device_s, pre_comm

    def _ring(self, d: int) -> _Candidate:
        compute, comm = self.ring[self.row[d]]
        # no shared prefill: the slot's dummy one costs its fixed part
        parts = self._one_device_parts() if d == 1 else (self.cost.profile.slot_overhead_s, compute, comm)
        memory = self.one_device_memory if d == 1 else self.cost.ring_memory(self.P, self.R_max, self.R_sum, d)
        return _Candidate(d, "ring", 1, memory, sum(parts), parts)

    def _tree_move_kv(self, d: int, s: int) -> _Candidate:
        m = d // s
        row = self.row[m]
        desc = self.tree_desc[row]
        # Some lane holds the largest response; if G > s some lane holds two of the s+1 largest.
        lane_bound = max(desc[0], self.tree_sum[row] / s, desc[s - 1] + desc[s] if self.G > s else 0.0)
        bound = sum(self.pre[row]) + lane_bound + self._lane_share(s)
        memory = self.one_device_memory if d == 1 else self.cost.tree_memory(self.P, self.R_max, self.R_sum, m)
        cand = _Candidate(d, "tree_move_kv", s, memory, bound)
        if d == 1:
            cand.parts = self._one_device_parts()
            cand.bound = sum(cand.parts)
        elif s in (1, self.G):  # one lane holds all, or one response per lane: no search
            compute, comm = self.tree_one_lane[row] if s == 1 else self.tree_heaviest[row]
            pre_compute, pre_comm = self.pre[row]
            cand.parts = (pre_compute, compute, pre_comm + comm + self._lane_share(s))
            cand.bound = sum(cand.parts)
        return cand

    def _move_q(self, d: int, s: int) -> _Candidate:
        m = d // s
        row = self.row[m]
        rounds = -(-self.G // s)
        # Round r holds the r-th block of s responses in length order; its slowest lane is its first.
        lane_compute, lane_comm = self.moveq_rounds[s][row]
        owner_compute, owner_comm = self.cost.moveq_owners(self.P, self.R_sum, rounds, d)
        pre_compute, pre_comm = self.pre[self.row[d]]
        parts = (
            self._one_device_parts()
            if d == 1
            else (pre_compute, lane_compute + owner_compute, pre_comm + lane_comm + owner_comm)
        )
        round_max_queries = float(self.R[self.by_length[:s]].sum())
        memory = (
            self.one_device_memory
            if d == 1
            else self.cost.moveq_memory(self.P, self.R_max, self.R_sum, round_max_queries, d, m)
        )
        return _Candidate(d, "move_q", s, memory, sum(parts), parts)

    # ---- exact time and choice -------------------------------------------------------------------
    def lanes_of(self, lanes: int, m: int) -> np.ndarray:
        if (lanes, m) not in self._labels:
            self._labels[(lanes, m)] = balanced_lanes(self.tree_load[self.row[m]], lanes)
        return self._labels[(lanes, m)]

    def exact(self, cand: _Candidate) -> None:
        """Fill ``parts`` of a TreeMoveKV candidate from its lane assignment (critical lane's parts)."""
        m = cand.degree // cand.lanes
        row = self.row[m]
        labels = self.lanes_of(cand.lanes, m)
        # Lanes run in lock-step: a lane with fewer responses than the most pads with dummy calls.
        calls = np.bincount(labels, minlength=cand.lanes)
        padding = (calls.max() - calls) * self.cost.profile.call_overhead_s
        lane = int(np.argmax(np.bincount(labels, weights=self.tree_load[row], minlength=cand.lanes) + padding))
        critical = labels == lane
        pre_compute, pre_comm = self.pre[row]
        cand.parts = (
            pre_compute,
            float(self.tree_compute[row][critical].sum() + padding[lane]),
            pre_comm + float(self.tree_comm[row][critical].sum()) + self._lane_share(cand.lanes),
        )

    def _lane_share(self, lanes: int) -> float:
        """TreeMoveKV's one exchange of the lanes' scores over the subgroup (none with one lane)."""
        return self.cost.profile.launch_latency_s if lanes > 1 else 0.0

    def choose(self, fitting: list[_Candidate], min_efficiency: float) -> _Candidate:
        most_efficient = None  # smallest rank-seconds d * T
        for c in sorted(fitting, key=lambda c: c.degree * c.bound):
            if most_efficient is not None and c.degree * c.bound > most_efficient.degree * most_efficient.time:
                break
            if c.parts is None:
                self.exact(c)
            if most_efficient is None or (c.degree * c.time, c.key()) < (
                most_efficient.degree * most_efficient.time,
                most_efficient.key(),
            ):
                most_efficient = c
        if min_efficiency == 0:
            limit = math.inf
        else:
            limit = most_efficient.degree * most_efficient.time / min_efficiency
        best = most_efficient
        for c in sorted(fitting, key=lambda c: c.bound):
            if c.bound > best.time:
                break
            if c.degree * c.bound > limit:
                continue
            if c.parts is None:
                self.exact(c)
            if c.degree * c.time <= limit and c.key() < best.key():
                best = c
        return best

    def to_plan(self, c: _Candidate) -> Plan:
        parts = {"prefill": c.parts[0], "replay": c.parts[1], "comm": c.parts[2]}
        if c.primitive == "ring":
            return Plan(
                degree=c.degree, primitive="ring", rounds=0, lanes=1, placement=(), est_time_s=c.time, est_parts=parts
            )
        placement: list[tuple[int, int] | None] = [None] * self.G
        if c.primitive == "move_q":
            for position, i in enumerate(self.by_length.tolist()):
                placement[i] = (position // c.lanes, position % c.lanes)
            rounds = -(-self.G // c.lanes)
        else:
            m = c.degree // c.lanes
            labels = self.lanes_of(c.lanes, m)
            load = self.tree_load[self.row[m]]
            rounds = 0
            for lane in range(c.lanes):
                members = np.flatnonzero(labels == lane)
                members = members[np.argsort(-load[members], kind="stable")]  # largest first
                for r, i in enumerate(members.tolist()):
                    placement[i] = (r, lane)
                rounds = max(rounds, len(members))
        return Plan(
            degree=c.degree,
            primitive=c.primitive,
            rounds=rounds,
            lanes=c.lanes,
            placement=tuple(placement),
            est_time_s=c.time,
            est_parts=parts,
        )
