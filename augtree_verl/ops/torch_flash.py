"""CUDA backend (the default): torch's own FlashAttention-2, ``aten._flash_attention_forward/_backward``.

The variable-length form: tokens-major [T, H, D] inputs with int32 ``cu_seqlens`` (``Segments``), float32
natural-log lse [H, T]; grouped-query attention native (the backward sums dK/dV over each K/V head's
query heads). One head width D for q, k and v (``ops.attention`` widens attention whose value width differs,
``head_pad``). Ships with CUDA torch: no extra package. float16/bfloat16 only (``check_flash_dtype``).
Dropout is 0, so the backward never reads the philox seed/offset: empty ones are passed. The ops are private
and their argument lists differ between torch releases: they are called by argument name through
``AtenCall``, bound to the installed torch's schema.
"""

from __future__ import annotations

import torch

from augtree_verl.ops.aten_schema import AtenCall
from augtree_verl.ops.segments import Segments, check_flash_dtype, heads_major, tokens_major

NAME = "torch"
FORWARD = AtenCall("_flash_attention_forward")
BACKWARD = AtenCall("_flash_attention_backward")


def varlen_forward(q, k, v, segments: Segments, causal: bool, scale: float):
    """q [H, Tq, D], k/v [H_kv, Tk, D] packed by ``segments`` -> out [H, Tq, D], lse [H, Tq] (float32)."""
    check_flash_dtype(q, "torch", "the torch backend is the CUDA default")
    cu_q, cu_k = segments.cu_seqlens(q.device)
    out, lse, *_ = FORWARD(
        query=tokens_major(q),
        key=tokens_major(k),
        value=tokens_major(v),
        cum_seq_q=cu_q,
        cum_seq_k=cu_k,
        max_q=segments.max_q,
        max_k=segments.max_k,
        dropout_p=0.0,
        is_causal=causal,
        return_debug_mask=False,
        scale=scale,
    )
    return heads_major(out), lse


def varlen_backward(dout, q, k, v, out, lse, segments: Segments, causal: bool, scale: float):
    """dq [H, Tq, D], dk/dv [H_kv, Tk, D] for the (possibly merged) state (out, lse)."""
    check_flash_dtype(q, "torch", "the torch backend is the CUDA default")
    cu_q, cu_k = segments.cu_seqlens(q.device)
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = BACKWARD(
        grad_out=tokens_major(dout),
        query=tokens_major(q),
        key=tokens_major(k),
        value=tokens_major(v),
        out=tokens_major(out),
        logsumexp=lse.contiguous(),
        cum_seq_q=cu_q,
        cum_seq_k=cu_k,
        max_q=segments.max_q,
        max_k=segments.max_k,
        dropout_p=0.0,
        is_causal=causal,
        rng_state=seed,
        unused=offset,
        scale=scale,
    )
    return heads_major(dq), heads_major(dk), heads_major(dv)
