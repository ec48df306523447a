"""The linear-attention state scan: a Gated DeltaNet layer run exactly over a zigzag-sharded sequence.

A ring member holds its chunks of the sequence (``layout.chunks``: chunks i and 2M-1-i of 2M, M ring members).
Two things cross a chunk boundary in a Gated DeltaNet layer: the causal conv's window, the last K - 1 pre-conv
rows (``mixed_qkv`` columns, K = ``linear_conv_kernel_dim``), and the delta rule's recurrent state S [H_v, D_k,
D_v], which a chunk maps affinely: S_out = M S_in + E (``ops.gated_delta``). So, per layer, on every member,
inside the layer's own forward (``replay.linear_state`` routes the layer's conv input and chunk kernel here;
the projections, conv, kernels, gating and norm stay the layer's):

1. rows: the member's chunks become rows [c, L, H], right padded to L = max(longest chunk, 2) (a causal layer
   never reads a later position; one-token rows would take the layer's single-step path); a member with no
   token runs one dummy row;
2. conv: each member all-gathers the last min(n, K - 1) pre-conv rows of each of its chunks and folds every
   chunk's in chunk order from the start window (zeros, or a prompt's): the window entering each chunk and
   the sequence's final one. Its rows run the layer's conv from their true windows;
3. state: each member summarises each of its chunks from the layer's own k, v, g, beta (after the true conv)
   as (M, E), all-gathers the summaries and folds them in chunk order from the start state (zero, or a
   prompt's): the state entering each chunk and the final state. The scan is this fold, sequential over the
   gathered summaries (at most 2M <= 16 steps of [D_k, D_k] x [D_k, D_v] per head); the rows run the layer's
   chunk kernel from their true incoming states, so their outputs are the kernel's own.
Every member thus holds the sequence's final (conv window, state): a prefill's capture on every member, which
the responses on any member start from. The window's first of K columns, which no continuation reads (the conv
reads the last K - 1), is zero.

Backward: autograd through the folds is the adjoint scan (dS_in = M^T dS_out, dM = dS_out S_in^T, dE = dS_out,
and the windows' slices likewise), evaluated on each member for what its own rows and final state read; each
all-gather's backward returns every part's gradient to its owner, summed in member order in float32 (the
accumulation dtype). Each member's adjoint is a partial sum: by linearity, their sum at the owners is the
whole gradient, also where a start state's replicas (a prompt's final state on several members) took
different members' gradients.

Lock-step. The two all-gathers run forward in the order conv, state, and backward state, conv, on every member:
the conv gather's output reaches the state gather's input through the rows' k (and a zero-size slice of it on
a member with no token), the state gather's output reaches every row's kernel through one stacked table of
incoming states (its final row included), and the conv gather's input comes from the layer's input. So each
gather's backward sits between the layer's output gradient and its input gradient on every member.

Bytes one member sends per layer (``scan_bytes``): e the pre-conv element size, a = max(4, e) the accumulation
element size, t_c = min(n_c, K - 1) the tail of chunk c, s = 4 H_v D_k (D_k + D_v) one summary (float32),
``own`` the member's non-empty chunks and ``other`` the other members':

    forward  = (M - 1) (e conv_dim sum_{c in own} t_c + s |own|)
    backward = a conv_dim sum_{c in other} t_c + s |other|

with conv_dim = 2 H_k D_k + H_v D_v; nothing when M = 1. Independent of the chunks' lengths beyond K - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from augtree_verl.cp.comm import Meter, Ring, finish, nbytes, resolve
from augtree_verl.cp.layout import Chunk, ZigzagLayout
from augtree_verl.ops.gated_delta import MIN_ROW_TOKENS, STATE_DTYPE, chunk_summary
from augtree_verl.ops.merge import accum_dtype

TAG_STATE = 3  # P2P tag of the scan's all-gathers (``comm``'s tags are 0-2)


@dataclass(frozen=True)
class LinearShape:
    """One Gated DeltaNet layer: ``heads`` value heads H_v (the recurrent state's; key heads are repeated up to
    them), key width D_k, value width D_v, ``conv_dim`` = 2 H_k D_k + H_v D_v pre-conv channels, conv ``kernel``
    K."""

    heads: int
    key_dim: int
    value_dim: int
    conv_dim: int
    kernel: int

    @property
    def window(self) -> int:
        """K - 1: the pre-conv rows a chunk reads before its first token."""
        return self.kernel - 1

    @property
    def summary_elems(self) -> int:
        """Elements of one chunk's (M, E): H_v D_k (D_k + D_v)."""
        return self.heads * self.key_dim * (self.key_dim + self.value_dim)


