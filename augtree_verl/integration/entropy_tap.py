"""Entropies of the replay's LM head outputs, matched to their (tree, response).

``replay`` returns log-probs only; verl also wants the entropy of each scored position (always for old
log-probs, and in the loss when ``entropy_coeff != 0``). The tap sees every LM head output through
``FSDPReplayModel(on_logits=...)``, in the order ``replay`` scores responses: tree by tree, each tree's
responses in its token-budget micro-batches (``split_micro_batches``), row by row. Each output's log-probs
are recomputed and checked against what ``replay`` returns, so a change of that order fails loudly instead
of mislabelling entropies.
"""

from __future__ import annotations

import torch

from augtree_verl.replay import ReplayTree
from augtree_verl.replay.microbatch import split_micro_batches

# The tap recomputes log-probs with the same float32 ops as the replay, so they agree to rounding; any
# mismatch of the (tree, response) order is orders of magnitude larger.
ORDER_CHECK_RTOL = 1e-5


class EntropyTap:
    """Call with each LM head output (logits [R_i, V]); ``entropy[(t, i)]`` is float32 [R_i].

    With grad enabled the entropies stay in the graph (for the loss); ``pop`` hands one over and drops it.
    """

    def __init__(self, trees: list[ReplayTree], micro_batch_tokens: int, temperature: float):
        self._trees = trees
        self._temperature = temperature
        self._order = [(t, i) for t, tree in enumerate(trees)
                       for rows in split_micro_batches(tree.response_lens, micro_batch_tokens) for i in rows]
        self._calls = 0
        self.entropy: dict[tuple[int, int], torch.Tensor] = {}
        self._logps: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor) -> None:
        if self._calls >= len(self._order):
            raise RuntimeError(f"the replay scored more than the {len(self._order)} responses it was given")
        t, i = self._order[self._calls]
        self._calls += 1
        target = self._trees[t].responses[i]
        if logits.shape[0] != target.shape[0]:
            raise RuntimeError(f"LM head call {self._calls} has {logits.shape[0]} rows; expected tree {t} response "
                               f"{i} with {target.shape[0]} tokens (the replay's scoring order changed)")
        scaled = logits.float() / self._temperature
        lse = torch.logsumexp(scaled, dim=-1)
        # verl's entropy_from_logits: logsumexp(z) - sum(softmax(z) * z).
        self.entropy[(t, i)] = lse - (torch.softmax(scaled, dim=-1) * scaled).sum(dim=-1)
        self._logps[(t, i)] = (scaled.gather(-1, target.unsqueeze(-1)).squeeze(-1) - lse).detach()

    def check(self, t: int, i: int, logp: torch.Tensor) -> None:
        """Raise unless the tap's log-probs for (t, i) are the replay's ``logp``."""
        mine = self._logps.pop((t, i), None)
        if mine is None:
            raise RuntimeError(f"the LM head never scored tree {t} response {i}")
        logp = logp.detach()
        scale = max(logp.abs().max().item(), 1.0)
        if (mine - logp).abs().max().item() > ORDER_CHECK_RTOL * scale:
            raise RuntimeError(f"entropy of tree {t} response {i} came from another response's logits "
                               "(the replay's scoring order changed)")

    def check_all(self, logps: list[list[torch.Tensor]]) -> None:
        for t, row in enumerate(logps):
            for i, logp in enumerate(row):
                self.check(t, i, logp)

    def pop(self, t: int, i: int) -> torch.Tensor:
        return self.entropy.pop((t, i))
