"""``PromptKV``: one prompt's per-layer state between its prefill and its delayed backward, on one device or
one CP rank. Each layer's state is a pair, by layer kind (gpt-fast's one cache entry per layer):

    attention layer          (k, v)               one device [1, H_kv, P, D_k] and [1, H_kv, P, D_v], a CP rank
                                                  [H_kv, p, D_k] and [H_kv, p, D_v] (its shard; D_v the value
                                                  width, D_k but for multi-head latent attention)
    linear-attention layer   (conv, recurrent)    [1, conv_dim, K] and [1, H_v, D_k, D_v] (``linear_state``;
                                                  one device only)

    live_kv[layer]            the pair in the prompt graph
    kv[layer]                 leaves sharing their storage (training) or the live tensors (forward only)
    hidden         [n, H]     live final hidden states the delayed backward starts from (a CP rank: its whole
                              shard, so that every member reaches every ring step of the prompt graph)
    last           [H]        leaf of the hidden state at prompt position P - 1 (row ``last_row`` of
                              ``hidden``), which scores each response's first token; None where another
                              CP rank owns that position
    live_scores    [n] / [n, 2]  a trie node's scores of its own tokens, in the prompt graph (None: it scores
                              none), and ``scores``, the leaf every row through the node reads them from
Training: each leaf sums the gradients of the many response backwards in float32 (``leaf.grad_sum``)
whatever the model's dtype; ``backward()`` runs the one delayed prompt backward with those sums (zeros
where nothing flowed). A trie node's prefill attends to its ancestors' leaves, so its delayed backward adds
into theirs: descendants run theirs first (deepest first). With an ``offload`` object, the prefill forward
runs inside ``offload.saving()`` and the delayed backward inside ``offload.restoring()``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch

_HELD_LEAVES: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()  # the prompt leaves alive now

# prefill() -> (live_kv per layer, hidden [n, H], last_row or None, live scores or None)
PrefillFn = Callable[
    [], "tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, int | None, torch.Tensor | None]"
]


class PromptKV:
    """See the module docstring. ``PromptKV(prefill, train=..., offload=...)`` runs ``prefill`` at once."""

    def __init__(self, prefill: PrefillFn, *, train: bool, offload=None):
        self.train, self.offload = train, offload
        with offload.saving() if offload is not None else contextlib.nullcontext():
            self.live_kv, self.hidden, self.last_row, self.live_scores = prefill()
        if train:
            # Frozen layers leave some K/V without a graph (LoRA on q/v only, embeddings frozen); none with one
            # while the hidden states have one is reentrant checkpointing.
            if self.hidden.requires_grad and not any(x.requires_grad for kv in self.live_kv for x in kv):
                raise ValueError(
                    "the prompt K/V carry no autograd graph: reentrant activation checkpointing "
                    "(use_reentrant=True) hides them; enable checkpointing with use_reentrant=False "
                    "(transformers' default)"
                )
            self.kv = [(summing_leaf(k), summing_leaf(v)) for k, v in self.live_kv]
        else:
            self.kv = self.live_kv
        last = self.hidden[self.last_row] if self.last_row is not None else None
        self.last = summing_leaf(last) if train and last is not None else last
        scores = self.live_scores
        self.scores = summing_leaf(scores) if train and scores is not None else scores

    def backward(self) -> None:
        """The delayed prompt backward: every live K/V, the hidden states and the scores as roots, with the
        leaves' float32 sums rounded once to the live dtype (zeros where nothing flowed back)."""
        roots = [x for kv in self.live_kv for x in kv] + [self.hidden]
        grads = [_grad(x, leaf) for live, leaves in zip(self.live_kv, self.kv) for x, leaf in zip(live, leaves)]
        hidden_grad = torch.zeros_like(self.hidden)
        if self.last is not None and self.last.grad_sum is not None:
            hidden_grad[self.last_row] = self.last.grad_sum.to(self.hidden.dtype)
        grads.append(hidden_grad)
        if self.live_scores is not None:
            roots.append(self.live_scores)
            grads.append(_grad(self.live_scores, self.scores))
        live = [(root, grad) for root, grad in zip(roots, grads) if root.requires_grad]  # frozen ones: no graph
        if not live:
            return
        with self.offload.restoring() if self.offload is not None else contextlib.nullcontext():
            torch.autograd.backward([root for root, _ in live], [grad for _, grad in live])


def _grad(live: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    return leaf.grad_sum.to(live.dtype) if leaf.grad_sum is not None else torch.zeros_like(live)


def grad_sum(leaf: torch.Tensor) -> torch.Tensor | None:
    """A summing leaf's float32 gradient sum (None until a gradient arrived)."""
    return leaf.grad_sum


def set_grad_sum(leaf: torch.Tensor, value: torch.Tensor) -> None:
    """Set a summing leaf's float32 gradient sum (gradients summed elsewhere, e.g. over a CP group)."""
    leaf.grad_sum = value


def held_prompt_tensors() -> list[torch.Tensor]:
    """The device tensors in-flight prompts hold between their prefill and their delayed backward: each
    prompt leaf (K/V, last hidden state) and its float32 gradient sum, on the one-device and the CP path.
    For memory meters (``UnshardedGroups``); tensors may share storage with each other or with saved
    activations."""
    held = []
    for leaf in list(_HELD_LEAVES):
        held.append(leaf)
        if leaf.grad_sum is not None:
            held.append(leaf.grad_sum)
    return held


def summing_leaf(x: torch.Tensor) -> torch.Tensor:
    """A leaf sharing ``x``'s storage whose gradients, one per backward, are summed in float32 into
    ``leaf.grad_sum`` (None until the first): autograd's own ``.grad`` would sum them in ``x``'s dtype.
    Registered in ``held_prompt_tensors`` while alive."""
    leaf = x.detach().requires_grad_()
    leaf.grad_sum = None
    _HELD_LEAVES.add(leaf)

    def move(t: torch.Tensor) -> None:
        t.grad_sum = t.grad.float() if t.grad_sum is None else t.grad_sum.add_(t.grad)
        t.grad = None

    leaf.register_post_accumulate_grad_hook(move)
    return leaf
