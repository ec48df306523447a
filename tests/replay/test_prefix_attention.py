"""``replay.prefix_attention``: right-padded response rows against a trie path's prefix blocks (fully visible) and
their own tokens (causal), merged by log-sum-exp, and its merged-state backward, against plain attention per row in
float64: output and every gradient (the prefix blocks' included), with the value width D_v equal to the query/key
width D_k and apart from it on both sides (multi-head latent attention)."""

import pytest
import torch

from augtree_verl.replay.prefix_attention import path_causal_attention
from tests.ops.test_attention_merge import RTOL, RTOL64, WIDTHS, plain_attention, rel

SCALE = 0.3
HEADS, KV_HEADS = 4, 2
PREFIX = (5, 3)  # a trie path of two nodes: root first
LENGTHS = (6, 2, 4)  # real tokens of each row; rows are right padded to the longest


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, RTOL), (torch.float64, RTOL64)])
@pytest.mark.parametrize("dk,dv", WIDTHS)
def test_rows_against_a_path_match_float64(dk, dv, dtype, rtol):
    g = torch.Generator().manual_seed(dk * 10 + dv)
    b, rq = len(LENGTHS), max(LENGTHS)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    q, k, v = rand(b, HEADS, rq, dk), rand(b, KV_HEADS, rq, dk), rand(b, KV_HEADS, rq, dv)
    prefix = [(rand(1, KV_HEADS, p, dk), rand(1, KV_HEADS, p, dv)) for p in PREFIX]
    dout = rand(b, HEADS, rq, dv)
    for row, n in enumerate(LENGTHS):
        dout[row, :, n:] = 0  # padded queries carry no gradient

    leaves = [x.to(dtype, copy=True).requires_grad_() for x in (q, k, v, *(t for block in prefix for t in block))]
    out = path_causal_attention(*leaves[:3], list(zip(leaves[3::2], leaves[4::2])), SCALE)
    out.backward(dout.to(dtype))

    ref = [x.clone().requires_grad_() for x in (q, k, v, *(t for block in prefix for t in block))]
    ref_q, ref_k, ref_v, pks, pvs = ref[0], ref[1], ref[2], ref[3::2], ref[4::2]
    p = sum(PREFIX)
    total = 0.0
    for row, n in enumerate(LENGTHS):
        keys = torch.cat([*(x[0] for x in pks), ref_k[row, :, :n]], 1)
        values = torch.cat([*(x[0] for x in pvs), ref_v[row, :, :n]], 1)
        visible = torch.ones(n, p + n, dtype=torch.bool).tril(diagonal=p)
        want, _ = plain_attention(ref_q[row, :, :n], keys, values, SCALE, visible)
        assert out.shape == (b, HEADS, rq, dv) and rel(out[row, :, :n], want) <= rtol, row
        total = total + (want * dout[row, :, :n]).sum()
    total.backward()
    for name, got, want in zip(("dq", "dk", "dv", "dpk0", "dpv0", "dpk1", "dpv1"), leaves, ref):
        assert rel(_real(got.grad), _real(want.grad)) <= rtol, (name, rel(_real(got.grad), _real(want.grad)))


def _real(grad: torch.Tensor) -> torch.Tensor:
    """A row tensor's real tokens, rows side by side [H, sum(LENGTHS), D]; a prefix block [1, H_kv, P, D] whole."""
    return grad if grad.shape[0] == 1 else torch.cat([grad[r, :, :n] for r, n in enumerate(LENGTHS)], 1)
