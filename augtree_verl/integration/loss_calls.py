"""verl's ``loss_function`` on verl's own micro-batches, for every loss setting verl offers.

verl's stock engine calls ``loss_function(model_output, data, dp_group)`` once per verl micro-batch (the rows,
order and padded width ``prepare_micro_batches`` gives for ``ppo_micro_batch_size_per_gpu`` or
``use_dynamic_bsz``) and backpropagates each call. The replay computes rows in its own order (a tree's responses
together, each prompt once). How the engine gives the stock engine's gradient depends on the loss:

- **Row-additive settings** (``coupling`` is None): the loss of any set of rows is the sum of its rows' terms,
  given the batch-level constants verl computes first (``batch_num_tokens``, ``global_batch_size``, ``dp_size``,
  ``loss_scale_factor``). The engine calls the loss on each replay micro-batch's rows and backpropagates it at
  once: one pass. The reported loss and metrics are verl's micro-batches' again, on the detached outputs.
- **Every other setting** (the loss couples the rows of one call, ``coupling`` says how; or a loss this module
  does not know): *scores first* (``micro_batch_adjoints``). A forward-only replay gives every row's scores;
  verl's ``loss_function`` runs once on each of verl's micro-batches with those scores as leaves (the reported
  loss and metrics are these calls'), and the gradient of each call's loss with respect to its scores is each
  token's adjoint g. The training replay then backpropagates, per replay micro-batch, the sum of g * s over its
  rows' scores s (``adjoint_loss``): d/dθ Σ g s(θ) = Σ g ds/dθ, the chain rule through verl's loss at the same
  scores, which is the stock engine's gradient to rounding. The cost is one more forward-only replay of the step
  (``augtree/loss/scores_first_s``), about a third of a training step without checkpointing.

The loss's random draws (``clip_cov`` picks tokens with ``torch.randperm``) happen in verl's calls, in verl's
micro-batch order, once per call: as in the stock engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

# verl 0.9.1's policy losses (``core_algos.get_policy_loss_fn``) whose loss matrix is a function of each row
# alone: each token's term reads its own row's log-probs (``gspo``: its row's mean ratio), aggregated by
# ``agg_loss`` with batch-level constants.
ROW_ADDITIVE_POLICY_LOSSES = frozenset({"vanilla", "gspo", "sapo", "gpg", "dppo_tv", "dppo_kl", "dro", "cispo"})
# The others, and what couples the rows of one call.
COUPLED_POLICY_LOSSES = {
    "clip_cov": "picks tokens by their covariance with the call's mean log-prob, at random (torch.randperm)",
    "kl_cov": "picks the call's top-k tokens by covariance",
    "geo_mean": "averages its sequence losses over the call's rows (torch.mean)",
    "bypass_mode": "its rollout correction may normalise or reject over the call's rows",
}
# ``sapo`` aggregates its policy loss with this mode whatever ``loss_agg_mode`` says (core_algos.py).
FIXED_POLICY_AGGREGATION = {"sapo": "seq-mean-token-mean"}


def coupling(loss_function: Callable, data: TensorDict) -> str | None:
    """None where ``loss_function`` (given verl's batch ``data``: its ``global_batch_size``) is row-additive
    (see the module docstring), else why its calls couple their rows, naming the setting."""
    bound = loss_function if isinstance(loss_function, functools.partial) else None
    config = bound.keywords.get("config") if bound is not None else None
    if bound is None or bound.func is not ppo_loss or config is None or bound.args:
        name = getattr(bound.func if bound is not None else loss_function, "__qualname__", repr(loss_function))
        return f"loss_function {name} is not verl's ppo_loss, whose row additivity this engine knows"
    mode = config.policy_loss.get("loss_mode", "vanilla")
    if mode not in ROW_ADDITIVE_POLICY_LOSSES:
        why = COUPLED_POLICY_LOSSES.get(mode, "is not a policy loss this engine knows to be row-additive")
        return f"actor.policy_loss.loss_mode={mode} {why}"
    for aggregation in dict.fromkeys((FIXED_POLICY_AGGREGATION.get(mode, config.loss_agg_mode), config.loss_agg_mode)):
        why = _aggregation_coupling(aggregation, config.loss_scale_factor, tu.get(data, "global_batch_size", None))
        if why is not None:
            return why
    return None


def _aggregation_coupling(mode: str, loss_scale_factor, global_batch_size) -> str | None:
    """``core_algos.agg_loss``: which of its modes divide by something the call's rows decide."""
    if mode in ("token-sum", "token-mean"):  # token-mean: the engine always sets the global batch_num_tokens
        return None
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        if global_batch_size is None:
            return f"actor.loss_agg_mode={mode} without a global_batch_size averages over the call's rows"
        if mode == "seq-mean-token-sum-norm" and loss_scale_factor is None:
            return (
                f"actor.loss_agg_mode={mode} with actor.loss_scale_factor=None divides by the call's padded "
                f"response width"
            )
        return None
    return f"actor.loss_agg_mode={mode} is not an aggregation this engine knows to be row-additive"


def micro_batch_adjoints(
    micro_batches: list[TensorDict],
    row_scores: list[torch.Tensor],
    model_output: Callable[[TensorDict, list[torch.Tensor]], dict],
    loss_function: Callable,
    scale: Callable[[torch.Tensor], torch.Tensor],
    dp_group,
) -> tuple[list[dict], list[torch.Tensor]]:
    """verl's ``loss_function`` on each of verl's ``micro_batches`` at the scores ``row_scores`` (per row of the
    micro-batches in order: float32 [R] log-probs, or [R, 2] with entropies), as the stock engine calls it.

    ``model_output(micro_batch, leaves)``: verl's model output of those rows' scores; ``scale(loss)``: the loss the
    engine backpropagates (its CP scale, verl's gradient scaler). Returns per micro-batch ``{"loss", "metrics"}``
    (verl's reported values) and per row the adjoint d scale(loss) / d scores, the shape of its scores.
    """
    outputs, adjoints, first = [], [], 0
    for micro_batch in micro_batches:
        leaves = [s.detach().requires_grad_() for s in row_scores[first : first + len(micro_batch)]]
        first += len(micro_batch)
        with torch.enable_grad():
            loss, metrics = loss_function(
                model_output=model_output(micro_batch, leaves), data=micro_batch, dp_group=dp_group
            )
            grads = (
                torch.autograd.grad(scale(loss), leaves, allow_unused=True)
                if loss.requires_grad
                else [None] * len(leaves)
            )
        adjoints += [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads)]
        outputs.append({"loss": loss.detach().item(), "metrics": metrics})
    return outputs, adjoints


def adjoint_loss(adjoints: Callable[[int, int], torch.Tensor]) -> Callable:
    """The replay's micro-batch loss ``loss(t, rows, scores)`` = Σ_b Σ adjoints(t, rows[b]) * scores[b]: its
    gradient is verl's loss's through the scores (the module docstring)."""
    return functools.partial(_adjoint_loss, adjoints)


def _adjoint_loss(adjoints, t: int, rows: list[int], scores: list[torch.Tensor]) -> torch.Tensor:
    return sum((adjoints(t, i) * s).sum() for i, s in zip(rows, scores))
