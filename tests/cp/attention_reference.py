"""Plain single-process attention over [prefix (fully visible) ; causal sequence] with its gradients:
the oracle the attention-level CP tests compare every rank's shard with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADS, KV_HEADS, HEAD_DIM, SCALE = 4, 2, 8, 0.35
# (D_k, D_v) of the query/key and value heads: equal, and apart on both sides (multi-head latent attention)
WIDTHS = ((HEAD_DIM, HEAD_DIM), (12, 8), (8, 12))
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
    q: torch.Tensor  # [H, L, D_k]
    k: torch.Tensor  # [H_kv, L, D_k]
    v: torch.Tensor  # [H_kv, L, D_v]
    pk: torch.Tensor  # [H_kv, P, D_k]
    pv: torch.Tensor  # [H_kv, P, D_v]
    dout: torch.Tensor
    out: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dpk: torch.Tensor
    dpv: torch.Tensor


def random_heads(heads: int, n: int, dtype, g: torch.Generator, dim: int = HEAD_DIM) -> torch.Tensor:
    return torch.randn(heads, n, dim, generator=g, dtype=dtype)


def prefix_causal_reference(
    prefix_len: int, seq_len: int, dtype, seed: int, prefix_kv=None, widths=(HEAD_DIM, HEAD_DIM)
) -> Reference:
    """Random q/k/v/dout for a causal sequence of ``seq_len`` after a prefix (random, or ``prefix_kv``), with
    query/key heads of width ``widths[0]`` and value heads of width ``widths[1]``."""
    g = torch.Generator().manual_seed(seed)
    dk, dv = widths
    q, k, v = (random_heads(h, seq_len, dtype, g, d) for h, d in ((HEADS, dk), (KV_HEADS, dk), (KV_HEADS, dv)))
    dout = random_heads(HEADS, seq_len, dtype, g, dv)
    pk, pv = (
        prefix_kv
        if prefix_kv is not None
        else (random_heads(KV_HEADS, prefix_len, dtype, g, dk), random_heads(KV_HEADS, prefix_len, dtype, g, dv))
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
