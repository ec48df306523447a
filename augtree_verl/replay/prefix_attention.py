"""Attention of a batch of responses to one shared, fully visible prompt plus their own causal tokens.

Two blocks per query, merged exactly by log-sum-exp (docs/design.md §4): every response query of the batch
attends to the prompt K/V as one unmasked block (all B x Rq queries against P keys, no copy of the prompt
per row), and each row attends causally to its own K/V (a square diagonal block, so no mask and no
wasted work above the diagonal; all rows in one packed call of B equal segments, no per-row kernel
launch). The backward runs each block's backward with the *merged* (out, lse).

Shapes (D_k the query/key head width, D_v the value width; equal but for multi-head latent attention):
q [B, H, Rq, D_k]; k [B, H_kv, Rq, D_k], v [B, H_kv, Rq, D_v]; pk [1, H_kv, P, D_k], pv [1, H_kv, P, D_v]
-> out [B, H, Rq, D_v]. Under a trie
node the prefix is several blocks, one per node of its path (``path_causal_attention``): each is merged the
same way, and each block's backward gives its own dK/dV.
Rows are right padded: a padded query sees garbage, a real query never sees a padded key.
"""

from __future__ import annotations

import torch

from augtree_verl.ops.attention import (
    attention_backward,
    attention_forward,
    varlen_attention_backward,
    varlen_attention_forward,
)
from augtree_verl.ops.merge import accum_dtype, merge_into
from augtree_verl.ops.segments import Segments


def _packed(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> [H, B * S, D] (B consecutive segments; D any width)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[3])


class PrefixCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, *prefix):
        (b, h, rq, _), d = q.shape, v.shape[3]  # d: D_v, the width of out
        queries = _packed(q)
        out, lse = attention_forward(queries, prefix[0][0], prefix[1][0], causal=False, scale=scale)
        acc = accum_dtype(q.dtype)  # float32, float64 for float64 inputs (``merge.accum_dtype``)
        out, lse = out.to(acc).reshape(h, b * rq, d).clone(), lse.to(acc).clone()
        for pk, pv in zip(prefix[2::2], prefix[3::2]):
            merge_into(out, lse, *attention_forward(queries, pk[0], pv[0], causal=False, scale=scale))
        rows = Segments.uniform(b, rq, rq)
        own_out, own_lse = varlen_attention_forward(queries, _packed(k), _packed(v), rows, causal=True, scale=scale)
        merge_into(out, lse, own_out, own_lse)
        out, lse = out.to(q.dtype).view(h, b, rq, d), lse.view(h, b, rq)
        ctx.save_for_backward(q, k, v, out, lse, *prefix)
        ctx.scale = scale
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *prefix = ctx.saved_tensors
        (b, h, rq, _), d = q.shape, v.shape[3]
        queries, dout = _packed(q), _packed(dout)
        out, lse = out.reshape(h, b * rq, d), lse.reshape(h, b * rq)
        dq, dk, dv = varlen_attention_backward(
            dout, queries, _packed(k), _packed(v), out, lse, Segments.uniform(b, rq, rq), causal=True, scale=ctx.scale
        )
        dprefix = []
        for pk, pv in zip(prefix[0::2], prefix[1::2]):
            dq_block, dpk, dpv = attention_backward(
                dout, queries, pk[0], pv[0], out, lse, causal=False, scale=ctx.scale
            )
            dq = dq + dq_block
            dprefix += [dpk[None], dpv[None]]
        unpack = lambda x: x.reshape(x.shape[0], b, rq, x.shape[2]).transpose(0, 1)
        return unpack(dq), unpack(dk), unpack(dv), None, *dprefix


def path_causal_attention(q, k, v, prefix: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """Queries attend to every block of ``prefix`` (k [1, H_kv, P_j, D_k], v [1, H_kv, P_j, D_v] each, a trie
    path's nodes, root first; at least one) fully and to their own tokens causally."""
    return PrefixCausalAttention.apply(q, k, v, scale, *(x for block in prefix for x in block))


def prefix_causal_attention(q, k, v, pk, pv, scale: float) -> torch.Tensor:
    return path_causal_attention(q, k, v, [(pk, pv)], scale)
