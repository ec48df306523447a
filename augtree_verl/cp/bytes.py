"""The analytic count of what each CP primitive must move: bytes one rank sends for one replay tree.

Composed from the per-layer formulas stated next to each primitive (``ring.ring_bytes``, also TreeMoveKV's
lane ring, and ``move_q.move_q_bytes``) over the steps of ``schedule.cp_tree_schedule``
(exactly the steps the CP tree run executes), times the number of attention layers, plus, for a hybrid, the
state scan's (``state_scan.scan_bytes``) over each sharded sequence (the prefill's, each step's over its ring)
times the number of linear-attention layers; forward and backward ("bwd" is 0 for a forward-only replay).
Used by the tests (measured == analytic) and by ``benchmarks/cp_comm.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from augtree_verl.cp.comm import Ring
from augtree_verl.cp.move_q import MoveQSpec, move_q_bytes
from augtree_verl.cp.ring import RingSpec, ring_bytes
from augtree_verl.cp.schedule import cp_tree_schedule
from augtree_verl.cp.state_scan import LinearShape, scan_bytes
from augtree_verl.model_shape import ModelShape
from augtree_verl.plan import Plan


@dataclass(frozen=True)
class AttentionShape:
    """Per attention layer (``layers`` of them): ``heads`` query heads of width ``head_dim`` (D_k, also the keys'),
    ``kv_heads`` key/value heads, values of width ``value_dim`` (D_v: ``value_head_dim``, or D_k where that is
    None); a hybrid's ``linear_layers`` Gated DeltaNet layers of shape ``linear``."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    element_size: int  # bytes of a q/K/V element (4 for float32, 2 for bf16)
    lse_element_size: int = 4

    value_head_dim: int | None = None  # D_v where it differs from the query/key width (multi-head latent attention)
    linear_layers: int = 0
    linear: LinearShape | None = None

    @staticmethod
    def of(config, element_size: int) -> AttentionShape:
        shape = ModelShape.of(config)
        linear = (
            LinearShape(
                shape.linear_heads,
                shape.linear_key_dim,
                shape.linear_value_dim,
                shape.linear_conv_dim,
                shape.linear_conv_kernel,
            )
            if shape.linear_layers
            else None
        )
        return AttentionShape(
            shape.attention_layers,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            element_size,
            value_head_dim=shape.value_head_dim,
            linear_layers=len(shape.linear_layers),
            linear=linear,
        )

    def scan_bytes(self, layout, member: int) -> dict[str, int]:
        """The state scan's bytes ``member`` sends over a sequence sharded by ``layout``, all linear-attention
        layers (0 without them)."""
        if self.linear is None:
            return {"fwd": 0, "bwd": 0}
        per_layer = scan_bytes(layout, member, self.linear, self.element_size)
        return {k: self.linear_layers * v for k, v in per_layer.items()}

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

    def add(per_layer: dict[str, int], members, layout) -> None:
        scan = shape.scan_bytes(layout, members.index(rank))
        total["fwd"] += shape.layers * per_layer["fwd"] + scan["fwd"]
        total["bwd"] += shape.layers * per_layer["bwd"] + scan["bwd"] if train else 0

    def ring(members, layout, prefix=None) -> RingSpec:
        return RingSpec(Ring(None, members, members.index(rank)), layout, prefix, 1.0)

    if schedule.prefill is not None:
        prefill = schedule.prefill
        add(ring_bytes(ring(prefill.members, prefill.layout), *kv), prefill.members, prefill.layout)
    for step in schedule.steps:
        if step.layout is None:  # nothing fed by my ring: a local dummy call
            continue
        if step.kind == "move_q":
            spec = MoveQSpec(
                None, rank, schedule.prefill.layout, step.query_counts, ring(step.members, step.layout), 1.0
            )
            add(
                move_q_bytes(spec, shape.heads, *kv[:3], shape.element_size, shape.lse_element_size),
                step.members,
                step.layout,
            )
        else:
            add(ring_bytes(ring(step.members, step.layout, step.prefix), *kv), step.members, step.layout)
    return total
