"""Plain single-process attention over [prefix (fully visible) ; causal sequence] with its gradients:
the oracle the attention-level CP tests compare every rank's shard with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADS, KV_HEADS, HEAD_DIM, SCALE = 4, 2, 8, 0.35
# float32 CPU: the ring merges the same exponentials in another order; 1e-5 relative is ~100x eps.
RTOL = 1e-5


def rel(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    if b.numel() == 0:
        return 0.0
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item()


@dataclass
class Reference:
    q: torch.Tensor  # [H, L, D]
    k: torch.Tensor  # [H_kv, L, D]
    v: torch.Tensor
    pk: torch.Tensor  # [H_kv, P, D]
    pv: torch.Tensor
    dout: torch.Tensor
    out: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dpk: torch.Tensor
    dpv: torch.Tensor


def random_heads(heads: int, n: int, dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(heads, n, HEAD_DIM, generator=g, dtype=dtype)


def prefix_causal_reference(prefix_len: int, seq_len: int, dtype, seed: int, prefix_kv=None) -> Reference:
    """Random q/k/v/dout for a causal sequence of ``seq_len`` after a prefix (random, or ``prefix_kv``)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (random_heads(h, seq_len, dtype, g) for h in (HEADS, KV_HEADS, KV_HEADS))
    dout = random_heads(HEADS, seq_len, dtype, g)
    pk, pv = (
        prefix_kv
        if prefix_kv is not None
        else (random_heads(KV_HEADS, prefix_len, dtype, g), random_heads(KV_HEADS, prefix_len, dtype, g))
    )
    seq_len, prefix_len = q.shape[1], pk.shape[1]
    leaves = [t.clone().requires_grad_() for t in (q, k, v, pk, pv)]
    lq, lk, lv, lpk, lpv = leaves
    keys = torch.cat([lpk, lk], 1).repeat_interleave(HEADS // KV_HEADS, 0)
    vals = torch.cat([lpv, lv], 1).repeat_interleave(HEADS // KV_HEADS, 0)
    visible = torch.ones(seq_len, prefix_len + seq_len, dtype=torch.bool).tril(diagonal=prefix_len)
    scores = (lq @ keys.transpose(-1, -2) * SCALE).masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, -1) @ vals
    out.backward(dout)
    return Reference(q, k, v, pk, pv, dout, out.detach(), *(t.grad for t in leaves))
