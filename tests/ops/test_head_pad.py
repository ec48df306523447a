"""Attention whose value width D_v differs from the query/key width D_k (multi-head latent attention) through the
packed (varlen) ops, against float64 plain attention per segment: out, lse and every gradient, D_v < D_k and
D_v > D_k, causal and full, equal and ragged segments; the widening (``ops.head_pad``) copies nothing at equal
widths and the results keep their true widths."""

import pytest
import torch

from augtree_verl.ops.attention import attention_forward, varlen_attention_backward, varlen_attention_forward
from augtree_verl.ops.head_pad import kernel_width, narrow, widen
from augtree_verl.ops.segments import Segments
from tests.ops.test_attention_merge import RTOL, RTOL64, plain_attention, rel

SCALE = 0.3
CASES = [
    (Segments.uniform(3, 5, 5), True),
    (Segments.uniform(2, 4, 9), False),
    (Segments((3, 6, 1), (3, 6, 1)), True),
    (Segments((2, 7), (5, 3)), False),
]


def _float64_reference(q, k, v, dout, segments: Segments, causal: bool):
    """Per segment, plain attention in float64 with autograd: (out, lse, dq, dk, dv), packed like the inputs."""
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    outs, lses = [], []
    q0 = k0 = 0
    for nq, nk in zip(segments.q_lens, segments.k_lens):
        visible = torch.ones(nq, nk, dtype=torch.bool)
        out, lse = plain_attention(
            leaves[0][:, q0 : q0 + nq],
            leaves[1][:, k0 : k0 + nk],
            leaves[2][:, k0 : k0 + nk],
            SCALE,
            visible.tril() if causal else visible,
        )
        outs.append(out), lses.append(lse)
        q0, k0 = q0 + nq, k0 + nk
    out = torch.cat(outs, 1)
    out.backward(dout.double())
    return [out.detach(), torch.cat(lses, 1).detach(), *(x.grad for x in leaves)]


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, RTOL), (torch.float64, RTOL64)])
@pytest.mark.parametrize("dk,dv", [(12, 8), (8, 12)])
@pytest.mark.parametrize("segments,causal", CASES)
def test_varlen_value_width_matches_float64(segments, causal, dk, dv, dtype, rtol):
    g = torch.Generator().manual_seed(dk * 100 + segments.total_q)
    heads, kv_heads = 4, 2
    q = torch.randn(heads, segments.total_q, dk, generator=g, dtype=dtype)
    k = torch.randn(kv_heads, segments.total_k, dk, generator=g, dtype=dtype)
    v = torch.randn(kv_heads, segments.total_k, dv, generator=g, dtype=dtype)
    dout = torch.randn(heads, segments.total_q, dv, generator=g, dtype=dtype)
    want = _float64_reference(q, k, v, dout, segments, causal)
    out, lse = varlen_attention_forward(q, k, v, segments, causal=causal, scale=SCALE)
    grads = varlen_attention_backward(dout, q, k, v, out, lse, segments, causal=causal, scale=SCALE)
    assert [tuple(x.shape) for x in (out, *grads)] == [tuple(x.shape) for x in (dout, q, k, v)]
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want):
        assert rel(got, ref) <= rtol, (name, rel(got, ref))


def test_equal_widths_pass_through_and_unequal_qk_is_refused():
    x = torch.randn(2, 3, 8)
    assert widen(x, 8) is x and narrow(x, 8) is x
    wide = widen(x, 12)
    assert wide.shape == (2, 3, 12) and torch.equal(wide[..., :8], x) and not wide[..., 8:].any()
    assert torch.equal(narrow(wide, 8), x)
    assert kernel_width(x, x, torch.randn(2, 3, 5)) == 8 and kernel_width(x, x, wide) == 12
    with pytest.raises(ValueError, match=r"q and k of one head width.*\(2, 3, 8\).*\(2, 3, 6\)"):
        attention_forward(x, torch.randn(2, 3, 6), x, causal=True, scale=1.0)
