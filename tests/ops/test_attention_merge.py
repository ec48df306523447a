"""ops.attention + ops.merge: blockwise attention merged with the online softmax equals plain attention (float64),
with the value head width D_v equal to the query/key width D_k and apart from it on both sides (multi-head latent
attention: the kernels run widened to max(D_k, D_v), ``ops.head_pad``)."""

import pytest
import torch

from augtree_verl.ops.attention import attention_backward, attention_forward
from augtree_verl.ops.merge import accum_dtype, empty_state, merge_into

# float32 CPU: blockwise attention sums the same exponentials in another order; 1e-5 relative is ~100x eps.
RTOL = 1e-5
# float64 shows the merge is exact math, not a tolerance hiding a bug: only rounding at 1e-12 remains.
RTOL64 = 1e-12


# (D_k, D_v): equal widths; D_v < D_k (DeepSeek-V3's 192 / 128, shrunk); D_v > D_k
WIDTHS = [(16, 16), (12, 8), (8, 12)]


def plain_attention(q, k, v, scale, visible):
    """Reference: softmax(q k^T * scale, masked) v with GQA heads repeated; visible [Sq, Sk] bool;
    q [H, Sq, D_k], k [H_kv, Sk, D_k], v [H_kv, Sk, D_v] -> out [H, Sq, D_v], lse [H, Sq]."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def rel(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, RTOL), (torch.float64, RTOL64)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("dk,dv", WIDTHS)
def test_single_block_matches_plain_attention(dtype, rtol, heads, kv_heads, dk, dv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(heads, 7, dk, generator=g, dtype=dtype)
    k = torch.randn(kv_heads, 7, dk, generator=g, dtype=dtype)
    v = torch.randn(kv_heads, 7, dv, generator=g, dtype=dtype)
    for causal in (False, True):
        visible = torch.ones(7, 7, dtype=torch.bool)
        if causal:
            visible = visible.tril()
        out, lse = attention_forward(q, k, v, causal=causal, scale=0.25)
        ref_out, ref_lse = plain_attention(q.double(), k.double(), v.double(), 0.25, visible)
        assert out.dtype == dtype and lse.dtype == accum_dtype(dtype) and lse.shape == (heads, 7)
        assert out.shape == (heads, 7, dv)
        assert rel(out, ref_out) <= rtol
        assert rel(lse, ref_lse) <= rtol


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, RTOL), (torch.float64, RTOL64)])
@pytest.mark.parametrize("dk,dv", WIDTHS)
def test_blockwise_merge_and_backward_equal_plain_attention(dtype, rtol, dk, dv):
    """Queries [prefix 5 ; 3 chunks of a causal sequence] split into full + diagonal blocks, merged in an
    arbitrary order; per-block backward with the merged (out, lse) sums to the plain gradients (float64).
    With D_v != D_k each block's backward widens the merged out [H, n, D_v] with zeros (``ops.head_pad``)."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, prefix, chunks = 4, 2, 5, [3, 4, 2]
    n = sum(chunks)
    q = torch.randn(heads, n, dk, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(kv_heads, prefix + n, dk, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(kv_heads, prefix + n, dv, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(heads, n, dv, generator=g, dtype=torch.float64)
    visible = torch.ones(n, prefix + n, dtype=torch.bool).tril(diagonal=prefix)
    ref_out, ref_lse = plain_attention(q, k, v, 0.3, visible)
    ref_out.backward(dout)
    dout = dout.to(dtype)

    starts = [sum(chunks[:c]) for c in range(len(chunks))]
    blocks = []  # (query rows, key cols, causal)
    for c, (s, ln) in enumerate(zip(starts, chunks)):
        blocks.append((slice(s, s + ln), slice(0, prefix), False))
        blocks.append((slice(s, s + ln), slice(prefix + s, prefix + s + ln), True))
        for c2 in range(c):
            blocks.append((slice(s, s + ln), slice(prefix + starts[c2], prefix + starts[c2] + chunks[c2]), False))
    blocks = blocks[::-1]  # merge order must not matter
    qd, kd, vd = (x.detach().to(dtype) for x in (q, k, v))
    out, lse = empty_state(heads, n, dv, qd)
    for rows, cols, causal in blocks:
        bo, bl = attention_forward(qd[:, rows], kd[:, cols], vd[:, cols], causal=causal, scale=0.3)
        merge_into(out[:, rows], lse[:, rows], bo, bl)
    assert out.shape == (heads, n, dv) and rel(out.to(dtype), ref_out) <= rtol
    assert rel(lse, ref_lse) <= rtol

    merged_out = out.to(dtype)
    gq, gk, gv = torch.zeros_like(qd), torch.zeros_like(kd), torch.zeros_like(vd)
    for rows, cols, causal in blocks:
        bq, bk, bv = attention_backward(
            dout[:, rows],
            qd[:, rows],
            kd[:, cols],
            vd[:, cols],
            merged_out[:, rows],
            lse[:, rows],
            causal=causal,
            scale=0.3,
        )
        gq[:, rows] += bq
        gk[:, cols] += bk
        gv[:, cols] += bv
    assert rel(gq, q.grad) <= rtol
    assert rel(gk, k.grad) <= rtol
    assert rel(gv, v.grad) <= rtol


def test_bad_blocks_raise():
    q = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="square"):
        attention_forward(q, torch.randn(2, 4, 4), torch.randn(2, 4, 4), causal=True, scale=1.0)
    with pytest.raises(ValueError, match="no queries"):
        attention_forward(q[:, :0], torch.randn(2, 4, 4), torch.randn(2, 4, 4), causal=False, scale=1.0)
