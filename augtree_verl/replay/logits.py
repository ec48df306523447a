"""The model's own logits on hidden states the replay already computed: the family's ``*ForCausalLM.forward``
run with its decoder answering the precomputed states.

A family's forward does more than ``lm_head(hidden)`` between the decoder and the logits it returns
(Granite divides by ``logits_scaling``, Cohere multiplies by ``logit_scale``, Gemma2/3 soft-cap with
``final_logit_softcapping``; a later release may add more). The replay scores exactly what that code
returns, without a per-family list: ``family_logits(model)`` calls the class's own ``forward`` with the
decoder module (``model.get_decoder()``) answering the given states instead of running its layers, so the
family's head and every transform after it run once, on the scored rows only (``logits_to_keep=0``: all
rows given, which are exactly the scored ones). The LM head is called as the module it is (its hooks run:
FSDP2's unshard, a test's forward hook), tied embeddings included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import torch

from augtree_verl.replay.vlm import is_vlm


@functools.cache
def _decoder_output() -> type:
    """The decoder output class: every field a family's forward may read of its decoder's output, the MoE ones
    (router_logits None: no auxiliary loss) and, for decoders that can cross-attend (GPT-2, GPT-BigCode, BioGPT),
    cross_attentions. Made on first use: the planner imports this package without running a model, and
    transformers' imports take seconds (its Ray actor's start)."""
    from transformers.modeling_outputs import MoeModelOutputWithPast

    @dataclasses.dataclass
    class DecoderOutput(MoeModelOutputWithPast):
        cross_attentions: tuple[torch.Tensor, ...] | None = None

    return DecoderOutput


@contextlib.contextmanager
def _decoder_answers(decoder: torch.nn.Module, hidden: torch.Tensor):
    """``decoder(...)`` returns ``hidden`` as its last hidden state (an instance ``forward`` for the call)."""
    output = _decoder_output()
    decoder.forward = lambda *args, **kwargs: output(last_hidden_state=hidden)
    try:
        yield
    finally:
        del decoder.forward


def batched_family_logits(causal_lm: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden [1, N, H] (final hidden states, after the decoder's last norm) -> logits [1, N, V], as
    ``causal_lm``'s class forward returns them. ``causal_lm``: a transformers ``*ForCausalLM`` (its
    ``forward`` is read from the class, so an instance-level swap, e.g. FSDP's root call, does not matter), or a
    vision-language model of ``vlm.VLMS``, whose forward's tail is its LM head alone (called as the module)."""
    if is_vlm(causal_lm):
        return causal_lm.get_output_embeddings()
    forward, decoder = type(causal_lm).forward, causal_lm.get_decoder()

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        with _decoder_answers(decoder, hidden):
            return forward(causal_lm, input_ids=None, use_cache=False, logits_to_keep=0, return_dict=True).logits

    return logits


def family_logits(causal_lm: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden [N, H] -> logits [N, V] (``batched_family_logits`` on one row)."""
    return unbatched(batched_family_logits(causal_lm))


def unbatched(batched: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """[1, N, H] -> [1, N, V] as [N, H] -> [N, V]. Squeezed, not indexed: the backward of an index allocates a
    zero-filled [1, N, V] and copies into it. The squeeze is outside ``batched``, so a module that wraps it
    (FSDP2's root) returns the logits themselves, not a view of them (an in-place op on a returned view would
    skip FSDP's pre-backward hook, and FSDP warns of it)."""
    return lambda hidden: batched(hidden[None]).squeeze(0)
