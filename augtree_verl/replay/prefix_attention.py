"""Attention of a batch of responses to one shared, fully visible prompt plus their own causal tokens.

Two blocks per query, merged exactly by log-sum-exp (docs/design.md §4): every response query of the batch
attends to the prompt K/V as one unmasked block (all B x Rq queries against P keys, no copy of the prompt
per row), and each row attends causally to its own K/V (a square diagonal block, so no mask and no
wasted work above the diagonal). The backward runs each block's backward with the *merged* (out, lse).

Shapes: q [B, H, Rq, D]; k, v [B, H_kv, Rq, D]; pk, pv [1, H_kv, P, D] -> out [B, H, Rq, D].
Rows are right padded: a padded query sees garbage, a real query never sees a padded key.
"""

from __future__ import annotations

import torch

from augtree_verl.ops.attention import attention_backward, attention_forward
from augtree_verl.ops.merge import merge_into


class PrefixCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pk, pv, scale: float):
        b, h, rq, d = q.shape
        queries = q.transpose(0, 1).reshape(h, b * rq, d)
        out, lse = attention_forward(queries, pk[0], pv[0], causal=False, scale=scale)
        out, lse = out.float().view(h, b, rq, d).clone(), lse.float().view(h, b, rq).clone()
        for row in range(b):
            row_out, row_lse = attention_forward(q[row], k[row], v[row], causal=True, scale=scale)
            merge_into(out[:, row], lse[:, row], row_out, row_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, pk, pv, out, lse)
        ctx.scale = scale
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, pk, pv, out, lse = ctx.saved_tensors
        b, h, rq, d = q.shape
        dout = dout.transpose(0, 1)  # [H, B, Rq, D], like out
        flat = lambda x: x.reshape(h, b * rq, *x.shape[3:])
        dq, dpk, dpv = attention_backward(flat(dout), q.transpose(0, 1).reshape(h, b * rq, d), pk[0], pv[0],
                                          flat(out), flat(lse), causal=False, scale=ctx.scale)
        dq = dq.view(h, b, rq, d).transpose(0, 1).clone()
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        for row in range(b):
            dq_row, dk[row], dv[row] = attention_backward(dout[:, row], q[row], k[row], v[row], out[:, row],
                                                          lse[:, row], causal=True, scale=ctx.scale)
            dq[row] += dq_row
        return dq, dk, dv, dpk[None], dpv[None], None


def prefix_causal_attention(q, k, v, pk, pv, scale: float) -> torch.Tensor:
    return PrefixCausalAttention.apply(q, k, v, pk, pv, scale)
