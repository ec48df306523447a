"""Token-by-token sampling from a Hugging Face causal LM with its K/V cache (the CPU rollout's decoder).

vLLM's sampling parameters as verl's agent loop sends them: ``temperature`` (0 = greedy), ``top_k``
(-1 or 0 = off), ``top_p`` (1 = off). Randomness comes only from the ``torch.Generator`` passed in, so a
seeded generator gives the same tokens on every run.

``prefill`` runs a prompt once and ``decode`` samples one response from a copy of its cache, so a group's
responses share one prefill (what vLLM's prefix caching does) and give the same tokens as a prefill each. A
vision-language model's prompt comes with its ``multimodal.PromptInputs`` (image features, rope positions): the
prefill runs the vision tower once, and every decoded token gets its multimodal positions explicitly (the
model's own would come from state its last prefill left, another prompt's when prefills interleave).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import Cache

from augtree_verl.rollout.multimodal import PromptInputs, decode_positions


@dataclass(frozen=True)
class SamplingConfig:
    """One request's sampling knobs; ``max_tokens`` >= 1, ``top_p`` in (0, 1], ``temperature`` >= 0."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def _pick(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> tuple[int, float]:
    """One token from next-token logits [V]; returns (token, its log-probability under the sampling distribution)."""
    if config.temperature == 0:
        logps = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logps))
        return token, float(logps[token])
    logits = logits / config.temperature
    if config.top_k > 0:
        kth = torch.topk(logits, min(config.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= config.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    logps = torch.log_softmax(logits, dim=-1)
    token = int(torch.multinomial(logps.exp(), 1, generator=generator))
    return token, float(logps[token])


@dataclass(frozen=True)
class Prefix:
    """A prompt's prefill: its K/V cache (never written: each response decodes from a copy), the logits [V]
    of its last position (float32), which score the first response token, and the prompt's inputs beside its ids
    (None for a text model)."""

    cache: Cache
    last_logits: torch.Tensor
    inputs: PromptInputs | None = None


@torch.no_grad()
def prefill(model, prompt_ids: list[int], inputs: PromptInputs | None = None) -> Prefix:
    """Run ``prompt_ids`` (a non-empty list of ids, with their ``inputs``) through ``model`` once, keeping its
    K/V cache."""
    if not prompt_ids:
        raise ValueError("prefill needs a non-empty prompt")
    extra = {} if inputs is None else {**inputs.model_inputs, "position_ids": inputs.positions}
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True, **extra)
    return Prefix(cache=out.past_key_values, last_logits=out.logits[0, -1].float(), inputs=inputs)


@torch.no_grad()
def decode(
    model, prefix: Prefix, config: SamplingConfig, *, stop_ids: set[int], generator: torch.Generator
) -> tuple[list[int], list[float]]:
    """Sample up to ``config.max_tokens`` tokens after a prefilled prompt, from a copy of its cache.

    Transformers' caches grow in place as tokens are decoded, so each response (a branch of the prompt)
    decodes from its own deep copy and ``prefix`` stays the prompt's alone. Stops after the first token in
    ``stop_ids`` (kept in the output, as vLLM keeps EOS). Returns the response ids [R] and their
    log-probabilities [R] (float32 logits; R >= 1).
    """
    cache = copy.deepcopy(prefix.cache)
    logits = prefix.last_logits
    tokens, logps = [], []
    while True:
        token, logp = _pick(logits, config, generator)
        tokens.append(token)
        logps.append(logp)
        if token in stop_ids or len(tokens) == config.max_tokens:
            return tokens, logps
        positions = decode_positions(prefix.inputs, cache.get_seq_length())
        out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True, position_ids=positions)
        logits = out.logits[0, -1].float()
