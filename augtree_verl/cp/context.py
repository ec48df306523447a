"""The attention contexts a CP replay passes through the model call (``augtree_ctx=...``).

The replay engine's "augtree" attention function (``replay.attention``) calls ``ctx.attend(layer, q, k, v,
scaling)`` with this rank's tokens, q [1, H, S, D_k], k [1, H_kv, S, D_k], v [1, H_kv, S, D_v] post-RoPE, and wants
[1, H, S, D_v] back (D_v != D_k: multi-head latent attention). A rank that owns no token of the sequence still has
to relay K/V and serve queries, but transformers cannot run a model on zero tokens: such a rank runs one dummy
token, ``S = max(n, 1)`` while only the first ``n`` rows are real; the dummy gets a zero output (independent of its
q/k/v, so its gradients are exactly zero) and its K/V never leave the rank. Contexts are read-only during a model
call, so an activation-checkpoint recompute re-runs the same attention (and the same communication) on every rank.
They are plain classes, not dataclasses: FSDP2's cast_forward_inputs copies dataclasses found in forward kwargs,
which would lose the prefill capture (as in ``replay.attention``).

A Gated DeltaNet layer asks ``ctx.linear_state(layer, rows)`` instead (``replay.linear_state``): every context
answers with the state scan over its ring and layout (``cp.state_scan``), from zero (a prefill, RingCP's
[prompt || response]) or from the prompt's final state this rank holds (a response over a lane).
"""

from __future__ import annotations

import torch

from augtree_verl.cp.comm import Meter, Ring
from augtree_verl.cp.layout import ZigzagLayout
from augtree_verl.cp.move_q import MoveQSpec, move_q_attention
from augtree_verl.cp.ring import RingSpec, ring_attention
from augtree_verl.cp.state_scan import StateScan


def _real(x: torch.Tensor, n: int) -> torch.Tensor:
    return x[0, :, :n]


def _padded(out: torch.Tensor, rows: int) -> torch.Tensor:
    """[H, n, D_v] -> [1, H, rows, D_v] with zero rows for the dummy token."""
    if out.shape[1] < rows:
        out = torch.cat([out, out.new_zeros(out.shape[0], rows - out.shape[1], out.shape[2])], dim=1)
    return out[None]


class RingContext:
    """Causal ring attention over ``layout`` (RingCP over [prompt || response], or a prompt prefill).
    With ``capture`` (a dict), records each layer's real (k [H_kv, n, D_k], v [H_kv, n, D_v]), still in the graph;
    the first capture wins so a checkpoint recompute cannot replace it."""

    def __init__(self, ring: Ring, layout: ZigzagLayout, meter: Meter, capture: dict | None = None):
        self.ring, self.layout, self.meter, self.capture = ring, layout, meter, capture

    def attend(self, layer, q, k, v, scaling):
        n = self.layout.size(self.ring.index)
        rows = q.shape[2]
        q, k, v = _real(q, n), _real(k, n), _real(v, n)
        if self.capture is not None:
            self.capture.setdefault(layer, (k, v))
        spec = RingSpec(self.ring, self.layout, None, scaling)
        return _padded(ring_attention(q, k, v, spec, self.meter), rows)

    def linear_state(self, layer: int, rows: int) -> StateScan:
        """A Gated DeltaNet layer: the state scan over the ring from zero state; its final state captured."""
        return StateScan(layer, self.ring, self.layout, self.meter, sink=self.capture)


class LaneReplayContext:
    """TreeMoveKV replay step: the lane ring over the response (``layout``) carrying the lane's prompt
    shards (``prompt``; ``prompt_kv[layer]`` = this rank's (pk, pv) leaves) as a fully visible prefix.

    TreeMoveKV at the attention level is exactly this: the K/V ring of ``ring.py`` over the lane's members
    (``layout.lane_members``), the response as the causal sequence and the lane's prompt shards as the
    prefix. Forward, backward (the prompt shards' dK/dV travel home with the ring into the prompt leaves)
    and the byte count (``ring.ring_bytes``) are that ring's; lanes never talk to each other."""

    def __init__(self, ring: Ring, layout: ZigzagLayout, prompt: ZigzagLayout | None, prompt_kv: list, meter: Meter):
        self.ring, self.layout, self.prompt, self.prompt_kv, self.meter = ring, layout, prompt, prompt_kv, meter

    def attend(self, layer, q, k, v, scaling):
        n = self.layout.size(self.ring.index)
        rows = q.shape[2]
        q, k, v = _real(q, n), _real(k, n), _real(v, n)
        spec = RingSpec(self.ring, self.layout, self.prompt, scaling)
        prefix = self.prompt_kv[layer] if self.prompt is not None else None
        return _padded(ring_attention(q, k, v, spec, self.meter, prefix_kv=prefix), rows)

    def linear_state(self, layer: int, rows: int) -> StateScan:
        """A Gated DeltaNet layer: the state scan over the lane from the prompt's final state on this rank."""
        start = self.prompt_kv[layer] if self.prompt is not None else None
        return StateScan(layer, self.ring, self.layout, self.meter, start=start)


class MoveQReplayContext:
    """MoveQ replay step: queries of this rank's response shard go to every prompt owner; the lane ring
    covers the response's own part. ``query_counts[j]``: real queries of CP rank j in this step."""

    def __init__(
        self,
        group,
        rank: int,
        prompt: ZigzagLayout,
        query_counts: tuple[int, ...],
        ring: Ring,
        layout: ZigzagLayout,
        prompt_kv: list,
        meter: Meter,
    ):
        self.group, self.rank, self.prompt, self.query_counts = group, rank, prompt, query_counts
        self.ring, self.layout, self.prompt_kv, self.meter = ring, layout, prompt_kv, meter

    def attend(self, layer, q, k, v, scaling):
        n = self.layout.size(self.ring.index)
        rows = q.shape[2]
        q, k, v = _real(q, n), _real(k, n), _real(v, n)
        spec = MoveQSpec(
            self.group,
            self.rank,
            self.prompt,
            self.query_counts,
            RingSpec(self.ring, self.layout, None, scaling),
            scaling,
        )
        return _padded(move_q_attention(q, k, v, self.prompt_kv[layer], spec, self.meter), rows)

    def linear_state(self, layer: int, rows: int) -> StateScan:
        """A Gated DeltaNet layer: the state scan over the lane from the prompt's final state on this rank (every
        prefill member holds it)."""
        return StateScan(layer, self.ring, self.layout, self.meter, start=self.prompt_kv[layer])
