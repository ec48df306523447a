"""``ops.gated_delta.chunk_summary`` against transformers' chunked gated delta rule (the torch fallback the
Gated DeltaNet layers run on CPU): from any incoming state S_in, M S_in + E is the kernel's final state, and
its gradients with respect to k, v, g, beta and S_in are the kernel's, over stretches shorter than, equal to
and longer than the 64-token block, with more value than key width."""

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from augtree_verl.ops.gated_delta import chunk_summary
from tests.parity import RTOL, rel_err

HEADS, KEY_DIM, VALUE_DIM = 3, 8, 6


def _inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, HEADS, KEY_DIM, generator=g)
    v = torch.randn(n, HEADS, VALUE_DIM, generator=g)
    decay = -0.3 * torch.rand(n, HEADS, generator=g)  # log decay, as -A softplus(a + dt_bias)
    beta = torch.rand(n, HEADS, generator=g)
    start = torch.randn(HEADS, KEY_DIM, VALUE_DIM, generator=g)
    return [x.requires_grad_() for x in (k, v, decay, beta, start)]


@pytest.mark.parametrize("n", [1, 3, 64, 65, 150])
def test_summary_is_the_kernels_state_map(n):
    k, v, decay, beta, start = _inputs(n, seed=n)
    m, e = chunk_summary(k, v, decay, beta, normalize=True)
    assert m.shape == (HEADS, KEY_DIM, KEY_DIM) and e.shape == (HEADS, KEY_DIM, VALUE_DIM)
    got = m @ start + e
    q = torch.randn(1, n, HEADS, KEY_DIM)
    _, want = torch_chunk_gated_delta_rule(
        q,
        k[None],
        v[None],
        g=decay[None],
        beta=beta[None],
        initial_state=start[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert rel_err(got, want[0]) <= RTOL
    seed = torch.randn(HEADS, KEY_DIM, VALUE_DIM, generator=torch.Generator().manual_seed(0))
    inputs = (k, v, decay, beta, start)
    mine = torch.autograd.grad(got, inputs, seed)
    theirs = torch.autograd.grad(want[0], inputs, seed)
    for name, a, b in zip(("k", "v", "g", "beta", "S_in"), mine, theirs):
        assert rel_err(a, b) <= RTOL, (name, rel_err(a, b))
