"""The attention backends behind ops.attention: the CPU varlen path, torch's CUDA flash ops (their call and
shapes, on meta tensors: the aten ops' meta kernels), the flash-attn shim for each release (fake ops with
each release's calling convention), the backend knob and the float32 error."""

import inspect

import pytest
import torch

from augtree_verl.ops import torch_flash
from augtree_verl.ops.attention import (
    BACKEND_ENV,
    attention_backward,
    attention_forward,
    cuda_backend_name,
    varlen_attention_backward,
    varlen_attention_forward,
)
from augtree_verl.ops.flash_attn import FlashAttn, load
from augtree_verl.ops.segments import Segments
from tests.ops import fake_flash_attn

# float32 CPU: the packed call sums the same exponentials as the per-block one, in another order.
RTOL = 1e-5
# bf16 inputs: the fake kernels compute in float32 and round outputs to bf16 (8 mantissa bits, 2^-8 = 3.9e-3),
# the reference runs the CPU kernel in float32 on the same bf16-rounded inputs.
BF16_RTOL = 1e-2


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def packed_inputs(segments: Segments, heads=4, kv_heads=2, dim=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, segments.total_q, dim, generator=g).to(dtype)
    k = torch.randn(kv_heads, segments.total_k, dim, generator=g).to(dtype)
    v = torch.randn(kv_heads, segments.total_k, dim, generator=g).to(dtype)
    dout = torch.randn(heads, segments.total_q, dim, generator=g).to(dtype)
    return q, k, v, dout


def per_block(q, k, v, dout, segments, causal, scale):
    """The reference: one ops.attention call per segment, concatenated."""
    outs, lses, dqs, dks, dvs = [], [], [], [], []
    q0 = k0 = 0
    for nq, nk in zip(segments.q_lens, segments.k_lens):
        qs, ks = slice(q0, q0 + nq), slice(k0, k0 + nk)
        o, s = attention_forward(q[:, qs], k[:, ks], v[:, ks], causal=causal, scale=scale)
        gq, gk, gv = attention_backward(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], o, s, causal=causal, scale=scale)
        outs.append(o), lses.append(s), dqs.append(gq), dks.append(gk), dvs.append(gv)
        q0, k0 = q0 + nq, k0 + nk
    return [torch.cat(x, 1) for x in (outs, lses, dqs, dks, dvs)]


CASES = [
    (Segments.uniform(3, 5, 5), True),
    (Segments.uniform(3, 4, 9), False),
    (Segments((3, 6, 1), (3, 6, 1)), True),
    (Segments((2, 7), (5, 3)), False),
]


@pytest.mark.parametrize("segments,causal", CASES)
def test_cpu_varlen_equals_one_call_per_block(segments, causal):
    q, k, v, dout = packed_inputs(segments)
    want = per_block(q, k, v, dout, segments, causal, 0.3)
    out, lse = varlen_attention_forward(q, k, v, segments, causal=causal, scale=0.3)
    grads = varlen_attention_backward(dout, q, k, v, out, lse, segments, causal=causal, scale=0.3)
    for got, ref in zip((out, lse, *grads), want):
        assert got.shape == ref.shape and rel(got, ref) <= RTOL


def test_segments_validate_and_build_offsets_once():
    with pytest.raises(ValueError, match="no queries"):
        Segments((3, 0), (3, 3))
    with pytest.raises(ValueError, match="one key length"):
        Segments((3,), (3, 3))
    seg = Segments((2, 5, 1), (4, 4, 4))
    cu_q, cu_k = seg.cu_seqlens(torch.device("cpu"))
    assert cu_q.tolist() == [0, 2, 7, 8] and cu_k.tolist() == [0, 4, 8, 12] and cu_q.dtype == torch.int32
    assert seg.cu_seqlens(torch.device("cpu"))[0] is cu_q  # cached: built once per device
    q, k, v, _ = packed_inputs(Segments((2, 5), (2, 5)))
    with pytest.raises(ValueError, match="square"):
        varlen_attention_forward(q, k, v, Segments((2, 5), (5, 2)), causal=True, scale=1.0)
    with pytest.raises(ValueError, match="Segments hold"):
        varlen_attention_forward(q, k, v, Segments((3, 5), (3, 5)), causal=False, scale=1.0)


