"""Exact online-softmax merge of partial attention states (out, lse), accumulated in float32.

A state for a set of queries over a set of keys is (out [H, n, D_v], lse [H, n]) with natural-log lse (D_v the
value head width).
Merging the states of two disjoint key sets gives the state over their union:

    lse = log(exp(lse_a) + exp(lse_b))
    out = (exp(lse_a) out_a + exp(lse_b) out_b) / exp(lse)

written in the sigmoid/logsigmoid form of ring-flash-attn and torch's ``_SDPAMerger``, which never
exponentiates a large number:

    out = out_a - sigmoid(lse_b - lse_a) * (out_a - out_b)
    lse = lse_b - logsigmoid(lse_b - lse_a)

An empty accumulator is (0, -inf): then sigmoid(+inf) = 1 and logsigmoid(+inf) = 0, so the first merge
copies the block exactly. Blocks themselves are never empty (every query of a block sees a key), so
lse_b is always finite and no -inf - (-inf) can appear.
"""

from __future__ import annotations

import torch


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 accumulators for bf16/fp16/fp32 inputs (docs/design.md §5); float64 inputs keep float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_state(
    num_heads: int, num_queries: int, value_dim: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The state of queries that have seen no key yet: out 0 [H, n, D_v] (``value_dim``: the value head width)
    and lse -inf [H, n], in the accumulation dtype of ``like`` (the query tensor) and on its device."""
    dtype = accum_dtype(like.dtype)
    out = torch.zeros(num_heads, num_queries, value_dim, dtype=dtype, device=like.device)
    lse = torch.full((num_heads, num_queries), float("-inf"), dtype=dtype, device=like.device)
    return out, lse


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge a block state into the float32 accumulator (out [H, n, D_v], lse [H, n]) in place.

    ``out``/``lse`` may be row slices (views) of a larger accumulator; ``block_out``/``block_lse`` may be
    in any float dtype and are promoted to the accumulator's dtype before use.
    """
    block_out = block_out.to(out.dtype)
    block_lse = block_lse.to(lse.dtype)
    weight = torch.sigmoid(block_lse - lse).unsqueeze(-1)
    out.sub_(weight * (out - block_out))
    lse.copy_(block_lse - torch.nn.functional.logsigmoid(block_lse - lse))
