"""Token-by-token sampling from a Hugging Face causal LM with its K/V cache (the CPU rollout's decoder).

vLLM's sampling parameters as verl's agent loop sends them: ``temperature`` (0 = greedy), ``top_k``
(-1 or 0 = off), ``top_p`` (1 = off). Randomness comes only from the ``torch.Generator`` passed in, so a
seeded generator gives the same tokens on every run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


@torch.no_grad()
def sample(model, prompt_ids: list[int], config: SamplingConfig, *, stop_ids: set[int],
           generator: torch.Generator) -> tuple[list[int], list[float]]:
    """Sample up to ``config.max_tokens`` tokens after ``prompt_ids`` (a non-empty list of ids).

    Stops after the first token in ``stop_ids`` (kept in the output, as vLLM keeps EOS). Returns the response
    ids [R] and their log-probabilities [R] (float32 logits; R >= 1).
    """
    if not prompt_ids:
        raise ValueError("sample needs a non-empty prompt")
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    tokens, logps = [], []
    while True:
        token, logp = _pick(out.logits[0, -1].float(), config, generator)
        tokens.append(token)
        logps.append(logp)
        if token in stop_ids or len(tokens) == config.max_tokens:
            return tokens, logps
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
