"""The GRPO-style loss each benchmark step backpropagates (identical for every method)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from augtree_verl.groups import Tree

ADV_EPS = 1e-6  # GRPO's std floor when normalising rewards within a group


def group_advantages(trees: Sequence[Tree], seed: int) -> list[torch.Tensor]:
    """GRPO advantages: seeded random rewards per response, normalised within each group ([G_t] per tree)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for tree in trees:
        rewards = torch.rand(len(tree.responses), generator=gen)
        std = rewards.std() if len(tree.responses) > 1 else torch.tensor(1.0)
        out.append((rewards - rewards.mean()) / (std + ADV_EPS))
    return out


def grpo_loss(trees: Sequence[Tree], seed: int):
    """``loss_fn(t, i, logp)`` of the on-policy clipped surrogate, token-mean over the whole step.

    At the first PPO epoch old log-probs equal the current ones, so the ratio exp(logp - old) is 1 with
    gradient ∂logp; the loss is -Σ_{t,i,k} ratio·A_ti / N with N the step's response tokens.
    """
    advantages = group_advantages(trees, seed)
    n_tokens = sum(sum(t.response_lens) for t in trees)

    def loss_fn(t: int, i: int, logp: torch.Tensor) -> torch.Tensor:
        ratio = torch.exp(logp - logp.detach())
        return -(ratio * advantages[t][i].to(logp.device)).sum() / n_tokens

    return loss_fn
