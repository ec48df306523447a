"""TreeMoveKV: the d ranks form s lanes of d/s ranks; each lane keeps the prompt sharded over its members
(prefilled once per lane with a causal ring over the lane) and replays its own responses with a K/V ring
that carries only the prompt shards and the K/V of the response being replayed (docs/design.md §3).

At the attention level one replay step of a lane is exactly the K/V ring of ``ring.py`` over the lane's
members, with the response as the causal sequence and the lane's prompt shards as the fully visible
prefix: forward, backward (the prompt shards' dK/dV travel home with the ring and accumulate into the
prompt leaves) and the byte count (``ring.ring_bytes``) are that ring's. Lanes never talk to each other.
"""

from __future__ import annotations

import torch

from augtree_verl.cp.comm import Meter, Ring
from augtree_verl.cp.layout import ZigzagLayout, lane_members
from augtree_verl.cp.ring import RingSpec, ring_attention, ring_bytes


def lane_of(rank: int, degree: int, lanes: int) -> int:
    """The lane of CP rank ``rank`` (lanes are contiguous blocks of ranks, see ``layout.lane_members``)."""
    return next(lane for lane in range(lanes) if rank in lane_members(degree, lanes, lane))


def lane_ring_spec(group, rank: int, degree: int, lanes: int, response_len: int, prompt_len: int,
                   scale: float) -> RingSpec:
    """The ring of ``rank``'s lane replaying a response of ``response_len`` tokens (zigzag over the lane)
    after a prompt of ``prompt_len`` tokens (zigzag over the lane, ``None`` prefix when empty)."""
    members = lane_members(degree, lanes, lane_of(rank, degree, lanes))
    prefix = ZigzagLayout(prompt_len, len(members)) if prompt_len else None
    return RingSpec(Ring(group, members, members.index(rank)), ZigzagLayout(response_len, len(members)),
                    prefix, scale)


def tree_move_kv_attention(q, k, v, prompt_kv, spec: RingSpec, meter: Meter) -> torch.Tensor:
    """One layer of a lane's replay step: q [H, n, D], k/v [H_kv, n, D] (my shard of the response),
    ``prompt_kv`` = (pk, pv) [H_kv, p, D] (my shard of the lane's prompt, or None) -> out [H, n, D]."""
    return ring_attention(q, k, v, spec, meter, prefix_kv=prompt_kv)


def tree_move_kv_bytes(spec: RingSpec, kv_heads: int, head_dim: int, kv_element_size: int) -> dict[str, int]:
    """Bytes this rank sends per layer of one replay step: the lane ring's (``ring.ring_bytes``),
    i.e. 2 H_kv D (prompt shards + response shards) per relayed block; nothing crosses lanes."""
    return ring_bytes(spec, kv_heads, head_dim, kv_element_size)
