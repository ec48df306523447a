"""The analytic count of what each CP primitive must move: bytes one rank sends for one replay tree.

Composed from the per-layer formulas stated next to each primitive (``ring.ring_bytes``,
``tree_move_kv.tree_move_kv_bytes``, ``move_q.move_q_bytes``) over the schedule of ``engine.replay_cp``,
times the number of layers; forward and backward ("bwd" is 0 for a forward-only replay). Used by the tests
(measured == analytic) and by ``benchmarks/cp_comm.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from augtree_verl.cp.comm import Ring
from augtree_verl.cp.layout import ZigzagLayout, lane_members
from augtree_verl.cp.move_q import MoveQSpec, move_q_bytes
from augtree_verl.cp.ring import RingSpec, ring_bytes
from augtree_verl.plan import Plan


@dataclass(frozen=True)
class AttentionShape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    element_size: int       # bytes of a q/K/V element (4 for float32, 2 for bf16)
    lse_element_size: int = 4

    @staticmethod
    def of(config, element_size: int) -> "AttentionShape":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return AttentionShape(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                              head_dim, element_size)


def analytic_bytes(plan: Plan, prompt_len: int, response_lens: list[int], rank: int, shape: AttentionShape,
                   train: bool = True) -> dict[str, int]:
    d, total = plan.degree, {"fwd": 0, "bwd": 0}

    def add(per_layer: dict[str, int]) -> None:
        total["fwd"] += shape.layers * per_layer["fwd"]
        total["bwd"] += shape.layers * per_layer["bwd"] if train else 0

    def ring(members, length, prefix_len=0) -> RingSpec:
        prefix = ZigzagLayout(prefix_len, len(members)) if prefix_len else None
        return RingSpec(Ring(None, members, members.index(rank)), ZigzagLayout(length, len(members)), prefix, 1.0)

    kv = (shape.kv_heads, shape.head_dim, shape.element_size)
    everyone = tuple(range(d))
    if plan.primitive == "ring":
        for r in response_lens:  # [prompt || response[:-1]] over all d ranks, once per response
            add(ring_bytes(ring(everyone, prompt_len + r - 1), *kv))
        return total
    lanes = [lane_members(d, plan.lanes, lane) for lane in range(plan.lanes)]
    my_lane = next(lane for lane, m in enumerate(lanes) if rank in m)
    if plan.primitive == "tree_move_kv":
        add(ring_bytes(ring(lanes[my_lane], prompt_len), *kv))  # lane prefill
        for i, (_, lane) in enumerate(plan.placement):
            if lane == my_lane and response_lens[i] > 1:
                add(ring_bytes(ring(lanes[my_lane], response_lens[i] - 1, prompt_len), *kv))
        return total
    add(ring_bytes(ring(everyone, prompt_len), *kv))  # move_q: one prefill over all d ranks
    prompt = ZigzagLayout(prompt_len, d)
    for rnd in range(plan.rounds):
        cells = [[i for i, c in enumerate(plan.placement) if c == (rnd, lane)] for lane in range(plan.lanes)]
        for step in range(max(len(c) for c in cells)):
            fed = [response_lens[c[step]] - 1 if step < len(c) else 0 for c in cells]
            if not any(fed):
                continue
            layouts = [ZigzagLayout(n, len(m)) for n, m in zip(fed, lanes)]
            counts = tuple(layouts[lane].size(j) for lane, m in enumerate(lanes) for j in range(len(m)))
            lane_ring = RingSpec(Ring(None, lanes[my_lane], lanes[my_lane].index(rank)), layouts[my_lane], None, 1.0)
            spec = MoveQSpec(None, rank, prompt, counts, lane_ring, 1.0)
            add(move_q_bytes(spec, shape.heads, shape.kv_heads, shape.head_dim, shape.element_size,
                             shape.lse_element_size))
    return total
