"""Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) in the replay: a prompt's final state per
linear-attention layer, handed to every response row (docs/design.md §4).

A linear-attention layer carries no K/V: what crosses from the prompt to a continuation is, per layer,

    conv       [B, conv_dim, K]        the last K pre-conv ``mixed_qkv`` columns (left zero-padded when the
                                       prompt is shorter); the continuation reads the last K - 1 of them
    recurrent  [B, H_v, D_k, D_v]      the delta rule's final state (float32 in the torch and fla kernels)

with ``conv_dim = 2 H_k D_k + H_v D_v`` and K = ``linear_conv_kernel_dim``. The replay runs the layer's own
``forward`` (its projections, conv, gating, norm, and the kernels the module picked: flash-linear-attention's
``chunk_gated_delta_rule`` on CUDA when installed, the torch fallback otherwise) and hands it these states
through transformers' linear-attention cache protocol (``has_previous_state(layer)``,
``layers[layer].conv_states`` / ``.recurrent_states``, ``update_conv_state``, ``update_recurrent_state``):

- prefill (``StateCapture``): the layer starts from zero state and its final states are recorded, the first
  capture winning (a checkpoint recompute in the delayed backward cannot replace them), so the prompt's live
  state stays in the prompt graph like its K/V;
- replay (``StateStart``): every row starts from the prompt's state leaves, given as views expanded over the
  rows (the layer's own ``torch.cat`` and matmuls read them, never write them), and the final states the layer
  computes are dropped. Gradients of all rows sum into the leaves through the expansion.

Rows are right padded (padding after a causal recurrence changes no real position) and never packed: the
torch fallback ignores ``cu_seqlens``. A continuation of one token would take the layers' single-step path,
which updates the conv state in place, so a replay call feeds at least ``MIN_CALL_TOKENS`` tokens. The route
(``route_linear_attention``) is a forward pre-hook on each linear-attention module that swaps in the call's
cache when a replay context rides in the kwargs (``augtree_ctx``); it reads only the kwargs, so a checkpointed
layer recomputed later dispatches as its forward did. A trie node's prefill starts its linear layers from
its parent's final state the same way (a ``StateStart`` of the parent's leaves) and records its own final
state, which its children start from; a node below a root feeds at least ``MIN_CALL_TOKENS`` tokens too.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from augtree_verl.plan import Plan

# The linear-attention modules whose forward reads and writes their state through the cache protocol above
# (transformers 5.10). Other hybrids (OLMo-hybrid, MiniMax) keep theirs otherwise: refused by name.
STATE_MODULES = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet"})
MIN_CALL_TOKENS = 2  # tokens a replay call feeds per row at least (see the module docstring)

_ROUTED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def has_linear_attention(config) -> bool:
    """Whether a model config (its text part) lists a ``linear_attention`` layer."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return "linear_attention" in (getattr(text, "layer_types", None) or ())


def _cp_limit(config) -> str | None:
    """Why ``config``'s model runs no plan of degree > 1 (None: it may)."""
    if not has_linear_attention(config):
        return None
    return (
        f"model {getattr(config, 'model_type', None)!r} has linear-attention layers (Gated DeltaNet), whose "
        "state a context-parallel replay would pass along the ranks: not implemented"
    )


def demote_cp_plans(config, plans: Sequence[Plan | None]) -> tuple[list[Plan | None], int]:
    """(``plans`` with every plan of degree > 1 replaced by the one-device plan carrying its one-rank estimate
    where ``config``'s model cannot run context-parallel, how many were replaced)."""
    if _cp_limit(config) is None:
        return list(plans), 0
    out = [Plan(est_time_s=p.est_single_s) if p is not None and p.degree > 1 else p for p in plans]
    return out, sum(p is not None and p.degree > 1 for p in plans)


def refuse_cp_plans(config, plans: Sequence[Plan | None]) -> None:
    """``ValueError`` naming the first tree whose plan has degree > 1 where ``config``'s model cannot run it."""
    reason = _cp_limit(config)
    for t, plan in enumerate(plans):
        if reason is not None and plan is not None and plan.degree > 1:
            raise ValueError(
                f"tree {t}: a plan of degree {plan.degree}, but {reason}; pass a plan of degree 1 "
                "(the augtree engine demotes such plans and counts them)"
            )


def linear_attention_modules(model) -> list[torch.nn.Module]:
    """``model``'s modules of a class in ``STATE_MODULES``."""
    return [m for m in model.modules() if type(m).__name__ in STATE_MODULES]


def route_linear_attention(model) -> None:
    """Route every ``STATE_MODULES`` module of ``model`` through the replay's state (idempotent, left in place;
    calls without a replay context run the layer unchanged)."""
    for module in linear_attention_modules(model):
        if module not in _ROUTED:
            module.register_forward_pre_hook(_with_state, with_kwargs=True)
            _ROUTED.add(module)


def _with_state(module, args, kwargs):
    ctx = kwargs.get("augtree_ctx")
    if ctx is None:
        return None
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    return args, {**kwargs, "cache_params": ctx.linear_state(module.layer_idx, hidden.shape[0]), "attention_mask": None}


class StateCapture:
    """Prefill: zero initial state; the layer's final (conv, recurrent) go to ``sink[layer]`` once (None:
    dropped)."""

    def __init__(self, sink: dict[int, tuple[torch.Tensor, torch.Tensor]] | None):
        self.sink, self.conv = sink, torch.empty(0)  # set by the layer before its recurrent state

    def has_previous_state(self, layer: int | None = None) -> bool:
        return False

    def update_conv_state(self, conv: torch.Tensor, layer: int) -> None:
        self.conv = conv

    def update_recurrent_state(self, recurrent: torch.Tensor, layer: int) -> None:
        if self.sink is not None:
            self.sink.setdefault(layer, (self.conv, recurrent))


class StateStart(StateCapture):
    """Replay: ``rows`` rows start from one prompt's state (conv [1, conv_dim, K], recurrent [1, H_v, D_k, D_v]);
    the layer's updates are dropped, or, with ``sink`` (a trie node's prefill, one row), recorded as
    ``StateCapture`` records them."""

    def __init__(
        self,
        layer: int,
        state: tuple[torch.Tensor, torch.Tensor],
        rows: int,
        sink: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ):
        super().__init__(sink)
        conv, recurrent = state
        self.conv_states = conv.expand(rows, -1, -1)
        self.recurrent_states = recurrent.expand(rows, -1, -1, -1)
        self.layers = {layer: self}

    def has_previous_state(self, layer: int | None = None) -> bool:
        return True
