"""The view of verl's FSDP2-wrapped model that ``augtree_verl.replay`` runs on.

``replay`` calls the decoder (``model.get_decoder()``) and the logits head (``model.logits_head()``: the
family's forward tail on precomputed hidden states, ``replay.logits.batched_family_logits``, which calls the LM head
module) separately. Under FSDP2 that needs care, because verl shards the model as: one FSDP unit per decoder layer,
one each for ``embed_tokens`` and ``lm_head`` (untied models), and the root unit holding the rest (the final
norm; with tied embeddings also the embedding / LM head weight):

- Root parameters are only unsharded inside a call of the root module, so every decoder and LM head call
  enters through the root (its ``forward`` is swapped for the duration of the call).
- The call's arguments travel in an opaque box the root does not look into. Otherwise FSDP would register
  its post-backward hook on the LM head's input and reduce the root's gradients as soon as the LM head's
  backward ends, before the final norm's gradient exists; with nothing to hook, the root reduces in FSDP's
  end-of-backward callback, after every gradient of that backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from augtree_verl.integration.vlm import trains_vision_tower
from augtree_verl.model_shape import text_config
from augtree_verl.replay.adapters import causal_lm
from augtree_verl.replay.logits import batched_family_logits, unbatched
from augtree_verl.replay.vlm import ImagePrefill, dummy_tower, is_vlm


class _Box:
    """Arguments FSDP's root pre-forward must not see (see the module docstring)."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args, kwargs):
        self.args, self.kwargs = args, kwargs


@contextlib.contextmanager
def _root_forward(root: torch.nn.Module, target: Callable):
    """Make ``root(box)`` run ``target(*box.args, **box.kwargs)`` inside FSDP's root hooks."""
    root.forward = lambda box: target(*box.args, **box.kwargs)
    try:
        yield
    finally:
        del root.forward


class _ThroughRoot:
    def __init__(self, root: torch.nn.Module, target: Callable):
        self._root, self._target = root, target

    def __call__(self, *args, **kwargs):
        with _root_forward(self._root, self._target):
            return self._root(_Box(args, kwargs))


class FSDPReplayModel:
    """What ``replay`` reads of a causal LM, for verl's FSDP2 root module ``root``."""

    def __init__(self, root: torch.nn.Module):
        self._root = root
        self.config = text_config(root.config)  # the decoder's (a vision-language model's text config)

    @property
    def training(self) -> bool:
        return self._root.training

    def get_input_embeddings(self):
        return self._root.get_input_embeddings()

    def modules(self):
        return self._root.modules()

    def get_decoder(self):
        return _ThroughRoot(self._root, self._root.get_decoder())

    def get_output_embeddings(self):
        return _ThroughRoot(self._root, self._root.get_output_embeddings())

    def logits_head(self):
        return unbatched(_ThroughRoot(self._root, batched_family_logits(causal_lm(self._root))))

    def image_prefill(self) -> ImagePrefill | None:
        """A vision-language model's prefill with its vision tower (``replay.vlm.ImagePrefill``), through the root
        (the tower's own parameters are the root's); None for other models."""
        model = causal_lm(self._root)
        return ImagePrefill(model, route=lambda fn: _ThroughRoot(self._root, fn)) if is_vlm(model) else None

    def vision_dummy_backward(self) -> None:
        """A vision-language model's zero-weighted dummy vision forward and its backward, through the root, as
        verl's forward runs it on a text-only batch (``replay.vlm.dummy_tower``); nothing for other models or a
        frozen vision tower. Every rank calls it once per training step."""
        model = causal_lm(self._root)
        if trains_vision_tower(model):
            _ThroughRoot(self._root, dummy_tower)(model).backward()
