"""The K/V ring: exact ring attention over a zigzag-sharded causal sequence, optionally with a fully
visible prefix (the prompt) riding along. RingCP is this ring over [prompt || response]; TreeMoveKV's
lane ring is this ring over a response with the lane's prompt shards as the prefix; MoveQ runs it over a
response's lane for the response's own causal part.

Every member m of a ring of size M holds, for one attention layer (D_k the query/key head width, D_v the
value width; equal but for multi-head latent attention):
    q [H, n_m, D_k]                  its queries (its zigzag shard of the causal sequence),
    k [H_kv, n_m, D_k], v [H_kv, n_m, D_v]     the K/V of the same tokens,
    pk [H_kv, p_m, D_k], pv [H_kv, p_m, D_v]   its shard of a prefix every query sees in full (p_m may be 0).
Forward: the block (k, v, pk, pv) of each member travels once around the ring (M - 1 P2P steps); each
member attends its queries to every block (full / diagonal / skipped per zigzag chunk pair, the prefix
in full) and merges the states in float32. Backward (docs/design.md §5: re-fetch rotated K/V, never reuse
step-0 tensors): the blocks travel around again, each followed by a float32 gradient accumulator that
collects every member's dK/dV contribution and arrives back at its owner after M sends; every block
backward uses the *merged* (out, lse).

Bytes one member sends per layer (e = K/V element size, ``block_elems(j) = H_kv (D_k + D_v) (n_j + p_j)``,
the K/V at their true widths):
    forward  = e * sum_{t=0}^{M-2} block_elems((m - t) mod M)          (every block but the next member's)
    backward = e * sum_{t=0}^{M-2} block_elems((m - t) mod M) + a * sum_j block_elems(j)
(the second term: M gradient-accumulator sends, one per block, in the accumulation dtype: a = 4 bytes,
8 for float64 inputs; nothing at all when M = 1). ``ring_bytes`` states it in code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from augtree_verl.cp.comm import TAG_GRAD, TAG_KV, Meter, Ring, finish
from augtree_verl.cp.layout import ZigzagLayout
from augtree_verl.ops.attention import attention_backward, attention_forward
from augtree_verl.ops.merge import accum_dtype, empty_state, merge_into


@dataclass(frozen=True)
class RingSpec:
    """Who holds what: ``layout`` shards the causal sequence over the ring members (member i of the ring
    owns layout part i); ``prefix`` (or None) shards the fully visible prefix the same way."""

    ring: Ring
    layout: ZigzagLayout
    prefix: ZigzagLayout | None
    scale: float

    def __post_init__(self):
        for name, lay in (("layout", self.layout), ("prefix", self.prefix)):
            if lay is not None and lay.parts != self.ring.size:
                raise ValueError(f"RingSpec.{name} has {lay.parts} parts for a ring of {self.ring.size}")

    def prefix_size(self, member: int) -> int:
        return self.prefix.size(member) if self.prefix is not None else 0


def block_elems(spec: RingSpec, member: int, kv_heads: int, head_dim: int, value_dim: int) -> int:
    """Elements of member ``member``'s travelling block (k, v, pk, pv): H_kv (D_k + D_v) per token."""
    return kv_heads * (head_dim + value_dim) * (spec.layout.size(member) + spec.prefix_size(member))


def ring_bytes(spec: RingSpec, kv_heads: int, head_dim: int, value_dim: int, kv_element_size: int) -> dict[str, int]:
    """Analytic bytes this rank sends per layer (see module docstring); ``head_dim`` D_k, ``value_dim`` D_v."""
    m, size = spec.ring.index, spec.ring.size
    relayed = sum(block_elems(spec, (m - t) % size, kv_heads, head_dim, value_dim) for t in range(size - 1))
    grads = sum(block_elems(spec, j, kv_heads, head_dim, value_dim) for j in range(size)) if size > 1 else 0
    accum_size = max(4, kv_element_size)  # float32 accumulators, float64 for float64 inputs
    return {"fwd": kv_element_size * relayed, "bwd": kv_element_size * relayed + accum_size * grads}


