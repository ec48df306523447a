"""Attention of one query block against one key/value block, returning the log-sum-exp.

One interface, two backends (docs/design.md §4): on CPU the ATen flash kernel
``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` op; on CUDA flash-attn's
varlen forward/backward, imported lazily (flash-attn has no CPU build) behind a small signature shim.
Both give the natural-log lse. Both support grouped-query attention natively (H_kv divides H).

Shapes (one sequence, batch dimension dropped):
    q [H, Sq, D], k/v [H_kv, Sk, D]  ->  out [H, Sq, D] (q's dtype), lse [H, Sq] (float32; float64 for
float64 inputs, see ``merge.accum_dtype``).
``causal=True`` means a square diagonal block (Sq == Sk, query i sees keys 0..i); the CP primitives only
ever need full blocks and square diagonal blocks, so top-left vs bottom-right alignment never differs.
Empty blocks are the caller's business: the CPU kernel crashes on zero-length inputs.
"""

from __future__ import annotations

import inspect

import torch


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_block(q, k, causal)
    if q.is_cuda:
        return _flash_attn_forward(q, k, v, causal, scale)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[None], k[None], v[None], 0.0, causal, scale=scale)
    return out[0], lse[0]


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq [H, Sq, D], dk/dv [H_kv, Sk, D], in the inputs' dtype) of one block.

    ``out`` and ``lse`` may be the *merged* state of a query over many blocks: then the result is this
    block's exact share of the merged attention's gradient (softmax weights exp(s - lse_merged), and
    D_i = <dout_i, out_merged_i>), which is how every CP primitive here runs its backward.
    """
    _check_block(q, k, causal)
    if q.is_cuda:
        return _flash_attn_backward(dout, q, k, v, out, lse, causal, scale)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout[None], q[None], k[None], v[None], out[None], lse[None], 0.0, causal, scale=scale)
    return dq[0], dk[0], dv[0]


def _check_block(q, k, causal):
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError(f"attention block with no queries or no keys (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"a causal block must be square, got {q.shape[1]} queries and {k.shape[1]} keys")


# ---- flash-attn (CUDA) --------------------------------------------------------------------------------
# flash-attn's private varlen functions are the ones that take and return lse; their keyword names drift
# between releases (window_size vs window_size_left/right, softcap, block_table; 8 vs 4 outputs), so the
# shim passes only the keywords the installed version declares.

def _flash_impl():
    try:
        from flash_attn import flash_attn_interface as fa
    except ImportError as e:  # pragma: no cover - GPU extra
        raise ImportError("CUDA tensors need flash-attn (pip install 'augtree-verl[gpu]')") from e
    return fa


def _kwargs_for(fn, **wanted):
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        wanted["window_size"] = (wanted.pop("window_size_left"), wanted.pop("window_size_right"))
    return {k: v for k, v in wanted.items() if k in params}


def _cu_seqlens(n: int, device) -> torch.Tensor:
    return torch.tensor([0, n], dtype=torch.int32, device=device)


def _flash_attn_forward(q, k, v, causal, scale):  # pragma: no cover - needs CUDA
    fa = _flash_impl()
    fn = fa._flash_attn_varlen_forward
    sq, sk = q.shape[1], k.shape[1]
    # varlen layout is [tokens, heads, D]
    q_, k_, v_ = (x.transpose(0, 1).contiguous() for x in (q, k, v))
    kwargs = _kwargs_for(fn, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1,
                         window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
                         block_table=None)
    outputs = fn(q_, k_, v_, _cu_seqlens(sq, q.device), _cu_seqlens(sk, q.device), sq, sk, **kwargs)
    out, lse = (outputs[0], outputs[5]) if len(outputs) == 8 else (outputs[0], outputs[1])
    return out.transpose(0, 1), lse.reshape(q.shape[0], -1)[:, :sq]


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):  # pragma: no cover - needs CUDA
    fa = _flash_impl()
    fn = fa._flash_attn_varlen_backward
    sq, sk = q.shape[1], k.shape[1]
    dout_, q_, k_, v_, out_ = (x.transpose(0, 1).contiguous() for x in (dout, q, k, v, out))
    dq, dk, dv = torch.empty_like(q_), torch.empty_like(k_), torch.empty_like(v_)
    kwargs = _kwargs_for(fn, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1,
                         window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
                         rng_state=None)
    fn(dout_, q_, k_, v_, out_, lse.contiguous(), dq, dk, dv, _cu_seqlens(sq, q.device),
       _cu_seqlens(sk, q.device), sq, sk, **kwargs)
    return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)
