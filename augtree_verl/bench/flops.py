"""FLOP counts of the two schedules, for the ideal speedup of prompt reuse over the flattened baseline.

Forward FLOPs of a decoder-only transformer with L layers, hidden h, q heads n_q, K/V heads n_kv, head dim d,
MLP width I (gated: 3 matrices) and vocabulary V:
  per token through the stack:   L · 2 · (h·n_q·d + 2·h·n_kv·d + n_q·d·h + 3·h·I)
  per query seeing c keys:       L · 4 · n_q · d · c            (Q·Kᵀ and A·V)
  per scored token (LM head):    2 · h · V
Flattened: each response i runs P + R_i tokens, query j (1-based) sees j keys, R_i tokens scored.
Prompt reuse: the prompt runs once (query j sees j keys); response i feeds R_i - 1 tokens (its last token is
never read), query j (0-based) sees P + j + 1 keys; R_i tokens scored.
The backward costs twice the forward in both schedules, so the ratio of forward counts is the step ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from augtree_verl.bench.workloads import GroupShape


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(layers=config.num_hidden_layers, hidden=config.hidden_size, q_heads=config.num_attention_heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                   head_dim=head_dim, intermediate=config.intermediate_size, vocab=config.vocab_size)

    def token_flops(self, n_tokens: int) -> int:
        h, d = self.hidden, self.head_dim
        per_layer = 2 * (h * self.q_heads * d + 2 * h * self.kv_heads * d + self.q_heads * d * h
                         + 3 * h * self.intermediate)
        return self.layers * per_layer * n_tokens

    def attention_flops(self, n_key_visits: int) -> int:
        return self.layers * 4 * self.q_heads * self.head_dim * n_key_visits

    def head_flops(self, n_scored: int) -> int:
        return 2 * self.hidden * self.vocab * n_scored


def _triangle(n: int) -> int:
    return n * (n + 1) // 2


def flattened_flops(shape: ModelShape, groups: Iterable[GroupShape]) -> int:
    total = 0
    for g in groups:
        for r in g.response_lens:
            n = g.prompt_len + r
            total += shape.token_flops(n) + shape.attention_flops(_triangle(n)) + shape.head_flops(r)
    return total


def reuse_flops(shape: ModelShape, groups: Iterable[GroupShape]) -> int:
    total = 0
    for g in groups:
        p = g.prompt_len
        total += shape.token_flops(p) + shape.attention_flops(_triangle(p))
        for r in g.response_lens:
            fed = r - 1
            total += shape.token_flops(fed) + shape.attention_flops(fed * p + _triangle(fed)) + shape.head_flops(r)
    return total


def ideal_speedup(shape: ModelShape, groups: Iterable[GroupShape]) -> float:
    """Flattened FLOPs / prompt-reuse FLOPs for one step over ``groups``."""
    groups = list(groups)
    return flattened_flops(shape, groups) / reuse_flops(shape, groups)
