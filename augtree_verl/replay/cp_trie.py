"""A trie whose root runs context-parallel (docs/design.md §9): a long shared prefix (a batch-wide system
prompt, a prompt under several uids, the turns a branching trajectory shares) prefilled once over a subgroup
of d ranks, its K/V serving every subtree.

On every member of the subgroup, in the same lock-step slot (phase d's trie slots, ``replay.lockstep``):

  A. the root's tokens run through the ring prefill (RingCP's, ``cp.context.RingContext``): each member
     holds its zigzag shard's K/V as a ``PromptKV``;
  B. the shards are all-gathered (one padded ``all_gather`` per attention layer and K/V), so every member holds
     the root's whole K/V as summing leaves, as one device would, and the root's last hidden state (a
     zero-filled float32 all-reduce from its owner); a hybrid's Gated DeltaNet layers need no gather: the
     prefill's state scan (``cp.state_scan``) left the root's final (conv window, state) on every member;
  C. the member replays its share of the root's children (``cp_trie_schedule``: the root's leaf micro-batches
     and inner subtrees, dealt longest first) on one device against those leaves (``TrieRun``), padded to the
     slot's shape, the union of every member's (``slot.shape``);
  D. the leaves' float32 gradient sums are reduce-scattered back to the shards' owners (one
     ``all_to_all_single`` per attention layer and K/V, summed in member order; the last state's by an
     all-reduce; a linear layer's state keeps each member's partial sum, which the scan's backward sums at the
     owners), and the ring prefill's delayed backward runs on every member.

Exact: every row runs on one member, and the root's gradients are the sums of every member's adjoints.
Bytes each member sends: ``trie_root_bytes``.

The root must score nothing and end no row (``cp_trie_schedule.cp_trie_refusal``); the step plan runs such
a trie on one device, counted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from augtree_verl.cp.bytes import AttentionShape
from augtree_verl.cp.comm import Meter, Ring, nbytes
from augtree_verl.cp.layout import ZigzagLayout
from augtree_verl.cp.ring import RingSpec, ring_bytes
from augtree_verl.cp.schedule import CPPrefill
from augtree_verl.replay.cp_tree import CPTreeRun
from augtree_verl.replay.lockstep import CPTrieSlot
from augtree_verl.replay.prompt_kv import PromptKV, grad_sum, set_grad_sum, summing_leaf
from augtree_verl.replay.stats import TRIE_ROOT
from augtree_verl.replay.tree_run import Path, TrieRun


def trie_root_bytes(
    length: int,
    degree: int,
    member: int,
    shape: AttentionShape,
    hidden: int,
    *,
    train: bool = True,
    forward_runs: int = 1,
) -> dict[str, int]:
    """Bytes ``member`` sends for a root of ``length`` tokens over ``degree`` members ({"fwd", "bwd"}): the ring
    prefill's (``cp.ring.ring_bytes`` per attention layer, ``cp.state_scan.scan_bytes`` per linear-attention
    layer; ``forward_runs`` 2 where activation checkpointing re-runs it), the padded all-gather of each
    attention layer's K/V (shards of at most n_max tokens: (d - 1) n_max H_kv (D_k + D_v) elements at the K/V
    dtype), its float32 return (the same count, 4 bytes each), and the last hidden state's two float32 [hidden]
    all-reduces ((d - 1) hidden 4 bytes each, counted as one ring pass)."""
    layout = ZigzagLayout(length, degree)
    ring = ring_bytes(
        RingSpec(Ring(None, tuple(range(degree)), member), layout, None, 1.0),
        shape.kv_heads,
        shape.head_dim,
        shape.value_dim,
        shape.element_size,
    )
    gathered = (degree - 1) * max(layout.sizes()) * shape.kv_heads * (shape.head_dim + shape.value_dim)
    last = (degree - 1) * hidden * 4
    scan = shape.scan_bytes(layout, member)
    return {
        "fwd": shape.layers * (forward_runs * ring["fwd"] + gathered * shape.element_size)
        + forward_runs * scan["fwd"]
        + last,
        "bwd": shape.layers * (ring["bwd"] + gathered * 4) + scan["bwd"] + last if train else 0,
    }


class _GatheredRoot:
    """The root's whole K/V on this member of ``group`` (the subgroup, its ranks the ``layout``'s parts), as a
    trie path entry (``kv``, ``last``, ``scores``): one-device tensors k [1, H_kv, P, D_k], v [1, H_kv, P, D_v]
    and [H] built from the members' shards of ``shard`` (training: float32-summing leaves); the layers in
    ``linear`` (Gated DeltaNet) keep the shard's own (conv, recurrent) leaves, the root's whole final state."""

    def __init__(self, shard: PromptKV, layout: ZigzagLayout, group, meter: Meter, linear: frozenset[int]):
        self.shard, self.layout, self.group, self.meter, self.linear = shard, layout, group, meter, linear
        self.degree, self.n_max = layout.parts, max(layout.sizes())
        self.positions = [layout.positions(m, device=shard.hidden.device) for m in range(layout.parts)]
        self.kv = [self._whole(layer, k, v) for layer, (k, v) in enumerate(shard.kv)]
        # the last hidden state, from its owner: a zero-filled float32 sum (exact: one member holds it)
        last = shard.hidden.new_zeros(shard.hidden.shape[-1], dtype=torch.float32)
        if shard.last is not None:
            last += shard.last.detach()
        self._all_reduce(last, "fwd")
        last = last.to(shard.hidden.dtype)
        self.last = summing_leaf(last) if shard.train else last
        self.scores = None

    def _whole(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's path entry: an attention layer's gathered K/V (training: summing leaves), a linear
        layer's shard leaves as they are."""
        if layer in self.linear:
            return k, v
        k, v = self._gather(k), self._gather(v)
        return (summing_leaf(k), summing_leaf(v)) if self.shard.train else (k, v)

    def _all_reduce(self, x: torch.Tensor, direction: str) -> None:
        self.meter.add(direction, nbytes(x) * (self.degree - 1))
        dist.all_reduce(x, group=self.group)

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        """This member's [H_kv, n, D] shard (D: D_k for K, D_v for V) -> the whole [1, H_kv, P, D], every member's at
        its positions."""
        shard = shard.detach()
        padded = shard.new_zeros(shard.shape[0], self.n_max, shard.shape[2])
        padded[:, : shard.shape[1]] = shard
        parts = [torch.empty_like(padded) for _ in range(self.degree)]
        self.meter.add("fwd", nbytes(padded) * (self.degree - 1))
        dist.all_gather(parts, padded, group=self.group)
        full = shard.new_empty(shard.shape[0], self.layout.length, shard.shape[2])
        for part, pos in zip(parts, self.positions):
            full[:, pos] = part[:, : pos.numel()]
        return full[None]

    def return_gradients(self) -> None:
        """Every member's float32 sums of the whole K/V's and the last state's gradients, summed into the
        shard's leaves of their owners (one ``all_to_all_single`` per layer and K/V, one all-reduce)."""
        for layer, (whole, own) in enumerate(zip(self.kv, self.shard.kv)):
            if layer in self.linear:  # the shard's own leaves: their sums are in place
                continue
            for leaf, shard in zip(whole, own):
                set_grad_sum(shard, self._scatter(grad_sum(leaf), shard))
        last = grad_sum(self.last)
        if last is None:
            last = torch.zeros_like(self.last, dtype=torch.float32)
        self._all_reduce(last, "bwd")
        if self.shard.last is not None:
            set_grad_sum(self.shard.last, last)

    def _scatter(self, grad: torch.Tensor | None, shard: torch.Tensor) -> torch.Tensor:
        """[1, H_kv, P, D] float32 sums (None: zeros) -> the sum over members of my rows, [H_kv, n, D] (D: the
        width of ``shard``, D_k for K, D_v for V)."""
        heads, dim = shard.shape[0], shard.shape[2]
        send = shard.new_zeros(self.degree, heads, self.n_max, dim, dtype=torch.float32)
        if grad is not None:
            for m, pos in enumerate(self.positions):
                send[m, :, : pos.numel()] = grad[0][:, pos]
        recv = torch.empty_like(send)
        self.meter.add("bwd", nbytes(send[0]) * (self.degree - 1))
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.sum(0)[:, : shard.shape[1]]