def scan_bytes(layout: ZigzagLayout, member: int, shape: LinearShape, element_size: int) -> dict[str, int]:
    """Analytic bytes ``member`` sends per layer (module docstring); ``element_size``: e, the pre-conv rows'."""
    own = layout.chunks(member)
    other = [c for j in range(layout.parts) if j != member for c in layout.chunks(j)]
    tails = lambda chunks: sum(min(c.length, shape.window) for c in chunks)
    summary = STATE_DTYPE.itemsize * shape.summary_elems
    accum = max(4, element_size)
    return {
        "fwd": (layout.parts - 1) * (element_size * shape.conv_dim * tails(own) + summary * len(own)),
        "bwd": accum * shape.conv_dim * tails(other) + summary * len(other),
    }


def _swap(ring: Ring, sends: dict[int, torch.Tensor], counts: list[int], like: torch.Tensor) -> dict[int, torch.Tensor]:
    """Sends ``sends[j]`` to ring member j and receives ``counts[j]`` elements (``like``'s dtype and device)
    from it, for every other member j, in one P2P batch; zero-size ones are not posted (both sides know every
    size)."""
    group, ops, received = resolve(ring.group), [], {}
    for j, peer in enumerate(ring.members):
        if j == ring.index:
            continue
        if sends[j].numel():
            ops.append(dist.P2POp(dist.isend, sends[j].contiguous(), group=group, tag=TAG_STATE, group_peer=peer))
        received[j] = like.new_empty(counts[j])
        if counts[j]:
            ops.append(dist.P2POp(dist.irecv, received[j], group=group, tag=TAG_STATE, group_peer=peer))
    finish(dist.batch_isend_irecv(ops) if ops else [])
    return received


