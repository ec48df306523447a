"""The model calls both tree runs (one device, CP) are made of, and the one-token dummies that pad them.

Every lock-step slot is: one prefill (a decoder call), response calls (a decoder call, an
LM-head call and, in training, a backward each) and one delayed prompt backward. A dummy prefill runs one
``PAD_ID`` token with local causal attention; a dummy response call runs one token the same way, scores it
and backpropagates a zero loss, so it reaches every FSDP unit a real call reaches (and no process group
but FSDP's).
"""

from __future__ import annotations

import torch

from augtree_verl.replay.adapters import causal_lm
from augtree_verl.replay.attention import PrefillContext
from augtree_verl.replay.linear_state import MIN_CALL_TOKENS, has_linear_attention, linear_layers
from augtree_verl.replay.logits import family_logits
from augtree_verl.replay.prompt_kv import PromptKV
from augtree_verl.replay.scoring import EntropyFn, token_scores
from augtree_verl.replay.vlm import ImagePrefill, is_vlm

PAD_ID = 0  # token of padded positions and of the lock-step dummy calls (any id of the vocabulary)


def logits_head(model):
    """hidden [N, H] -> ``model``'s own logits [N, V] (``logits.family_logits``); a wrapper that must route
    the call (``integration.fsdp_model``) gives its own through a ``logits_head()`` method."""
    own = getattr(model, "logits_head", None)
    return own() if own is not None else family_logits(causal_lm(model))


def image_prefill(model) -> ImagePrefill | None:
    """``model``'s prefill with its vision tower (``vlm.ImagePrefill``; None: not a vision-language model); a
    wrapper that must route the call (``integration.fsdp_model``) gives its own through an ``image_prefill()``
    method."""
    own = getattr(model, "image_prefill", None)
    if own is not None:
        return own()
    lm = causal_lm(model)
    return ImagePrefill(lm) if is_vlm(lm) else None


class ModelCalls:
    """``model``'s decoder and its logits head (the family's forward tail: LM head and any transform after
    it) as the tree runs call them; ``micro_batch_loss`` None: forward only."""

    def __init__(
        self, model, *, temperature: float, stats, entropy_fn: EntropyFn | None, micro_batch_loss, offload=None
    ):
        self.base, self.head, self.images = model.get_decoder(), logits_head(model), image_prefill(model)
        self.temperature, self.stats, self.entropy_fn = temperature, stats, entropy_fn
        self.loss, self.train = micro_batch_loss, micro_batch_loss is not None
        self.offload = offload if self.train else None  # forward only: no graph to keep, nothing to move
        self.device = model.get_input_embeddings().weight.device
        # tokens a response call feeds per row at least (a linear-attention layer's one-token step writes in place)
        self.min_tokens = MIN_CALL_TOKENS if has_linear_attention(model.config) else 1
        self.linear_layers = linear_layers(model)  # Gated DeltaNet layers: a state, not K/V, per prompt

    def decoder(self, ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """ids, positions [B, S] -> final hidden states [B, S, H] (attention through ``ctx``). No mask: the
        contexts carry theirs, and transformers builds none for "augtree", which registers no mask function."""
        self.stats.executed_tokens += ids.numel()
        return self.base(
            input_ids=ids, position_ids=positions, attention_mask=None, use_cache=False, augtree_ctx=ctx
        ).last_hidden_state

    def tower_decoder(self, ids: torch.Tensor, positions: torch.Tensor, tree, ctx) -> torch.Tensor:
        """``decoder`` of one prompt, ids [1, P], through the vision tower: ``tree``'s images (``groups.Tree`` with
        ``vision``), or (``tree`` None or without images) the zero-weighted dummy tower call (``vlm.dummy_tower``)."""
        self.stats.executed_tokens += ids.numel()
        if tree is not None and tree.vision is not None:
            self.stats.tower_calls += 1
        else:
            self.stats.tower_dummies += 1
        return self.images.forward(ids, positions, tree, ctx)

    def scores(self, states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """states [N, H], targets [N] -> [N] or [N, 2] (``scoring.token_scores``), one LM-head call."""
        return token_scores(self.head, states, targets, self.temperature, self.entropy_fn)

    def _pad(self) -> torch.Tensor:
        return torch.full((1, 1), PAD_ID, dtype=torch.long, device=self.device)

    def dummy_prompt(self, scored: bool = False, tower: bool = False) -> PromptKV:
        """A dummy prefill: one local token (no prompt-K/V consumer; its backward sends zeros); with ``scored``,
        one LM-head call on it too (a trie node's scores), with ``tower`` the dummy tower call (``lockstep.Shape``)."""

        def prefill():
            ctx = PrefillContext()
            pad, at = self._pad(), torch.zeros_like(self._pad())
            hidden = (self.tower_decoder(pad, at, None, ctx) if tower else self.decoder(pad, at, ctx))[0]
            scores = self.scores(hidden, self._pad()[0]) if scored else None
            return [ctx.kv[layer] for layer in range(len(ctx.kv))], hidden, None, scores

        return PromptKV(prefill, train=self.train, offload=self.offload)

    def pad_call(self) -> None:
        """A dummy response call (decoder, LM head, and in training a zero backward)."""
        hidden = self.decoder(self._pad(), torch.zeros_like(self._pad()), PrefillContext())[0]
        scores = self.scores(hidden, self._pad()[0])
        if self.train:
            (scores.sum() * 0.0).backward()
        self.stats.micro_batches += 1

    def finish_calls(self, done: int, calls: int, start) -> None:
        """After ``done`` response calls: dummy calls up to ``calls``, then the replay timer started at
        ``start`` (``ReplayStats.start_timer``) stopped."""
        for _ in range(calls - done):
            self.pad_call()
        self.stats.stop_timer("replay_s", start)

    def delayed_backward(self, prompt: PromptKV) -> None:
        """In training, the prompt's delayed backward (timed)."""
        if self.train:
            start = self.stats.start_timer(self.device)
            prompt.backward()
            self.stats.stop_timer("prompt_backward_s", start)

    def finish_slot(self, prompt: PromptKV, done: int, calls: int, start) -> None:
        """Close a slot after ``done`` response calls: ``finish_calls``, then ``delayed_backward``."""
        self.finish_calls(done, calls, start)
        self.delayed_backward(prompt)

    def backward_zero_or(self, loss, scores: list[torch.Tensor]) -> None:
        """Backpropagate ``loss``, or a zero loss over ``scores`` where it has no gradient (so that this rank's
        backwards stay in step with the others')."""
        if loss is None or not loss.requires_grad:
            loss = sum(s.sum() for s in scores) * 0.0
        loss.backward()
