"""MoveQ: prompt K/V stays on its owners; response queries travel to them (docs/design.md §3).

The prompt (all but what the responses recompute) is zigzag-sharded over all d ranks of the CP group and
prefilled once. In a replay step each lane of ranks holds one response, its tokens zigzag-sharded over
the lane. For one attention layer, the rank holding queries q [H, n, D_k] of a response (D_k the query/key head
width, D_v the value width; equal but for multi-head latent attention):
  1. sends q to every prompt owner (``all_to_all_single`` over the CP group; an owner serves the queries
     of every lane at once);
  2. each owner attends all received queries to its prompt shard and returns the partial states
     (out [H, n, D_v] in q's dtype, lse [H, n]);
  3. the response's own causal part runs as a K/V ring over the lane (``ring.ring_forward``, no prefix);
  4. all partial states merge exactly on the query owner (``merge.merge_into``, float32).
Backward: the query owner sends (dout, merged out, merged lse) to every owner, which runs its block's
backward with the *merged* state (the exact share of the merged attention's gradient, see
``ops.attention.attention_backward``), keeps dK/dV for its prompt shard (accumulated across lanes and steps into
the prompt leaves) and returns dq; the lane ring backward gives the response's own dq/dk/dv.
The merge is fused into this autograd Function rather than composed from autograd collectives because a
partial state's lse gradient cannot be fed to the flash backward kernels; the merged-state backward is
exact and needs no lse gradient.

Bytes one rank sends per layer (e = q/K/V element size, f = lse element size, O = prompt owners other
than this rank, S = queries this rank serves for other ranks, 0 if it owns no prompt token):
    forward  = e n H D_k |O| + S H (e D_v + f)            + lane ring forward
    backward = n H (2 e D_v + f) |O| + S H D_k e          + lane ring backward
(queries and dq are D_k wide; partial outputs, dout and the merged out D_v wide)
``move_q_bytes`` states it in code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from augtree_verl.cp.comm import Meter, all_to_all_rows
from augtree_verl.cp.layout import ZigzagLayout
from augtree_verl.cp.ring import RingSpec, no_prefix, ring_backward, ring_bytes, ring_forward
from augtree_verl.ops.attention import attention_backward, attention_forward
from augtree_verl.ops.merge import accum_dtype, merge_into


@dataclass(frozen=True)
class MoveQSpec:
    """``group``: the CP group (every rank owns a prompt shard, by ``prompt``, a layout with one part per
    group rank); ``rank``: this rank in it; ``query_counts[j]``: queries group rank j holds in this step
    (0 for a rank whose lane is idle); ``lane``: the ring over this rank's lane for the response's own part."""

    group: Any
    rank: int
    prompt: ZigzagLayout
    query_counts: tuple[int, ...]
    lane: RingSpec
    scale: float

    def __post_init__(self):
        if len(self.query_counts) != self.prompt.parts:
            raise ValueError(
                f"MoveQSpec.query_counts has {len(self.query_counts)} entries for {self.prompt.parts} prompt owners"
            )
        if self.query_counts[self.rank] != self.lane.layout.size(self.lane.ring.index):
            raise ValueError("MoveQSpec.query_counts disagrees with the lane layout for this rank")

    def send_counts(self, n: int) -> list[int]:
        return [n if self.prompt.size(j) else 0 for j in range(self.prompt.parts)]

    def recv_counts(self) -> list[int]:
        serving = self.prompt.size(self.rank) > 0
        return [c if serving else 0 for c in self.query_counts]

    def owners(self) -> list[int]:
        return [j for j in range(self.prompt.parts) if self.prompt.size(j)]


def move_q_bytes(
    spec: MoveQSpec,
    heads: int,
    kv_heads: int,
    head_dim: int,
    value_dim: int,
    element_size: int,
    lse_element_size: int,
) -> dict[str, int]:
    """Analytic bytes this rank sends per layer (see module docstring); ``head_dim`` D_k, ``value_dim`` D_v."""
    n = spec.query_counts[spec.rank]
    other_owners = sum(1 for j in spec.owners() if j != spec.rank)
    served = sum(c for j, c in enumerate(spec.recv_counts()) if j != spec.rank)
    ring = ring_bytes(spec.lane, kv_heads, head_dim, value_dim, element_size)
    e, f, h, dk, dv = element_size, lse_element_size, heads, head_dim, value_dim
    return {
        "fwd": e * n * h * dk * other_owners + served * h * (e * dv + f) + ring["fwd"],
        "bwd": n * h * (2 * e * dv + f) * other_owners + served * h * dk * e + ring["bwd"],
    }


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[H, n, D] -> [n, H * D] (rows are tokens, the split dimension of all_to_all; D: D_k for queries and dq,
    D_v for outputs, dout and the merged out)."""
    return x.transpose(0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2])


