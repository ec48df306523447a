"""One head width at the kernel boundary, for attention whose value width D_v differs from the query/key width D_k.

Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, LongCat-Flash, Mistral 4, GLM-MoE-DSA) hands the attention
q, k [.., D_k] and v [.., D_v] (DeepSeek-V3: D_k 192, D_v 128). Every kernel the backends call (ATen's CPU flash
kernel, torch's CUDA flash ops, flash-attn) takes one width. ``ops.attention`` widens its inputs to
W = max(D_k, D_v) with zero columns right before the kernel call and narrows the results back right after, as
transformers' own flash path does:

- D_v < D_k: v, and in the backward dout and the (merged) out, gain D_k - D_v zero columns; out and dv are
  narrowed back to D_v;
- D_v > D_k: q and k gain D_v - D_k zero columns; dq and dk are narrowed back to D_k. The softmax scale is
  always passed to the kernel explicitly, so the wider q never changes it.

Exact, not approximate: a zero column adds exactly 0 to every q.k and dout.v dot product, so the scores, the
softmax, lse and the kept columns of every output are the unpadded ones; the padded out columns are exactly 0
(weights times zero values), so a merged out widened with zeros is the merged state of the widened blocks and
the backward's D_i = <dout_i, out_i> is unchanged (the padded dout columns are 0 too); the gradient columns of
the padding are discarded. K/V keep their true widths everywhere else (prompt leaves, CP messages, byte
counts). With D_v == D_k nothing is copied: the tensors pass through.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kernel_width(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """W = max(D_k, D_v) of q [.., D_k], k [.., D_k], v [.., D_v]; a ``ValueError`` where q and k differ."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention needs q and k of one head width, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    return max(q.shape[-1], v.shape[-1])


def widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [.., D] with D <= ``width`` -> [.., width], zero columns after D (x itself where D == width)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def narrow(x: torch.Tensor, width: int) -> torch.Tensor:
    """The first ``width`` columns of x [.., W] (a view; x itself where W == width)."""
    return x if x.shape[-1] == width else x[..., :width]