def no_prefix(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty prefix (pk [H_kv, 0, D_k], pv [H_kv, 0, D_v]) for a ring without one."""
    return k.new_empty(k.shape[0], 0, k.shape[2]), v.new_empty(v.shape[0], 0, v.shape[2])


class _Blocks:
    """Packs a member's (k, v, pk, pv) into one flat buffer and unpacks any member's buffer by its sizes
    (k/pk of width D_k, v/pv of width D_v)."""

    def __init__(self, spec: RingSpec, k: torch.Tensor, v: torch.Tensor):
        self.spec, self.h, self.dk, self.dv = spec, k.shape[0], k.shape[2], v.shape[2]

    def numel(self, member: int) -> int:
        return block_elems(self.spec, member, self.h, self.dk, self.dv)

    @staticmethod
    def pack(*tensors: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors])

    def unpack(self, buf: torch.Tensor, member: int) -> list[torch.Tensor]:
        n, p = self.spec.layout.size(member), self.spec.prefix_size(member)
        shapes = [(n, self.dk), (n, self.dv), (p, self.dk), (p, self.dv)]
        sizes = [self.h * ln * d for ln, d in shapes]
        return [t.view(self.h, ln, d) for t, (ln, d) in zip(buf.split(sizes), shapes)]


def _block_pairs(spec: RingSpec, me: int, other: int):
    """(query rows, key cols, causal, is_prefix) of every block computed between my queries and member
    ``other``'s block: zigzag chunk pairs (earlier chunk: full; same chunk: causal diagonal; later chunk:
    skipped), plus (all my rows, all prefix cols, False, True) when ``other`` carries a prefix shard."""
    pairs = []
    my_chunks = spec.layout.chunks(me)
    for qc in my_chunks:
        for kc in spec.layout.chunks(other):
            if kc.index < qc.index:
                pairs.append((qc.local, kc.local, False, False))
            elif kc.index == qc.index:
                pairs.append((qc.local, kc.local, True, False))
    n, p = spec.layout.size(me), spec.prefix_size(other)
    if n and p:
        pairs.append((slice(0, n), slice(0, p), False, True))
    return pairs


def ring_forward(q, k, v, pk, pv, spec: RingSpec, meter: Meter):
    """Merged state (out [H, n, D_v], lse [H, n]) in the accumulation dtype, of my queries over every
    member's sequence K/V (causal) and prefix K/V (full)."""
    ring, blocks = spec.ring, _Blocks(spec, k, v)
    me = ring.index
    out, lse = empty_state(q.shape[0], q.shape[1], v.shape[2], q)
    cur = blocks.pack(k, v, pk, pv)
    for t in range(ring.size):
        j = (me - t) % ring.size
        if t < ring.size - 1:
            nxt = cur.new_empty(blocks.numel((j - 1) % ring.size))
            pending = ring.start_shift(cur, nxt, meter, "fwd", TAG_KV)
        bk, bv, bpk, bpv = blocks.unpack(cur, j)
        for rows, cols, causal, is_prefix in _block_pairs(spec, me, j):
            kk, vv = (bpk, bpv) if is_prefix else (bk, bv)
            bo, bl = attention_forward(q[:, rows], kk[:, cols], vv[:, cols], causal=causal, scale=spec.scale)
            merge_into(out[:, rows], lse[:, rows], bo, bl)
        if t < ring.size - 1:
            finish(pending)
            cur = nxt
    return out, lse


def ring_backward(dout, q, k, v, pk, pv, out, lse, spec: RingSpec, meter: Meter):
    """Given the merged ``out`` (q's dtype) and ``lse`` of my queries (they may include attention parts
    outside this ring, e.g. MoveQ's prompt part), returns dq, dk, dv, dpk, dpv in the accumulation dtype:
    dq for my queries from this ring's keys, dK/dV for my own K/V and prefix shard from every member."""
    ring, blocks = spec.ring, _Blocks(spec, k, v)
    me, size, acc = ring.index, ring.size, accum_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    cur = blocks.pack(k, v, pk, pv)
    grad_in, grad_pending = None, None
    for t in range(size):
        j = (me - t) % size
        if t < size - 1:
            nxt = cur.new_empty(blocks.numel((j - 1) % size))
            kv_pending = ring.start_shift(cur, nxt, meter, "bwd", TAG_KV)
        bk, bv, bpk, bpv = blocks.unpack(cur, j)
        grad = torch.zeros(blocks.numel(j), dtype=acc, device=q.device)
        gk, gv, gpk, gpv = blocks.unpack(grad, j)
        for rows, cols, causal, is_prefix in _block_pairs(spec, me, j):
            kk, vv, dkk, dvv = (bpk, bpv, gpk, gpv) if is_prefix else (bk, bv, gk, gv)
            bq, bkk, bvv = attention_backward(
                dout[:, rows],
                q[:, rows],
                kk[:, cols],
                vv[:, cols],
                out[:, rows],
                lse[:, rows],
                causal=causal,
                scale=spec.scale,
            )
            dq[:, rows] += bq
            dkk[:, cols] += bkk
            dvv[:, cols] += bvv
        if grad_pending is not None:
            finish(grad_pending)
            grad += grad_in
        if size > 1:
            # my accumulator for block j goes to the next member, who holds block j at step t + 1; the
            # last send (t = size - 1) delivers block me + 1's finished gradient to its owner.
            grad_in = grad.new_empty(blocks.numel((j - 1) % size))
            grad_pending = ring.start_shift(grad, grad_in, meter, "bwd", TAG_GRAD)
        if t < size - 1:
            finish(kv_pending)
            cur = nxt
    if size > 1:
        finish(grad_pending)
        grad = grad_in
    dk, dv, dpk, dpv = blocks.unpack(grad, me)
    return dq, dk, dv, dpk, dpv


class RingAttention(torch.autograd.Function):
    """out [H, n, D_v] = causal ring attention of q over the ring's sequence K/V and prefix K/V."""

    @staticmethod
    def forward(ctx, q, k, v, pk, pv, spec: RingSpec, meter: Meter):
        out, lse = ring_forward(q, k, v, pk, pv, spec, meter)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, pk, pv, out, lse)
        ctx.spec, ctx.meter = spec, meter
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, pk, pv, out, lse = ctx.saved_tensors
        grads = ring_backward(dout.contiguous(), q, k, v, pk, pv, out, lse, ctx.spec, ctx.meter)
        inputs = (q, k, v, pk, pv)
        return (
            *(g.to(x.dtype) if need else None for g, x, need in zip(grads, inputs, ctx.needs_input_grad)),
            None,
            None,
        )


def ring_attention(q, k, v, spec: RingSpec, meter: Meter, prefix_kv=None) -> torch.Tensor:
    """RingCP attention of one layer on this member: q [H, n, D_k], k [H_kv, n, D_k], v [H_kv, n, D_v] (this
    member's zigzag shard, post-RoPE), ``prefix_kv`` = (pk [H_kv, p, D_k], pv [H_kv, p, D_v]) or None
    -> out [H, n, D_v]."""
    if (prefix_kv is None) != (spec.prefix is None):
        raise ValueError("ring_attention: prefix_kv must be given exactly when the RingSpec has a prefix layout")
    if prefix_kv is None:
        prefix_kv = no_prefix(k, v)
    return RingAttention.apply(q, k, v, prefix_kv[0], prefix_kv[1], spec, meter)