class CPTrieRun:
    """The trie slots with a context-parallel root of one ``replay`` call on this rank: the root's ring prefill
    through ``ring`` (the call's ``CPTreeRun`` of the slots' degree, on its subgroup), its subtrees through
    ``tries`` (the call's ``TrieRun``)."""

    def __init__(self, tries: TrieRun, ring: CPTreeRun):
        self.tries, self.ring, self.group = tries, ring, ring.group

    def __call__(self, slot: CPTrieSlot) -> None:
        calls, root, share = self.tries.calls, slot.node, slot.share
        stats = calls.stats
        layout = ZigzagLayout(root.length, share.degree)
        prefill = CPPrefill(tuple(range(share.degree)), layout)
        meter = Meter(stats, TRIE_ROOT)
        start = stats.start_timer(calls.device)
        shard = PromptKV(
            lambda: self.ring.prefill(root.tokens, prefill, share.member, meter),
            train=calls.train,
            offload=calls.offload,
        )
        gathered = _GatheredRoot(shard, layout, self.group, meter, calls.linear_layers)
        stats.stop_timer("prefill_s", start)
        stats.nodes += share.member == 0  # one prefill of the root, over the members
        path: Path = [(root, gathered)]
        start = stats.start_timer(calls.device)
        for b in share.batches:
            self.tries.leaves(root, [root.leaves[k] for k in root.micro_batches[b]], path)
            stats.micro_batches += 1
        calls.finish_calls(len(share.batches), slot.shape.calls, start)
        inner = [root.inner[j] for j in share.inner]
        for j, child in enumerate(slot.shape.children):
            self.tries.node(inner[j] if j < len(inner) else None, child, path)
        if calls.train:
            gathered.return_gradients()
        calls.delayed_backward(shard)