class AllGather(torch.autograd.Function):
    """mine [counts[me]] -> every ring member's buffer, concatenated in member order [sum(counts)]. Backward:
    each member's slice of the gradient goes to that member, which sums what it gets in member order, in the
    accumulation dtype."""

    @staticmethod
    def forward(ctx, mine: torch.Tensor, ring: Ring, counts: list[int], meter: Meter):
        ctx.ring, ctx.counts, ctx.meter = ring, counts, meter
        meter.add("fwd", nbytes(mine) * (ring.size - 1))
        got = _swap(ring, dict.fromkeys(range(ring.size), mine), counts, mine)
        return torch.cat([mine if j == ring.index else got[j] for j in range(ring.size)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ring, counts, me = ctx.ring, ctx.counts, ctx.ring.index
        parts = grad.to(accum_dtype(grad.dtype)).split(counts)
        sends = {j: part for j, part in enumerate(parts) if j != me}
        ctx.meter.add("bwd", sum(nbytes(part) for part in sends.values()))
        got = _swap(ring, sends, [counts[me]] * ring.size, parts[me])
        total = parts[0] if me == 0 else got[0]
        for j in range(1, ring.size):
            total = total + (parts[me] if j == me else got[j])
        return total.to(grad.dtype), None, None, None


class StateScan:
    """One Gated DeltaNet layer's call on member ``ring.index`` of a sequence sharded by ``layout`` over
    ``ring`` (module docstring). It is the call's transformers linear-attention cache (``has_previous_state``,
    ``layers[layer].conv_states`` / ``.recurrent_states``, ``update_conv_state``, ``update_recurrent_state``)
    and answers the routed pieces: ``rows`` (the layer's input), ``conv_input``, ``chunk_rule`` and ``join``
    (its output). ``start``: (conv [1, conv_dim, K], recurrent [1, H_v, D_k, D_v]) the sequence continues from (a
    prompt's leaves on this member), None: zero; ``sink``: where the final (conv [1, conv_dim, K], recurrent [1,
    H_v, D_k, D_v]) go, the first capture winning (None: dropped)."""

    def __init__(
        self,
        layer: int,
        ring: Ring,
        layout: ZigzagLayout,
        meter: Meter,
        start: tuple[torch.Tensor, torch.Tensor] | None = None,
        sink: dict | None = None,
    ):
        if layout.parts != ring.size:
            raise ValueError(f"StateScan: a layout of {layout.parts} parts for a ring of {ring.size}")
        self.layer, self.ring, self.layout, self.meter, self.start, self.sink = layer, ring, layout, meter, start, sink
        self.mine = layout.chunks(ring.index)
        self.lengths = [c.length for c in self.mine] or [0]  # real tokens per row; no token: one dummy row
        self.layers = {layer: self}
        self.conv_states: torch.Tensor | None = None  # the rows' placeholder windows, replaced in ``conv_input``
        self.recurrent_states = None  # the kernel's initial state comes from the scan (``chunk_rule``)
        self.shape: LinearShape | None = None
        self.width = max(MIN_ROW_TOKENS, *self.lengths)  # L
        self.final: tuple[torch.Tensor, ...] = ()

    # transformers' cache protocol
    def has_previous_state(self, layer: int | None = None) -> bool:
        return True

    def update_conv_state(self, conv: torch.Tensor, layer: int) -> None:
        """The layer's view of the rows' last K columns (padding included): not the sequence's; the scan's is."""

    def update_recurrent_state(self, recurrent, layer: int) -> None:
        if self.sink is not None:
            self.sink.setdefault(layer, self.final)

    # the routed pieces, in call order
    def rows(self, hidden: torch.Tensor, shape: LinearShape) -> torch.Tensor:
        """My shard hidden [1, S, H] (S = max(n, 1)) -> rows [c, L, H], my chunks right padded (or the dummy)."""
        self.shape = shape
        parts = [hidden[0, c.local] for c in self.mine] or [hidden[0, :1]]
        rows = torch.stack([F.pad(p, (0, 0, 0, self.width - p.shape[0])) for p in parts])
        self.conv_states = hidden.new_zeros(rows.shape[0], shape.conv_dim, shape.kernel)
        return rows

    def conv_input(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's conv input x [c, conv_dim, K + L] (placeholder windows, then the rows' pre-conv columns)
        -> the same with every row's true incoming window (module docstring, step 2)."""
        shape, kernel = self._shape(), x.shape[-1] - self.width
        w = shape.window
        tails = [x[r, :, kernel + n - min(n, w) : kernel + n] for r, n in enumerate(self.lengths)]
        mine = torch.cat([t.reshape(-1) for t in tails])  # the dummy row adds a zero-size slice (lock-step)
        received = self._gather(mine, lambda c: shape.conv_dim * min(c.length, w))
        window = self.start[0][0, :, 1:] if self.start is not None else x.new_zeros(shape.conv_dim, w)
        entering = {}
        for c in sorted(received):
            entering[c] = window
            joined = torch.cat([window, received[c].view(shape.conv_dim, -1)], dim=1)
            window = joined[:, joined.shape[1] - w :]
        table = F.pad(torch.stack([entering[c.index] for c in self.mine] + [window]), (1, 0))  # [c + 1, conv_dim, K]
        self.final = (table[-1:],)
        return torch.cat([table[:-1] if self.mine else table[-1:], x[:, :, kernel:]], dim=-1)

    def chunk_rule(self, kernel, query, key, value, *, g, beta, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
        """The layer's chunk-kernel call on the rows (q, k [c, L, H_v, D_k], v [c, L, H_v, D_v], g, beta [c, L,
        H_v]) -> (out [c, L, H_v, D_v], None): ``kernel`` (the layer's own) from every row's true incoming state
        (module docstring, step 3); the final state goes to ``final``."""
        if cu_seqlens is not None:
            raise ValueError("StateScan: packed rows (cu_seqlens) would leak state between sequences; rows are padded")
        shape = self._shape()
        own = [
            chunk_summary(key[r, :n], value[r, :n], g[r, :n], beta[r, :n], normalize=use_qk_l2norm_in_kernel)
            for r, n in enumerate(self.lengths)
            if n
        ]
        tie = key.reshape(-1)[:0].to(STATE_DTYPE)  # a member with no token: its input still reaches back (lock-step)
        mine = torch.cat([x.reshape(-1) for pair in own for x in pair] + [tie])
        received = self._gather(mine, lambda c: shape.summary_elems)
        dk, dv = shape.key_dim, shape.value_dim
        state = self.start[1][0] if self.start is not None else key.new_zeros(shape.heads, dk, dv, dtype=STATE_DTYPE)
        entering = {}
        for c in sorted(received):
            entering[c] = state
            m, e = received[c].split([shape.heads * dk * dk, shape.heads * dk * dv])
            state = m.view(shape.heads, dk, dk) @ state + e.view(shape.heads, dk, dv)
        table = torch.stack([entering[c.index] for c in self.mine] + [state])  # [c + 1, H_v, D_k, D_v]
        self.final = (*self.final, table[-1:])
        out, _ = kernel(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=table[:-1] if self.mine else table[-1:],
            output_final_state=False,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        return out, None

    def join(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output on the rows [c, L, H] -> my shard's [1, S, H]."""
        if not self.mine:
            return out[:1, :1]
        return torch.cat([out[r, : c.length] for r, c in enumerate(self.mine)])[None]

    def _shape(self) -> LinearShape:
        if self.shape is None:
            raise ValueError(f"StateScan of layer {self.layer}: the layer's rows were not taken (``rows``) first")
        return self.shape

    def _gather(self, mine: torch.Tensor, size) -> dict[int, torch.Tensor]:
        """All-gather over the ring of every member's chunk parts (``size(chunk)`` elements each, a member's in
        its local chunk order; ``mine``: mine) -> chunk index -> that chunk's part."""
        chunks: list[Chunk] = [c for j in range(self.ring.size) for c in self.layout.chunks(j)]
        counts = [sum(size(c) for c in self.layout.chunks(j)) for j in range(self.ring.size)]
        gathered = AllGather.apply(mine, self.ring, counts, self.meter)
        return {c.index: part for c, part in zip(chunks, gathered.split([size(c) for c in chunks]))}
