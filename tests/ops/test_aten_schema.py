"""The private ATen ops the attention backends call bind to the installed torch's schemas (CI runs this on
torch 2.11, verl's GPU pin, and on 2.13): every call site's arguments by name, on meta tensors for the CUDA ops
(their meta kernels run without a GPU), and every private op of torch the package calls goes through
``AtenCall``."""

import re
from pathlib import Path

import pytest
import torch

from augtree_verl.ops import cpu_flash, torch_flash
from augtree_verl.ops.aten_schema import AtenCall
from augtree_verl.ops.segments import Segments

PACKAGE = Path(__file__).resolve().parents[2] / "augtree_verl"


def _inputs(device, dtype, seg, heads=8, kv_heads=2, dim=64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(heads, seg.total_q, dim, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(kv_heads, seg.total_k, dim, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(kv_heads, seg.total_k, dim, generator=g).to(device=device, dtype=dtype)
    return seg, q, k, v


def test_the_cuda_flash_calls_bind_and_run_their_meta_kernels():
    seg, q, k, v = _inputs("meta", torch.bfloat16, Segments((3, 6), (5, 7)))
    out, lse = torch_flash.varlen_forward(q, k, v, seg, True, 0.125)
    dq, dk, dv = torch_flash.varlen_backward(torch.empty_like(out), q, k, v, out, lse, seg, True, 0.125)
    assert (out.shape, lse.shape, dq.shape, dk.shape, dv.shape) == (q.shape, (8, 9), q.shape, k.shape, v.shape)
    for call in (torch_flash.FORWARD, torch_flash.BACKWARD):
        positional, keyword = call.bind(call._names)
        assert list(positional) == [a.name for a in call.op()._schema.arguments][: len(positional)]
        assert "scale" in keyword  # keyword-only in every torch release that has these ops


def test_the_cpu_flash_calls_bind_and_run():
    seg, q, k, v = _inputs("cpu", torch.float32, Segments((4, 4), (6, 6)))
    out, lse = cpu_flash.varlen_forward(q, k, v, seg, False, 0.125)
    dq, dk, dv = cpu_flash.varlen_backward(torch.ones_like(out), q, k, v, out, lse, seg, False, 0.125)
    assert (out.shape, dk.shape) == (q.shape, k.shape)
    assert cpu_flash.FORWARD._names and cpu_flash.BACKWARD._names


def test_binding_follows_the_schema_and_refuses_by_name():
    add = AtenCall("add", "Tensor")  # aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1)
    a, b = torch.ones(2), torch.full((2,), 2.0)
    assert add(other=b, self=a).tolist() == [3.0, 3.0]  # placed by name, in schema order
    assert add.bind({"self", "other", "alpha"}) == (("self", "other"), ("alpha",))
    with pytest.raises(ValueError, match=r"aten::add of torch .* requires argument 'other'"):
        AtenCall("add", "Tensor")(self=a)
    with pytest.raises(ValueError, match=r"aten::add of torch .* has no argument block_table"):
        AtenCall("add", "Tensor")(self=a, other=b, block_table=None)
    with pytest.raises(ValueError, match=r"has no ATen op aten::_no_such_op\.default"):
        AtenCall("_no_such_op")(self=a)
    with pytest.raises(ValueError, match="one AtenCall serves one call site"):
        add(self=a, other=b, alpha=2)
    # An omitted positional argument with a default moves the ones after it to keywords.
    sdpa = AtenCall("_scaled_dot_product_flash_attention_for_cpu")
    assert sdpa.bind({"query", "key", "value", "is_causal"}) == (("query", "key", "value"), ("is_causal",))


def test_every_private_op_of_torch_goes_through_aten_call():
    """A direct ``torch.ops.aten.<op>`` or ``torch._C`` call would bypass the schema binding."""
    direct = re.compile(r"torch\.ops\.aten\.\w+\s*\(|torch\.ops\.aten\.\w+\.\w+\s*\(|torch\._C\b")
    offenders = [
        f"{p.relative_to(PACKAGE)}:{i}"
        for p in PACKAGE.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if direct.search(line) and p.name != "aten_schema.py"
    ]
    assert not offenders, offenders
