"""Log-probabilities of target tokens (the LM head runs only where a token is scored)."""

from __future__ import annotations

from typing import Callable

import torch


def logps_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                      on_logits: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """logits [N, V], targets [N] -> float32 log-probs [N] of softmax(logits / temperature).

    ``on_logits`` sees the float32 tempered logits [N, V] (e.g. to compute an entropy).
    """
    logits = logits.float() / temperature
    if on_logits is not None:
        on_logits(logits)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_logps(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                on_logits: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """hidden [N, H] (the state before each target), targets [N] -> float32 log-probs [N]."""
    return logps_from_logits(lm_head(hidden), targets, temperature, on_logits)


EntropyFn = Callable[[torch.Tensor], torch.Tensor]  # tempered float32 logits [N, V] -> entropy [N]


def token_scores(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                 entropy_fn: EntropyFn | None = None) -> torch.Tensor:
    """The replay's per-token scores, one LM-head call: hidden [N, H], targets [N] -> float32 log-probs [N],
    or [N, 2] (log-prob, entropy) with ``entropy_fn``. Every engine path returns and takes this shape."""
    if entropy_fn is None:
        return token_logps(lm_head, hidden, targets, temperature)
    entropy = []
    logp = token_logps(lm_head, hidden, targets, temperature, on_logits=lambda x: entropy.append(entropy_fn(x)))
    return torch.stack([logp, entropy[0].float()], dim=-1)
