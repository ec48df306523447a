"""The attention hook the replay runs through: a transformers ``AttentionInterface`` entry named "augtree".

During a replay the model's ``config._attn_implementation`` is "augtree" and each model call carries a
context object in its kwargs (``augtree_ctx=...``; transformers 5 hands extra kwargs to the attention
function). The context is read, never mutated, by the replay phase, so activation checkpointing may re-run
any layer. Calls without a context run the model's original implementation (see ``use_augtree_attention``).
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.nn.functional as F

from augtree_verl.model_shape import text_config
from augtree_verl.replay.linear_state import StateCapture, StateStart, route_linear_attention
from augtree_verl.replay.prefix_attention import path_causal_attention

ATTN_NAME = "augtree"


# The contexts are plain classes, not dataclasses: FSDP2's cast_forward_inputs copies dataclasses found in
# forward kwargs, which would lose the prefill capture.


class PrefillContext:
    """Phase A: causal attention over the prompt; captures each layer's state: an attention layer's post-RoPE
    K/V, a linear-attention layer's final (conv, recurrent) state (``linear_state``).

    ``kv[layer] = (k, v)``, k [1, H_kv, P, D_k] and v [1, H_kv, P, D_v], or (conv, recurrent) (shapes in
    ``linear_state``), still attached to the prompt graph. The first capture wins, so a checkpoint recompute during
    the delayed backward cannot replace it. ``path`` (a trie node below a root): its ancestors' per-layer leaves,
    root first; the node's tokens then also attend to their K/V and its linear layers start from the parent's state.
    """

    def __init__(self, path: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None):
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.path = path or []

    def attend(self, layer: int, q, k, v, scaling: float) -> torch.Tensor:
        self.kv.setdefault(layer, (k, v))
        if self.path:
            return path_causal_attention(q, k, v, [node[layer] for node in self.path], scaling)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)

    def linear_state(self, layer: int, rows: int) -> StateCapture | StateStart:
        if self.path:
            return StateStart(layer, self.path[-1][layer], rows, sink=self.kv)
        return StateCapture(self.kv)


class ResponseContext:
    """Phase B: response queries attend to [prompt K/V ; own K/V] (see ``prefix_attention``); linear-attention
    layers start from the prompt's state (``linear_state``).

    ``path[j][layer]``: the leaves that collect the gradients of one node of the prompt's path (one node: a
    tree's prompt; a trie: root first), (k [1, H_kv, P_j, D_k], v [1, H_kv, P_j, D_v]) for an attention layer
    (every node's block is attended), (conv, recurrent) for a linear-attention one (the last node's state is the
    start).
    """

    def __init__(self, path: list[list[tuple[torch.Tensor, torch.Tensor]]]):
        self.path = path

    def attend(self, layer: int, q, k, v, scaling: float) -> torch.Tensor:
        return path_causal_attention(q, k, v, [node[layer] for node in self.path], scaling)

    def linear_state(self, layer: int, rows: int) -> StateStart:
        return StateStart(layer, self.path[-1][layer], rows)


def augtree_attention_forward(module, query, key, value, attention_mask, scaling=None, augtree_ctx=None, **kwargs):
    """transformers attention signature: q [B, H, S, D_k], k [B, H_kv, S, D_k], v [B, H_kv, S, D_v]
    -> ([B, S, H, D_v], None) (D_v != D_k: multi-head latent attention, whose values transformers hands over
    unpadded to any implementation but flash attention's)."""
    if augtree_ctx is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        fallback = ALL_ATTENTION_FUNCTIONS.get(_FALLBACKS.get(id(module.config), "sdpa"), sdpa_attention_forward)
        return fallback(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    _reject_unsupported(module, kwargs)
    out = augtree_ctx.attend(module.layer_idx, query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


# kwargs transformers' attention modules pass for features the replay kernels do not implement:
# Gemma2 passes ``softcap``, gpt-oss ``s_aux`` (attention sinks); ``dropout`` is > 0 only in training mode
# with attention dropout configured; ``sliding_window`` is set on sliding layers (Mistral, Qwen2 with
# use_sliding_window, Gemma2, gpt-oss).
UNSUPPORTED_FEATURES = {
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks",
    "dropout": "attention dropout",
    "sliding_window": "sliding-window attention",
}


def _reject_unsupported(module, kwargs) -> None:
    """A ``ValueError`` naming the model, the layer and every unsupported feature this call asks for."""
    used = [
        f"{what} ({name}={_describe(kwargs[name])})"
        for name, what in UNSUPPORTED_FEATURES.items()
        if _is_set(kwargs.get(name))
    ]
    if used:
        model = getattr(module.config, "model_type", None) or type(module).__name__
        raise ValueError(
            f"model {model!r}, layer {module.layer_idx}: augtree's replay attention does not "
            f"implement {', '.join(used)}"
        )


def _is_set(value) -> bool:
    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        return True  # sinks are a parameter: present means used
    return bool(value)  # 0 / 0.0 / False: not used


def _describe(value) -> str:
    return f"tensor {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)


@functools.cache
def _register() -> None:
    """``augtree_attention_forward`` in transformers' attention interface as ATTN_NAME, once, before a model is first
    routed through it. Not at import: transformers' modeling imports take seconds, and the planner (its Ray actor
    among others) imports the replay's planning side, which imports this package, without running a model."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, augtree_attention_forward)


# The model's own attention implementation once its config routes through "augtree", by ``id(config)``
# (configs are unhashable; an entry leaves with its config). Kept off the config itself: every attribute of a
# config is written to the config.json of a saved checkpoint (``_attn_implementation`` is not).
_FALLBACKS: dict[int, str] = {}


def use_augtree_attention(model) -> None:
    """Route ``model``'s attention through "augtree", and its Gated DeltaNet layers through the replay's state
    (``linear_state.route_linear_attention``); idempotent, and left in place.

    It stays in place (no swap back and forth per call), so a checkpointed layer recomputed in any later
    backward dispatches like its original forward. Calls without a replay context run the model's original
    implementation ("eager" runs as SDPA; so does a copy of the config, which has no entry). The config
    gains no attribute: a checkpoint saved from the model carries nothing of ours.
    """
    _register()
    config = text_config(model.config)  # a vision-language model's text decoder (its vision tower keeps its own)
    if config._attn_implementation != ATTN_NAME:
        _FALLBACKS[id(config)] = config._attn_implementation
        weakref.finalize(config, _FALLBACKS.pop, id(config), None)
        config._attn_implementation = ATTN_NAME
    route_linear_attention(model)


@contextlib.contextmanager
def original_attention(model):
    """``model``'s own attention implementation for the duration (the model's ordinary forward, e.g. the
    start-up probe's reference), routed through "augtree" again after."""
    config = text_config(model.config)
    if config._attn_implementation != ATTN_NAME:
        yield
        return
    config._attn_implementation = _FALLBACKS.get(id(config), "sdpa")
    try:
        yield
    finally:
        config._attn_implementation = ATTN_NAME
