"""Log-probabilities of target tokens (the LM head runs only where a token is scored)."""

from __future__ import annotations

import torch


def logps_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [N, V], targets [N] -> float32 log-probs [N] of softmax(logits / temperature)."""
    logits = logits.float() / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_logps(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """hidden [N, H] (the state before each target), targets [N] -> float32 log-probs [N]."""
    return logps_from_logits(lm_head(hidden), targets, temperature)
