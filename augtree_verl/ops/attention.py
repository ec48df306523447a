"""Attention of query blocks against key/value blocks, returning the log-sum-exp: the public interface.

Backends, one per file (docs/design.md §4), all giving the natural-log lse and grouped-query attention
natively (H_kv divides H):
- CPU tensors: ``cpu_flash`` (ATen's CPU flash kernel and its backward op);
- CUDA tensors: ``torch_flash`` (torch's own FlashAttention-2 varlen ops, the default: no extra package)
  or ``flash_attn`` (the optional flash-attn package), chosen by the environment variable
  ``AUGTREE_ATTENTION_BACKEND`` = ``torch`` (default) | ``flash_attn``. Both take float16/bfloat16 only;
  float32 CUDA tensors raise a ``ValueError`` naming the dtype and the setting to change.

Shapes (one sequence, batch dimension dropped), D_k the query/key head width, D_v the value width (equal for
most models; multi-head latent attention has D_v != D_k):
    q [H, Sq, D_k], k [H_kv, Sk, D_k], v [H_kv, Sk, D_v]  ->  out [H, Sq, D_v] (q's dtype), lse [H, Sq]
(float32; float64 for float64 inputs, see ``merge.accum_dtype``). The kernels take one width: the two calls
below widen to max(D_k, D_v) with zero columns and narrow the results back (``head_pad``), the one place
this happens.
``causal=True`` means a square diagonal block (Sq == Sk, query i sees keys 0..i); the CP primitives only
ever need full blocks and square diagonal blocks, so top-left vs bottom-right alignment never differs.
Blocks are never empty (a ``ValueError`` otherwise).

``varlen_attention_forward/_backward`` run many independent blocks in one kernel call: q [H, Tq, D_k] and
k [H_kv, Tk, D_k], v [H_kv, Tk, D_v] packed along the token axis as described by a ``Segments`` (its device
offsets are made once, without a host sync; single blocks use memoised one-segment ``Segments``).
"""

from __future__ import annotations

import os

import torch

from augtree_verl.ops import cpu_flash, torch_flash
from augtree_verl.ops.head_pad import kernel_width, narrow, widen
from augtree_verl.ops.segments import Segments

BACKEND_ENV = "AUGTREE_ATTENTION_BACKEND"
CUDA_BACKENDS = ("torch", "flash_attn")


def cuda_backend_name() -> str:
    """The CUDA backend ``AUGTREE_ATTENTION_BACKEND`` selects ("torch" when unset)."""
    name = os.environ.get(BACKEND_ENV, "") or "torch"
    if name not in CUDA_BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={name!r}: expected one of {', '.join(CUDA_BACKENDS)}")
    return name


def _backend(q: torch.Tensor):
    if not q.is_cuda:
        return cpu_flash
    if cuda_backend_name() == "flash_attn":
        from augtree_verl.ops import flash_attn  # lazy: the package is optional and CUDA-only

        return flash_attn.load()
    return torch_flash


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: q [H, Sq, D_k], k [H_kv, Sk, D_k], v [H_kv, Sk, D_v] -> out [H, Sq, D_v], lse [H, Sq]."""
    _check_block(q, k, causal)
    return _forward(q, k, v, Segments.uniform(1, q.shape[1], k.shape[1]), causal, scale)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq [H, Sq, D_k], dk [H_kv, Sk, D_k], dv [H_kv, Sk, D_v], in the inputs' dtype) of one block;
    dout and out [H, Sq, D_v].

    ``out`` and ``lse`` may be the *merged* state of a query over many blocks: then the result is this
    block's exact share of the merged attention's gradient (softmax weights exp(s - lse_merged), and
    D_i = <dout_i, out_merged_i>), which is how every CP primitive here runs its backward.
    """
    _check_block(q, k, causal)
    return _backward(dout, q, k, v, out, lse, Segments.uniform(1, q.shape[1], k.shape[1]), causal, scale)


def varlen_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed q [H, Tq, D_k], k [H_kv, Tk, D_k], v [H_kv, Tk, D_v] -> out [H, Tq, D_v], lse [H, Tq]: each
    segment of ``segments`` attends only to its own keys (``causal``: every segment a square diagonal block)."""
    _check_segments(q, k, segments, causal)
    return _forward(q, k, v, segments, causal, scale)


def varlen_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    segments: Segments,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq [H, Tq, D_k], dk [H_kv, Tk, D_k], dv [H_kv, Tk, D_v] of ``varlen_attention_forward`` for the (merged)
    state (out [H, Tq, D_v], lse)."""
    _check_segments(q, k, segments, causal)
    return _backward(dout, q, k, v, out, lse, segments, causal, scale)


def _forward(q, k, v, segments: Segments, causal: bool, scale: float):
    """The kernel call: widened to one head width, the output narrowed back to D_v (``head_pad``)."""
    width = kernel_width(q, k, v)
    out, lse = _backend(q).varlen_forward(widen(q, width), widen(k, width), widen(v, width), segments, causal, scale)
    return narrow(out, v.shape[-1]), lse


def _backward(dout, q, k, v, out, lse, segments: Segments, causal: bool, scale: float):
    """The kernel call: dout and the (merged) out widened with zeros like v, dq/dk/dv narrowed back."""
    width = kernel_width(q, k, v)
    dq, dk, dv = _backend(q).varlen_backward(
        *(widen(x, width) for x in (dout, q, k, v, out)), lse, segments, causal, scale
    )
    return narrow(dq, q.shape[-1]), narrow(dk, k.shape[-1]), narrow(dv, v.shape[-1])


def _check_block(q, k, causal):
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError(f"attention block with no queries or no keys (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"a causal block must be square, got {q.shape[1]} queries and {k.shape[1]} keys")


def _check_segments(q, k, segments: Segments, causal: bool):
    segments.check(q, k)
    if causal and segments.q_lens != segments.k_lens:
        raise ValueError(f"causal segments must be square, got q_lens {segments.q_lens}, k_lens {segments.k_lens}")
