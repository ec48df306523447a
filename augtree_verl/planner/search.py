"""``plan_tree``: choose the context-parallel plan of one replay tree (DESIGN.md section 2).

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

Filters: groups of ranks must not straddle nodes (a group either fits in a node and tiles it, or is a whole
number of nodes), and the per-rank memory estimate must fit ``memory_per_rank_bytes``.

Choice: a plan's cost in rank-seconds is d * T. Let A be the smallest rank-seconds of any plan that fits.
A plan is admissible when its parallel efficiency A / (d * T) is at least ``min_parallel_efficiency``; the
plan returned is the fastest admissible one (ties: fewer ranks). Extra ranks must earn their keep: otherwise
a short group would spread over every rank to save milliseconds. Both minimisations are branch and bound:
candidates are visited by a lower bound on their time (exact for ring and MoveQ, prefill + max(largest
response, mean lane load) for TreeMoveKV before its lanes are assigned) and the visit stops once no
remaining bound can win.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np

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
    bound: float                          # lower bound on est. time (exact for ring and MoveQ)
    parts: tuple[float, float, float] | None = None   # (prefill, replay, comm) once exact

    @property
    def time(self) -> float:
        return sum(self.parts)

    def key(self):
        return (self.time, self.degree, _PRIMITIVE_ORDER[self.primitive], self.lanes)


def plan_tree(prompt_len: int, response_lens, *, degrees, profile: ClusterProfile | None = None,
              force_primitive: str | None = None) -> Plan:
    """The plan for one tree (a prompt of ``prompt_len`` tokens and responses of ``response_lens`` tokens).

    ``degrees``: the CP degrees it may use. ``force_primitive`` restricts the choice to one primitive.
    Raises ``ValueError`` for bad input, or when no plan fits in a rank's memory.
    """
    P, R = _check_tree(prompt_len, response_lens)
    degrees = _check_degrees(degrees)
    if force_primitive is not None and force_primitive not in PRIMITIVES:
        raise ValueError(f"force_primitive must be one of {PRIMITIVES} or None, got {force_primitive!r}")
    if profile is None:
        profile = _default_profile()
    elif not isinstance(profile, ClusterProfile):
        raise ValueError(f"profile must be a ClusterProfile or None, got {type(profile).__name__}")
    search = _Search(cost_model(profile), P, R)
    candidates = search.candidates(degrees, force_primitive)
    if not candidates:
        raise ValueError(f"no candidate plan for degrees {degrees} with ranks_per_node="
                         f"{profile.ranks_per_node}"
                         + (f" and force_primitive={force_primitive!r}" if force_primitive else "")
                         + ": every degree breaks the topology rules")
    budget = profile.memory_per_rank_bytes
    fitting = [c for c in candidates if c.memory <= budget]
    if not fitting:
        smallest = min(candidates, key=lambda c: c.memory)
        raise ValueError(
            f"no plan fits in memory: the smallest plan ({smallest.primitive}, d={smallest.degree}, "
            f"lanes={smallest.lanes}) needs {smallest.memory / 2**30:.2f} GiB per rank but a rank has "
            f"{budget / 2**30:.2f} GiB (ClusterProfile.memory_per_rank_bytes); allow larger degrees")
    best = search.choose(fitting, profile.min_parallel_efficiency)
    return search.to_plan(best)


def _default_profile() -> ClusterProfile:
    global _DEFAULT_PROFILE
    if _DEFAULT_PROFILE is None:
        _DEFAULT_PROFILE = ClusterProfile.default()
    return _DEFAULT_PROFILE


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be a positive int, got {value!r}") from None
    if value < 1:
        raise ValueError(f"{what} must be a positive int, got {value}")
    return value


def _check_tree(prompt_len, response_lens) -> tuple[int, np.ndarray]:
    P = _positive_int(prompt_len, "prompt_len")
    try:
        lens = list(response_lens)
    except TypeError:
        raise ValueError(f"response_lens must be a sequence of positive ints, got {response_lens!r}") from None
    if not lens:
        raise ValueError("response_lens is empty: a tree needs at least one response")
    R = np.array([_positive_int(r, f"response_lens[{i}]") for i, r in enumerate(lens)], dtype=np.float64)
    return P, R


def _check_degrees(degrees) -> tuple[int, ...]:
    try:
        values = list(degrees)
    except TypeError:
        raise ValueError(f"degrees must be a sequence of positive ints, got {degrees!r}") from None
    if not values:
        raise ValueError("degrees is empty: give at least one CP degree")
    return tuple(sorted({_positive_int(d, f"degrees[{i}]") for i, d in enumerate(values)}))


def _node_aligned(ranks: int, ranks_per_node: int) -> bool:
    if ranks <= ranks_per_node:
        return ranks_per_node % ranks == 0
    return ranks % ranks_per_node == 0


class _Search:
    """Candidate enumeration, bounds and exact times for one tree; caches per group size."""

    def __init__(self, cost: CostModel, P: int, R: np.ndarray):
        self.cost, self.P, self.R = cost, P, R
        self.G = R.shape[0]
        self.R_max, self.R_sum = float(R.max()), float(R.sum())
        self.by_length = np.argsort(-R, kind="stable")          # longest first
        self.prefix_sorted = np.concatenate(([0.0], np.cumsum(R[self.by_length])))
        self._prefill: dict[int, tuple[float, float]] = {}
        self._tree: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._labels: dict[tuple[int, int], np.ndarray] = {}

    # ---- cached pieces ---------------------------------------------------------------------------
    def prefill(self, ranks: int) -> tuple[float, float]:
        if ranks not in self._prefill:
            self._prefill[ranks] = self.cost.prefill(self.P, ranks)
        return self._prefill[ranks]

    def tree_loads(self, m: int):
        """(compute [G], comm [G], load = compute + comm [G]) of each response in a lane of m ranks."""
        if m not in self._tree:
            compute, comm = self.cost.tree_responses(self.P, self.R, m)
            self._tree[m] = (compute, comm, compute + comm)
        return self._tree[m]

    def lanes_of(self, lanes: int, m: int) -> np.ndarray:
        if (lanes, m) not in self._labels:
            self._labels[(lanes, m)] = balanced_lanes(self.tree_loads(m)[2], lanes)
        return self._labels[(lanes, m)]

    # ---- enumeration -----------------------------------------------------------------------------
    def candidates(self, degrees, force_primitive) -> list[_Candidate]:
        rpn = self.cost.profile.ranks_per_node
        allowed = PRIMITIVES if force_primitive is None else (force_primitive,)
        out = []
        for d in degrees:
            if not _node_aligned(d, rpn):
                continue
            if "ring" in allowed:
                out.append(self._ring(d))
            for s in range(1, min(d, self.G) + 1):
                if d % s or not _node_aligned(d // s, rpn):
                    continue
                if "tree_move_kv" in allowed:
                    out.append(self._tree_move_kv(d, s))
                if "move_q" in allowed:
                    out.append(self._move_q(d, s))
        return out

    def _ring(self, d: int) -> _Candidate:
        compute, comm = self.cost.ring_sequences(self.P, self.R, d)
        parts = (0.0, float(compute.sum()), float(comm.sum()))
        memory = self.cost.ring_memory(self.P, self.R_max, self.R_sum, d)
        return _Candidate(d, "ring", 1, memory, sum(parts), parts)

    def _tree_move_kv(self, d: int, s: int) -> _Candidate:
        m = d // s
        pre_compute, pre_comm = self.prefill(m)
        load = self.tree_loads(m)[2]
        bound = pre_compute + pre_comm + max(float(load.max()), float(load.sum()) / s)
        memory = self.cost.tree_memory(self.P, self.R_max, self.R_sum, m)
        cand = _Candidate(d, "tree_move_kv", s, memory, bound)
        if s in (1, self.G):                   # one lane holds all, or one response per lane: no search
            self.exact(cand)
        return cand

    def _move_q(self, d: int, s: int) -> _Candidate:
        m = d // s
        pre_compute, pre_comm = self.prefill(d)
        # Round r holds the r-th block of s responses in length order; its slowest lane is its first.
        firsts = self.R[self.by_length[::s]]
        lane_compute, lane_comm = self.cost.moveq_lane(firsts, m)
        round_queries = np.diff(self.prefix_sorted[::s] if self.G % s == 0 else
                                np.append(self.prefix_sorted[::s], self.prefix_sorted[-1]))
        shared_compute, shared_comm = self.cost.moveq_round_shared(self.P, round_queries, d)
        parts = (pre_compute, float(lane_compute.sum() + shared_compute.sum()),
                 pre_comm + float(lane_comm.sum() + shared_comm.sum()))
        memory = self.cost.moveq_memory(self.P, self.R_max, self.R_sum, float(round_queries[0]), d, m)
        return _Candidate(d, "move_q", s, memory, sum(parts), parts)

    # ---- exact time and choice -------------------------------------------------------------------
    def exact(self, cand: _Candidate) -> None:
        """Fill ``parts`` of a TreeMoveKV candidate from its lane assignment (critical lane's parts)."""
        m = cand.degree // cand.lanes
        pre_compute, pre_comm = self.prefill(m)
        compute, comm, load = self.tree_loads(m)
        labels = self.lanes_of(cand.lanes, m)
        critical = labels == int(np.argmax(np.bincount(labels, weights=load, minlength=cand.lanes)))
        cand.parts = (pre_compute, float(compute[critical].sum()), pre_comm + float(comm[critical].sum()))

    def choose(self, fitting: list[_Candidate], min_efficiency: float) -> _Candidate:
        most_efficient = None                          # smallest rank-seconds d * T
        for c in sorted(fitting, key=lambda c: c.degree * c.bound):
            if most_efficient is not None and c.degree * c.bound >= most_efficient.degree * most_efficient.time:
                break
            if c.parts is None:
                self.exact(c)
            if most_efficient is None or (c.degree * c.time, c.key()) < (
                    most_efficient.degree * most_efficient.time, most_efficient.key()):
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
            return Plan(degree=c.degree, primitive="ring", rounds=0, lanes=1, placement=(),
                        est_time_s=c.time, est_parts=parts)
        placement = [None] * self.G
        if c.primitive == "move_q":
            for position, i in enumerate(self.by_length.tolist()):
                placement[i] = (position // c.lanes, position % c.lanes)
            rounds = -(-self.G // c.lanes)
        else:
            m = c.degree // c.lanes
            labels = self.lanes_of(c.lanes, m)
            load = self.tree_loads(m)[2]
            rounds = 0
            for lane in range(c.lanes):
                members = np.flatnonzero(labels == lane)
                members = members[np.argsort(-load[members], kind="stable")]   # largest first
                for r, i in enumerate(members.tolist()):
                    placement[i] = (r, lane)
                rounds = max(rounds, len(members))
        return Plan(degree=c.degree, primitive=c.primitive, rounds=rounds, lanes=c.lanes,
                    placement=tuple(placement), est_time_s=c.time, est_parts=parts)
