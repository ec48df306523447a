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

Context-parallel calls (a CP prefill, RingCP's [prompt || response], a response over a lane) hand the layer a
``cp.state_scan.StateScan`` instead: the route then also gives it the layer's input (this rank's zigzag chunks
as rows), the conv's input (each row's true window, from the chunks before it on any rank) and the chunk
kernel's call (each row's true incoming state, from the scan of every chunk's affine summary), and takes the
layer's output back to the shard. The layer's own code runs in between, its kernels included. Models with
linear-attention layers outside ``SCANNED_MODEL_TYPES`` (refused at engine build anyway, ``model_check``) run
their CP plans on one device (``demote_cp_plans``, counted), and a direct ``replay`` refuses them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import cast

import torch

from augtree_verl.cp.state_scan import LinearShape, StateScan
from augtree_verl.ops.gated_delta import MIN_ROW_TOKENS
from augtree_verl.plan import Plan

# The linear-attention modules whose forward reads and writes their state through the cache protocol above
# (transformers 5.10). Other hybrids (OLMo-hybrid, MiniMax) keep theirs otherwise: refused by name.
STATE_MODULES = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet"})
# The (text) model types whose linear-attention layers are ``STATE_MODULES``: their CP plans run through the
# state scan (``cp.state_scan``); any other model with linear-attention layers runs its CP plans on one device.
SCANNED_MODEL_TYPES = frozenset({"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"})
MIN_CALL_TOKENS = MIN_ROW_TOKENS  # tokens a replay call feeds per row at least (see the module docstring)

_ROUTED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def has_linear_attention(config) -> bool:
    """Whether a model config (its text part) lists a ``linear_attention`` layer."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return "linear_attention" in (getattr(text, "layer_types", None) or ())


def _cp_limit(config) -> str | None:
    """Why ``config``'s model runs no plan of degree > 1 (None: it may): linear-attention layers outside the
    Gated DeltaNet families the state scan covers (``SCANNED_MODEL_TYPES``)."""
    if not has_linear_attention(config):
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None)
    if model_type in SCANNED_MODEL_TYPES:
        return None
    return (
        f"model {model_type!r} has linear-attention layers outside the Gated DeltaNet families whose state the "
        f"context-parallel scan passes along the ranks ({', '.join(sorted(SCANNED_MODEL_TYPES))})"
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


def linear_layers(model) -> frozenset[int]:
    """The layer indices of ``model``'s ``STATE_MODULES`` modules."""
    return frozenset(cast(int, m.layer_idx) for m in linear_attention_modules(model))


def route_linear_attention(model) -> None:
    """Route every ``STATE_MODULES`` module of ``model`` through the replay's state (idempotent, left in place;
    calls without a replay context run the layer unchanged)."""
    for module in linear_attention_modules(model):
        if module not in _ROUTED:
            _Route(module)
            _ROUTED.add(module)


class _Route:
    """One Gated DeltaNet module's route. A forward pre-hook hands the layer the call's state
    (``ctx.linear_state``): a ``StateCapture`` / ``StateStart`` as the cache, or, on a context-parallel call, a
    ``cp.state_scan.StateScan``, which also takes the layer's input (its chunks as rows), its conv input (the rows'
    true windows), its chunk kernel (the rows' true incoming states) and its output (back to the shard) while
    that call runs: the layer's ``chunk_gated_delta_rule`` and its conv (``causal_conv1d_fn`` where the layer
    has one, CUDA's causal-conv1d, else a pre-hook on ``conv1d``) are wrapped once, and pass through unchanged
    outside a scan."""

    def __init__(self, module):
        self.scan: StateScan | None = None
        self.rule = module.chunk_gated_delta_rule
        module.chunk_gated_delta_rule = self._chunk_rule
        self.conv_fn = module.causal_conv1d_fn
        if self.conv_fn is not None:
            module.causal_conv1d_fn = self._causal_conv
        else:
            module.conv1d.register_forward_pre_hook(self._conv_input)
        module.register_forward_pre_hook(self._enter, with_kwargs=True)
        module.register_forward_hook(self._leave, with_kwargs=True)

    def _enter(self, module, args, kwargs):
        self.scan = None
        ctx = kwargs.get("augtree_ctx")
        if ctx is None:
            return None
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        state = ctx.linear_state(module.layer_idx, hidden.shape[0])
        if isinstance(state, StateScan):
            self.scan = state
            rows = state.rows(hidden, _shape(module))
            if "hidden_states" in kwargs:
                kwargs = {**kwargs, "hidden_states": rows}
            else:
                args = (rows, *args[1:])
        return args, {**kwargs, "cache_params": state, "attention_mask": None}

    def _leave(self, module, args, kwargs, output):
        scan, self.scan = self.scan, None
        return scan.join(output) if scan is not None else None

    def _conv_input(self, conv, args):
        return (self.scan.conv_input(args[0]), *args[1:]) if self.scan is not None else None

    def _causal_conv(self, x, **kwargs):
        return self.conv_fn(x=self.scan.conv_input(x) if self.scan is not None else x, **kwargs)

    def _chunk_rule(self, *args, **kwargs):
        if self.scan is None:
            return self.rule(*args, **kwargs)
        return self.scan.chunk_rule(self.rule, *args, **kwargs)


def _shape(module) -> LinearShape:
    return LinearShape(
        heads=module.num_v_heads,
        key_dim=module.head_k_dim,
        value_dim=module.head_v_dim,
        conv_dim=module.conv_dim,
        kernel=module.conv_kernel_size,
    )


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
