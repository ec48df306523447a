"""The analytic count of what each CP primitive must move: bytes one rank sends for one replay tree.

Composed from the per-layer formulas stated next to each primitive (``ring.ring_bytes``, also TreeMoveKV's
lane ring, and ``move_q.move_q_bytes``) over the steps of ``schedule.cp_tree_schedule``
(exactly the steps the CP tree run executes), times the number of layers; forward and backward ("bwd" is 0
for a forward-only replay). Used by the tests (measured == analytic) and by ``benchmarks/cp_comm.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from augtree_verl.cp.comm import Ring
from augtree_verl.cp.move_q import MoveQSpec, move_q_bytes
from augtree_verl.cp.ring import RingSpec, ring_bytes
from augtree_verl.cp.schedule import cp_tree_schedule
from augtree_verl.model_shape import ModelShape
from augtree_verl.plan import Plan


@dataclass(frozen=True)
class AttentionShape:
    """Per layer: ``heads`` query heads of width ``head_dim`` (D_k, also the keys'), ``kv_heads`` key/value heads,
    values of width ``value_dim`` (D_v: ``value_head_dim``, or D_k where that is None)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    element_size: int  # bytes of a q/K/V element (4 for float32, 2 for bf16)
    lse_element_size: int = 4

    value_head_dim: int | None = None  # D_v where it differs from the query/key width (multi-head latent attention)

    @staticmethod
    def of(config, element_size: int) -> AttentionShape:
        shape = ModelShape.of(config)
        return AttentionShape(
            shape.num_layers,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            element_size,
            value_head_dim=shape.value_head_dim,
        )

    @property
    def value_dim(self) -> int:
        """D_v: ``value_head_dim``, else the query/key width."""
        return self.value_head_dim or self.head_dim


def analytic_bytes(
    plan: Plan, prompt_len: int, response_lens: list[int], rank: int, shape: AttentionShape, train: bool = True
) -> dict[str, int]:
    """Bytes subgroup rank ``rank`` sends for one tree: the per-primitive formulas summed over the steps of
    ``schedule.cp_tree_schedule`` (the prefill ring, then each step's ring or MoveQ exchange)."""
    schedule, total = cp_tree_schedule(plan, prompt_len, response_lens, rank), {"fwd": 0, "bwd": 0}
    kv = (shape.kv_heads, shape.head_dim, shape.value_dim, shape.element_size)

    def add(per_layer: dict[str, int]) -> None:
        total["fwd"] += shape.layers * per_layer["fwd"]
        total["bwd"] += shape.layers * per_layer["bwd"] if train else 0

    def ring(members, layout, prefix=None) -> RingSpec:
        return RingSpec(Ring(None, members, members.index(rank)), layout, prefix, 1.0)

    if schedule.prefill is not None:
        add(ring_bytes(ring(schedule.prefill.members, schedule.prefill.layout), *kv))
    for step in schedule.steps:
        if step.layout is None:  # nothing fed by my ring: a local dummy call
            continue
        if step.kind == "move_q":
            spec = MoveQSpec(
                None, rank, schedule.prefill.layout, step.query_counts, ring(step.members, step.layout), 1.0
            )
            add(move_q_bytes(spec, shape.heads, *kv[:3], shape.element_size, shape.lse_element_size))
        else:
            add(ring_bytes(ring(step.members, step.layout, step.prefix), *kv))
    return total
