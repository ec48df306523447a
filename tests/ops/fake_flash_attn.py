"""Stand-ins for flash-attn 2.6 / 2.7 / 2.8 on CPU, with each release's calling convention.

The kernels are plain float32 math (``varlen_reference_forward/_backward``); what is faithful is the
interface our shim meets: 2.6's plain Python functions (``window_size`` tuple, 8 forward outputs), and
2.7/2.8's ``torch.library.custom_op`` objects (``window_size_left/right``, 4 forward outputs, dq/dk/dv
filled in place) whose ``inspect.signature`` is ``(*args, **kwargs)``. Signatures follow each release's
``flash_attn/flash_attn_interface.py``.
"""

from __future__ import annotations

import types

import torch


def _segments(cu: torch.Tensor):
    bounds = cu.tolist()
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _scores(q, k, scale, causal):
    """tokens-major q [n, H, D], k [m, H_kv, D] -> float32 scores [H, n, m] with GQA heads repeated."""
    rep = q.shape[1] // k.shape[1]
    s = torch.einsum("nhd,mhd->hnm", q.float(), k.float().repeat_interleave(rep, 1)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[1:], dtype=torch.bool).tril(), float("-inf"))
    return s, rep


def varlen_reference_forward(q, k, v, cu_q, cu_k, scale, causal):
    out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for qs, ks in zip(_segments(cu_q), _segments(cu_k)):
        s, rep = _scores(q[qs], k[ks], scale, causal)
        lse[:, qs] = torch.logsumexp(s, -1)
        values = v[ks].float().repeat_interleave(rep, 1)
        out[qs] = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), values).to(q.dtype)
    return out, lse


def varlen_reference_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, scale, causal):
    """The merged-state backward: P = exp(s - lse), dS = P (dP - rowsum(dout * out))."""
    for qs, ks in zip(_segments(cu_q), _segments(cu_k)):
        s, rep = _scores(q[qs], k[ks], scale, causal)
        p = torch.exp(s - lse[:, qs, None])
        vv = v[ks].float().repeat_interleave(rep, 1)
        dp = torch.einsum("nhd,mhd->hnm", dout[qs].float(), vv)
        delta = (dout[qs].float() * out[qs].float()).sum(-1).t()[:, :, None]
        ds = p * (dp - delta) * scale
        kk = k[ks].float().repeat_interleave(rep, 1)
        dq[qs] = torch.einsum("hnm,mhd->nhd", ds, kk).to(dq.dtype)
        heads_kv = k.shape[1]
        dk_full = torch.einsum("hnm,nhd->mhd", ds, q[qs].float())
        dv_full = torch.einsum("hnm,nhd->mhd", p, dout[qs].float())
        dk[ks] = dk_full.view(-1, heads_kv, rep, k.shape[2]).sum(2).to(dk.dtype)
        dv[ks] = dv_full.view(-1, heads_kv, rep, v.shape[2]).sum(2).to(dv.dtype)


def flash_attn_2_6():
    def _flash_attn_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
        block_table=None,
        leftpad_k=None,
        seqused_k=None,
    ):
        assert tuple(window_size) == (-1, -1) and softcap == 0.0 and dropout_p == 0.0
        out, lse = varlen_reference_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        return out, q, k, v, out, lse, None, torch.zeros(2, dtype=torch.int64)

    def _flash_attn_varlen_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        assert tuple(window_size) == (-1, -1) and softcap == 0.0 and dropout_p == 0.0
        varlen_reference_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal
        )
        return dq, dk, dv, torch.empty(0)

    return _module("2.6.3", _flash_attn_varlen_forward, _flash_attn_varlen_backward)


def _custom_op_release(version: str, namespace: str):
    @torch.library.custom_op(f"{namespace}::_flash_attn_varlen_forward", mutates_args=(), device_types="cpu")
    def _flash_attn_varlen_forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int = -1,
        window_size_right: int = -1,
        softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None,
        return_softmax: bool = False,
        block_table: torch.Tensor | None = None,
        leftpad_k: torch.Tensor | None = None,
        seqused_k: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        assert (window_size_left, window_size_right, softcap, dropout_p) == (-1, -1, 0.0, 0.0)
        out, lse = varlen_reference_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)

    @torch.library.custom_op(
        f"{namespace}::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu"
    )
    def _flash_attn_varlen_backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        softmax_lse: torch.Tensor,
        dq: torch.Tensor | None,
        dk: torch.Tensor | None,
        dv: torch.Tensor | None,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: torch.Tensor | None,
        deterministic: bool,
        rng_state: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert (window_size_left, window_size_right, softcap, dropout_p) == (-1, -1, 0.0, 0.0)
        varlen_reference_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal
        )
        return torch.empty(0)

    return _module(version, _flash_attn_varlen_forward, _flash_attn_varlen_backward)


_RELEASES = {}


def release(version: str):
    """A fake ``flash_attn`` module for one release ("2.6", "2.7", "2.8"); custom ops registered once."""
    if version not in _RELEASES:
        if version == "2.6":
            _RELEASES[version] = flash_attn_2_6()
        else:
            namespace = {"2.7": "augtree_fake_fa27", "2.8": "augtree_fake_fa28"}[version]
            _RELEASES[version] = _custom_op_release({"2.7": "2.7.4.post1", "2.8": "2.8.3"}[version], namespace)
    return _RELEASES[version]


def _module(version, fwd, bwd):
    interface = types.SimpleNamespace(_flash_attn_varlen_forward=fwd, _flash_attn_varlen_backward=bwd)
    return types.SimpleNamespace(__version__=version, flash_attn_interface=interface)