def test_torch_flash_calls_the_aten_ops_with_their_shapes():
    """On meta tensors the aten ops run their meta kernels: argument order and output shapes are checked
    (the numbers are checked by benchmarks/gpu_check.py on a GPU)."""
    seg = Segments((3, 6), (5, 7))
    q, k, v, dout = (x.to("meta") for x in packed_inputs(seg, heads=8, kv_heads=2, dtype=torch.bfloat16))
    out, lse = torch_flash.varlen_forward(q, k, v, seg, False, 0.25)
    assert out.shape == q.shape and lse.shape == (8, 9) and lse.dtype == torch.float32
    dq, dk, dv = torch_flash.varlen_backward(dout, q, k, v, out, lse, seg, False, 0.25)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("backend", [torch_flash, FlashAttn.from_module(fake_flash_attn.release("2.8"))])
def test_float32_on_a_flash_kernel_names_dtype_and_setting(backend):
    seg = Segments((3,), (3,))
    q, k, v, _ = packed_inputs(seg)
    with pytest.raises(ValueError, match=r"torch.float32.*bfloat16.*mixed_precision"):
        backend.varlen_forward(q, k, v, seg, True, 1.0)


@pytest.mark.parametrize("version", ["2.6", "2.7", "2.8"])
@pytest.mark.parametrize("segments,causal", CASES)
def test_flash_attn_shim_each_release(version, segments, causal):
    module = fake_flash_attn.release(version)
    fa = FlashAttn.from_module(module)
    if version != "2.6":  # the signature the old keyword-filtering shim read: nothing to filter by
        params = inspect.signature(module.flash_attn_interface._flash_attn_varlen_forward).parameters
        assert "softmax_scale" not in params
    q, k, v, dout = packed_inputs(segments, dtype=torch.bfloat16, seed=1)
    want = per_block(*(x.float() for x in (q, k, v, dout)), segments, causal, 0.3)
    out, lse = fa.varlen_forward(q, k, v, segments, causal, 0.3)
    grads = fa.varlen_backward(dout, q, k, v, out, lse, segments, causal, 0.3)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    for got, ref in zip((out, lse, *grads), want):
        assert got.shape == ref.shape and rel(got, ref) <= BF16_RTOL


def test_flash_attn_unknown_release_and_missing_package():
    module = fake_flash_attn.release("2.8")
    old = type(module)(__version__="2.5.9", flash_attn_interface=module.flash_attn_interface)
    with pytest.raises(ImportError, match="2.5.9 is not supported"):
        FlashAttn.from_module(old)
    with pytest.raises(ImportError, match=r"augtree-verl\[flash-attn\]"):
        load()  # flash-attn is not installed in the test environment


def test_backend_knob(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert cuda_backend_name() == "torch"
    monkeypatch.setenv(BACKEND_ENV, "flash_attn")
    assert cuda_backend_name() == "flash_attn"
    monkeypatch.setenv(BACKEND_ENV, "xformers")
    with pytest.raises(ValueError, match="AUGTREE_ATTENTION_BACKEND='xformers'"):
        cuda_backend_name()
    # CPU tensors always take the CPU kernel, whatever the knob says
    q = torch.randn(2, 3, 4)
    assert attention_forward(q, q, q, causal=True, scale=1.0)[0].shape == q.shape


def test_uniform_segments_are_memoised_with_their_offsets():
    a, b = Segments.uniform(4, 7, 7), Segments.uniform(4, 7, 7)
    assert a is b and a.cu_seqlens(torch.device("cpu"))[0] is b.cu_seqlens(torch.device("cpu"))[0]
    assert a.cu_seqlens(torch.device("cpu"))[0].tolist() == [0, 7, 14, 21, 28]
