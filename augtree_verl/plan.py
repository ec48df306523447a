"""The per-tree context-parallel plan, shared by the planner and the CP primitives.

A plan c = (d, pi, (b, s), X) says how one replay tree (one prompt, G responses) runs over d ranks:
- ``degree`` d: the CP degree (ranks of the CP group that work on this tree).
- ``primitive`` pi: "ring" (no split: ordinary ring CP over each [prompt || response], the fallback),
  "tree_move_kv" (s lanes of d/s ranks, each with its own K/V ring over prompt + its responses) or
  "move_q" (prompt K/V stays on its owners, response queries travel to them).
- ``rounds`` b and ``lanes`` s: split plans run the responses in b sequential rounds of s lanes.
- ``placement`` X: for each response i, the (round, lane) cell it runs in. Empty for "ring".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

PRIMITIVES = ("ring", "tree_move_kv", "move_q")


@dataclass(frozen=True)
class Plan:
    degree: int = 1
    primitive: str = "ring"
    rounds: int = 0
    lanes: int = 1
    placement: tuple[tuple[int, int], ...] = ()
    # Filled by the planner: the estimated step time and its parts (prefill, replay, comm), seconds, and the
    # estimated time of the tree's best plan on one rank (None if none fits), for trading CP against running
    # several trees side by side (``replay.step_plan.assign_subgroups``).
    est_time_s: float | None = None
    est_parts: dict[str, float] = field(default_factory=dict, compare=False)
    est_single_s: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "placement", tuple(tuple(cell) for cell in self.placement))
        if not isinstance(self.degree, int) or self.degree < 1:
            raise ValueError(f"Plan.degree must be a positive int, got {self.degree!r}")
        if self.primitive not in PRIMITIVES:
            raise ValueError(f"Plan.primitive must be one of {PRIMITIVES}, got {self.primitive!r}")
        if self.primitive == "ring":
            if self.rounds != 0:
                raise ValueError(f"Plan.rounds must be 0 for the ring primitive, got {self.rounds}")
            if self.lanes != 1:
                raise ValueError(f"Plan.lanes must be 1 for the ring primitive, got {self.lanes}")
            if self.placement:
                raise ValueError("Plan.placement must be empty for the ring primitive (nothing is split)")
            return
        if self.rounds < 1:
            raise ValueError(f"Plan.rounds must be >= 1 for {self.primitive}, got {self.rounds}")
        if not 1 <= self.lanes <= self.degree:
            raise ValueError(f"Plan.lanes must be in [1, degree={self.degree}], got {self.lanes}")
        if self.primitive == "tree_move_kv" and self.degree % self.lanes:
            raise ValueError(f"Plan.lanes={self.lanes} must divide Plan.degree={self.degree} for tree_move_kv")
        for i, (r, s) in enumerate(self.placement):
            if not (0 <= r < self.rounds and 0 <= s < self.lanes):
                raise ValueError(f"Plan.placement[{i}]=({r}, {s}) is outside the {self.rounds}x{self.lanes} grid")
        used_rounds = {r for r, _ in self.placement}
        used_lanes = {s for _, s in self.placement}
        if used_rounds != set(range(self.rounds)):
            raise ValueError(f"Plan.placement leaves rounds {sorted(set(range(self.rounds)) - used_rounds)} empty")
        if used_lanes != set(range(self.lanes)):
            raise ValueError(f"Plan.placement leaves lanes {sorted(set(range(self.lanes)) - used_lanes)} empty")

    def check_responses(self, num_responses: int, tree: int | str | None = None) -> None:
        """Raise ``ValueError`` unless a split plan places each of ``num_responses`` responses once."""
        if self.primitive != "ring" and len(self.placement) != num_responses:
            where = f" for tree {tree}" if tree is not None else ""
            raise ValueError(
                f"Plan.placement{where} has {len(self.placement)} cells but the tree has "
                f"{num_responses} responses; every response must be placed exactly once"
            )

    def to_dict(self) -> dict:
        """The plain-dict form, for the batch's plan field (``plan_field`` holds the one encode and decode of
        plans: verl's non-tensor batch carries plain data). Ray carries ``Plan`` objects as they are."""
        return {
            "degree": self.degree,
            "primitive": self.primitive,
            "rounds": self.rounds,
            "lanes": self.lanes,
            "placement": [list(c) for c in self.placement],
            "est_time_s": self.est_time_s,
            "est_parts": dict(self.est_parts),
            "est_single_s": self.est_single_s,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Plan:
        return cls(
            degree=d["degree"],
            primitive=d["primitive"],
            rounds=d["rounds"],
            lanes=d["lanes"],
            placement=tuple(tuple(c) for c in d.get("placement", ())),
            est_time_s=d.get("est_time_s"),
            est_parts=dict(d.get("est_parts") or {}),
            est_single_s=d.get("est_single_s"),
        )
