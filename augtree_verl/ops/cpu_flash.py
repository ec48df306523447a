"""CPU backend: ATen's flash kernel ``_scaled_dot_product_flash_attention_for_cpu`` and its backward op.

Natural-log lse in float32 (float64 for float64 inputs), grouped-query attention native (H_kv divides H).
The kernel takes one head width D for q, k and v: ``ops.attention`` widens attention whose value width differs
(``head_pad``) before calling here.
Packed segments of equal lengths run as one batched call; ragged ones run one call per segment (a CPU
loop over Python lengths costs no host sync). The kernel crashes on zero-length inputs: callers never
pass empty blocks (``Segments`` rejects them). Both ops are private: called by argument name through ``AtenCall``,
bound to the installed torch's schema.
"""

from __future__ import annotations

import torch

from augtree_verl.ops.aten_schema import AtenCall
from augtree_verl.ops.segments import Segments

NAME = "cpu"
FORWARD = AtenCall("_scaled_dot_product_flash_attention_for_cpu")
BACKWARD = AtenCall("_scaled_dot_product_flash_attention_for_cpu_backward")


def _forward(q, k, v, causal, scale):
    return FORWARD(query=q, key=k, value=v, dropout_p=0.0, is_causal=causal, scale=scale)


def _backward(dout, q, k, v, out, lse, causal, scale):
    return BACKWARD(
        grad_out=dout, query=q, key=k, value=v, out=out, logsumexp=lse, dropout_p=0.0, is_causal=causal, scale=scale
    )


def forward(q, k, v, causal: bool, scale: float):
    """q [H, Sq, D], k/v [H_kv, Sk, D] -> out [H, Sq, D], lse [H, Sq]."""
    out, lse = _forward(q[None], k[None], v[None], causal, scale)
    return out[0], lse[0]


def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """dq [H, Sq, D], dk/dv [H_kv, Sk, D] for the (possibly merged) state (out, lse)."""
    dq, dk, dv = _backward(dout[None], q[None], k[None], v[None], out[None], lse[None], causal, scale)
    return dq[0], dk[0], dv[0]


def _batched(x: torch.Tensor, count: int) -> torch.Tensor:
    """Packed [H, B*S, D] of B equal segments -> [B, H, S, D] (a view)."""
    return x.view(x.shape[0], count, -1, x.shape[-1]).transpose(0, 1)


def _packed(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, ...] -> packed [H, B*S, ...]."""
    return x.transpose(0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def varlen_forward(q, k, v, segments: Segments, causal: bool, scale: float):
    if segments.is_uniform:
        b = segments.count
        out, lse = _forward(_batched(q, b), _batched(k, b), _batched(v, b), causal, scale)
        return _packed(out), _packed(lse)
    parts = [forward(q[:, qs], k[:, ks], v[:, ks], causal, scale) for qs, ks in _slices(segments)]
    return torch.cat([o for o, _ in parts], 1), torch.cat([s for _, s in parts], 1)


def varlen_backward(dout, q, k, v, out, lse, segments: Segments, causal: bool, scale: float):
    if segments.is_uniform:
        b = segments.count
        lse_b = lse.view(lse.shape[0], b, -1).transpose(0, 1)
        dq, dk, dv = _backward(
            _batched(dout, b), _batched(q, b), _batched(k, b), _batched(v, b), _batched(out, b), lse_b, causal, scale
        )
        return _packed(dq), _packed(dk), _packed(dv)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for qs, ks in _slices(segments):
        dq[:, qs], dk[:, ks], dv[:, ks] = backward(
            dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, qs], causal, scale
        )
    return dq, dk, dv


def _slices(segments: Segments):
    q0 = k0 = 0
    for nq, nk in zip(segments.q_lens, segments.k_lens):
        yield slice(q0, q0 + nq), slice(k0, k0 + nk)
        q0, k0 = q0 + nq, k0 + nk
