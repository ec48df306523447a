"""The affine summary of a stretch of tokens under the gated delta rule (Gated DeltaNet's recurrence), the piece
a context-parallel scan of a linear-attention layer combines (``cp.state_scan``).

Per head, with k_t l2-normalised (the layers pass ``use_qk_l2norm_in_kernel=True``), g_t <= 0 the log decay and
beta_t the write strength, the state S [D_k, D_v] after token t is

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,

affine in S_{t-1}; so over n tokens S_out = M S_in + E with M [D_k, D_k] the product of the factors and E
[D_k, D_v] the state the stretch builds from zero. ``chunk_summary`` computes (M, E) in blocks of ``CHUNK``
tokens, the block size of the chunked kernels (transformers' ``torch_chunk_gated_delta_rule``,
flash-linear-attention's ``chunk_gated_delta_rule``), by the same WY representation: in a block with
cumulative log decays G_i (G_C the block's last), L the strictly lower [C, C] matrix
L_ij = beta_i (k_i . k_j) exp(G_i - G_j) and T = (I + L)^-1,

    U = T (beta v),  W = T (beta exp(G) k),  K_d = exp(G_C - G) k,
    S' = (exp(G_C) I - K_d^T W) S + K_d^T U,

one affine map per block, folded in order. Padding a block with k = v = beta = g = 0 adds the identity, so
blocks are padded freely. Differentiable throughout (``solve_triangular``); float32 whatever the input dtype,
the dtype the kernels keep their state in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per block: the chunked kernels' block, so the summary rounds as they do
L2NORM_EPS = 1e-6  # transformers' ``l2norm`` and flash-linear-attention's, inside the kernels
STATE_DTYPE = torch.float32  # the recurrent state's dtype in the torch and fla kernels
# Tokens a Gated DeltaNet call feeds per row at least: a one-token call takes the layer's single-step path,
# which updates the conv state in place (``replay.linear_state``, ``cp.state_scan``).
MIN_ROW_TOKENS = 2


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension, as the kernels normalise q and k."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def chunk_summary(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """k [n, H, D_k], v [n, H, D_v], g and beta [n, H] (one row's real tokens, as the layer hands them to its
    kernel; ``normalize``: l2-normalise k first) -> (M [H, D_k, D_k], E [H, D_k, D_v]) in float32 with
    S_out = M S_in + E (module docstring)."""
    n, heads, dk = k.shape
    if normalize:
        k = l2norm(k)
    pad = -n % CHUNK
    k, v = (F.pad(x.to(STATE_DTYPE).transpose(0, 1), (0, 0, 0, pad)) for x in (k, v))  # [H, n + pad, D]
    g, beta = (F.pad(x.to(STATE_DTYPE).transpose(0, 1), (0, pad)) for x in (g, beta))  # [H, n + pad]
    blocks = (n + pad) // CHUNK
    k, v = k.reshape(heads, blocks, CHUNK, dk), v.reshape(heads, blocks, CHUNK, -1)
    cum, beta = g.reshape(heads, blocks, CHUNK).cumsum(-1), beta.reshape(heads, blocks, CHUNK)
    below = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=k.device).tril(-1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~below, float("-inf")).exp()
    lower = beta[..., None] * (k @ k.transpose(-1, -2)) * decay  # L [H, blocks, C, C]
    solve = lambda rhs: torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    u = solve(beta[..., None] * v)
    w = solve((beta * cum.exp())[..., None] * k)
    last = cum[..., -1:]  # G_C [H, blocks, 1]
    kd = k * (last - cum).exp()[..., None]
    eye = torch.eye(dk, dtype=STATE_DTYPE, device=k.device)
    a = last.exp()[..., None] * eye - kd.transpose(-1, -2) @ w  # [H, blocks, D_k, D_k]
    b = kd.transpose(-1, -2) @ u  # [H, blocks, D_k, D_v]
    m, e = a[:, 0], b[:, 0]
    for i in range(1, blocks):
        m, e = a[:, i] @ m, a[:, i] @ e + b[:, i]
    return m, e
