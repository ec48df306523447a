"""Log-probabilities of target tokens (the model's logits head runs only where a token is scored)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def logps_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    on_logits: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """logits [N, V], targets [N] -> float32 log-probs [N] of softmax(logits / temperature).

    ``on_logits`` sees the float32 tempered logits [N, V] (e.g. to compute an entropy).
    """
    logits = logits.float() / temperature
    if on_logits is not None:
        on_logits(logits)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


EntropyFn = Callable[[torch.Tensor], torch.Tensor]  # tempered float32 logits [N, V] -> entropy [N]

# Rows of float32 logits scored at once on CPU: [rows, V] temporaries under 16 MiB are reused from the
# allocator's heap, while glibc serves blocks over 32 MiB with fresh mmaps that page-fault on every call
# (measured: ~7% of a response-heavy replay step). CUDA's caching allocator needs no chunks. The scores do
# not depend on the chunking (every operation is row-wise).
CPU_SCORE_CHUNK_BYTES = 16 << 20


def token_scores(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy_fn: EntropyFn | None = None,
) -> torch.Tensor:
    """The replay's per-token scores, one call of ``head`` (hidden [N, H] -> the model's logits [N, V],
    ``logits.family_logits``: one LM-head call): targets [N] -> float32 log-probs [N], or [N, 2]
    (log-prob, entropy) with ``entropy_fn``. Every engine path returns and takes this shape."""
    logits = head(hidden)
    rows = max(logits.shape[0], 1)
    if logits.device.type == "cpu":
        rows = max(1, CPU_SCORE_CHUNK_BYTES // (4 * logits.shape[-1]))
    parts = [_scores(chunk, t, temperature, entropy_fn) for chunk, t in zip(logits.split(rows), targets.split(rows))]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _scores(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_fn: EntropyFn | None):
    if entropy_fn is None:
        return logps_from_logits(logits, targets, temperature)
    entropy = []
    logp = logps_from_logits(logits, targets, temperature, on_logits=lambda x: entropy.append(entropy_fn(x)))
    return torch.stack([logp, entropy[0].float()], dim=-1)