def _heads(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """[n, H * D] -> [H, n, D] (D any width)."""
    return rows.view(rows.shape[0], heads, rows.shape[1] // heads).transpose(0, 1)


def _split_owners(rows: torch.Tensor, owners: int, n: int) -> list[torch.Tensor]:
    return [rows[i * n : (i + 1) * n] for i in range(owners)]


def _prompt_partials(q, pk, pv, spec: MoveQSpec, meter: Meter):
    """Steps 1-2: returns (served queries [H, N, D_k], per-owner partial states (out [H, n, D_v], lse [H, n])
    for my queries)."""
    heads, n, _ = q.shape
    owners, send, recv = spec.owners(), spec.send_counts(n), spec.recv_counts()
    q_rows = _rows(q)
    served = _heads(all_to_all_rows(torch.cat([q_rows] * len(owners)), send, recv, spec.group, meter, "fwd"), heads)
    if served.shape[1]:
        o, lse = attention_forward(served, pk, pv, causal=False, scale=spec.scale)
    else:
        o, lse = served.new_empty(heads, 0, pv.shape[2]), served.new_empty(heads, 0, dtype=accum_dtype(q.dtype))
    o_back = all_to_all_rows(_rows(o), recv, send, spec.group, meter, "fwd")
    lse_back = all_to_all_rows(lse.t().contiguous(), recv, send, spec.group, meter, "fwd")
    parts = [
        (_heads(o_i, heads), l_i.t())
        for o_i, l_i in zip(_split_owners(o_back, len(owners), n), _split_owners(lse_back, len(owners), n))
    ]
    return served, parts


class MoveQAttention(torch.autograd.Function):
    """out [H, n, D_v]: my response queries attend to [every owner's prompt shard ; the lane's response K/V
    (causal)]; inputs q [H, n, D_k], k [H_kv, n, D_k], v [H_kv, n, D_v] (my response shard), pk [H_kv, p, D_k],
    pv [H_kv, p, D_v] (my prompt shard)."""

    @staticmethod
    def forward(ctx, q, k, v, pk, pv, spec: MoveQSpec, meter: Meter):
        served, parts = _prompt_partials(q, pk, pv, spec, meter)
        out, lse = ring_forward(q, k, v, *no_prefix(k, v), spec.lane, meter)
        for part_out, part_lse in parts:
            merge_into(out, lse, part_out, part_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, pk, pv, out, lse, served)
        ctx.spec, ctx.meter = spec, meter
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, pk, pv, out, lse, served = ctx.saved_tensors
        spec, meter = ctx.spec, ctx.meter
        heads, n, _ = q.shape
        owners, send, recv = spec.owners(), spec.send_counts(n), spec.recv_counts()
        dout = dout.contiguous()
        payload = torch.cat([_rows(dout), _rows(out)], dim=1)
        got = all_to_all_rows(torch.cat([payload] * len(owners)), send, recv, spec.group, meter, "bwd")
        got_lse = all_to_all_rows(torch.cat([lse.t()] * len(owners)), send, recv, spec.group, meter, "bwd")
        if served.shape[1]:
            s_dout, s_out = (_heads(x, heads) for x in got.chunk(2, dim=1))
            dq_served, dpk, dpv = attention_backward(
                s_dout, served, pk, pv, s_out, got_lse.t().contiguous(), causal=False, scale=spec.scale
            )
        else:
            dq_served, dpk, dpv = served.clone(), torch.zeros_like(pk), torch.zeros_like(pv)
        dq_back = all_to_all_rows(_rows(dq_served), recv, send, spec.group, meter, "bwd")
        dq, dk, dv, _, _ = ring_backward(dout, q, k, v, *no_prefix(k, v), out, lse, spec.lane, meter)
        for part in _split_owners(dq_back, len(owners), n):
            dq += _heads(part, heads)
        grads = (dq, dk, dv, dpk, dpv)
        return (
            *(g.to(x.dtype) if need else None for g, x, need in zip(grads, (q, k, v, pk, pv), ctx.needs_input_grad)),
            None,
            None,
        )


def move_q_attention(q, k, v, prompt_kv, spec: MoveQSpec, meter: Meter) -> torch.Tensor:
    """MoveQ attention of one layer on this rank (shapes in ``MoveQAttention``); ``prompt_kv`` = (pk, pv)."""
    if dist.get_world_size(spec.group) != spec.prompt.parts:
        raise ValueError(
            f"MoveQ prompt layout has {spec.prompt.parts} owners but the CP group has "
            f"{dist.get_world_size(spec.group)} ranks"
        )
    return MoveQAttention.apply(q, k, v, prompt_kv[0], prompt_kv[1], spec, meter)
