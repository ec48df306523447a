"""Benchmark workloads: replay trees with real prompt/response lengths and random token ids.

Each workload is a shipped length table (``tables/<name>.json``, derived by ``derive.py``; provenance in
``tables/ATTRIBUTION.md``) of groups in corpus order. For a step of ``num_groups`` groups of ``group_size`` G
under a per-group token budget B (logical tokens, i.e. what the flattened baseline runs: G·P + ΣR_i):

1. every group is first sized to G responses: a group with at least G responses keeps its first G (corpus
   order); a smaller group keeps all of its responses and repeats them cyclically (r_0, r_1, ..., r_0, ...)
   until it has G. No randomness, so the selection is reproducible from the table alone.
2. groups are ranked by |log(B / (G·(P + R̄)))| where R̄ is the mean response length of the sized group
   (equivalently |log(B / logical_tokens)|): the closest in ratio to B/G per branch first, ties by corpus order.
3. the first ``num_groups`` groups become the trees; token ids are drawn uniformly from [0, vocab_size) with a
   seeded generator (timing depends on lengths only).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from augtree_verl.groups import Tree

TABLES_DIR = Path(__file__).parent / "tables"
WORKLOADS = ("longdoc", "rag", "chat", "reasoning")
QWEN2_5_VOCAB_SIZE = 151_665  # the tokenizer the tables were counted with


@dataclass(frozen=True)
class GroupShape:
    """One group's lengths: ``prompt_len`` P and the G ``response_lens`` R_i (tokens)."""

    id: str
    prompt_len: int
    response_lens: tuple[int, ...]

    @property
    def logical_tokens(self) -> int:
        """Tokens the flattened baseline runs: G·P + ΣR_i."""
        return len(self.response_lens) * self.prompt_len + sum(self.response_lens)

    @property
    def reuse_tokens(self) -> int:
        """Tokens a prompt-reuse schedule runs: P + ΣR_i."""
        return self.prompt_len + sum(self.response_lens)


@dataclass(frozen=True)
class Workload:
    name: str
    groups: tuple[GroupShape, ...]
    trees: tuple[Tree, ...]

    @property
    def logical_tokens(self) -> int:
        return sum(g.logical_tokens for g in self.groups)


@cache
def load_table(name: str) -> tuple[GroupShape, ...]:
    """All groups of workload ``name`` in corpus order, with every response they have."""
    _check_name(name)
    table = json.loads((TABLES_DIR / f"{name}.json").read_text())
    return tuple(GroupShape(id=g["id"], prompt_len=g["prompt_len"], response_lens=tuple(g["response_lens"]))
                 for g in table["groups"])


def fit_group_size(group: GroupShape, group_size: int) -> GroupShape:
    """Truncate ``group`` to its first ``group_size`` responses, or repeat them cyclically up to it."""
    lens = group.response_lens
    return GroupShape(group.id, group.prompt_len, tuple(lens[i % len(lens)] for i in range(group_size)))


def rank_groups(groups: tuple[GroupShape, ...] | list[GroupShape], budget_tokens: int,
                group_size: int) -> list[GroupShape]:
    """Groups sized to ``group_size``, closest to ``budget_tokens`` logical tokens first (log ratio; stable)."""
    _check_sizes(budget_tokens, group_size)
    sized = [fit_group_size(g, group_size) for g in groups]
    return sorted(sized, key=lambda g: abs(math.log(budget_tokens / g.logical_tokens)))


def select_groups(name: str, budget_tokens: int, group_size: int, num_groups: int = 1) -> list[GroupShape]:
    """The ``num_groups`` groups of workload ``name`` that best fit ``budget_tokens`` per group (see module doc)."""
    table = load_table(name)
    if not isinstance(num_groups, int) or not 1 <= num_groups <= len(table):
        raise ValueError(f"num_groups must be an int in [1, {len(table)}] for workload {name!r} "
                         f"(it has {len(table)} groups), got {num_groups!r}")
    return rank_groups(table, budget_tokens, group_size)[:num_groups]


def build_workload(name: str, budget_tokens: int, group_size: int, num_groups: int = 1, *,
                   vocab_size: int = QWEN2_5_VOCAB_SIZE, seed: int = 0) -> Workload:
    """Replay trees for workload ``name``: selected groups' lengths, token ids uniform in [0, vocab_size)."""
    groups = select_groups(name, budget_tokens, group_size, num_groups)
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, vocab_size, (n,), generator=gen, dtype=torch.long)

    trees = tuple(Tree.of_tokens(prompt=ids(g.prompt_len), responses=[ids(r) for r in g.response_lens]) for g in groups)
    return Workload(name=name, groups=tuple(groups), trees=trees)


def _check_name(name: str) -> None:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {WORKLOADS}")


def _check_sizes(budget_tokens: int, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    # The shortest possible branch is a 1-token prompt plus a 1-token response.
    if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 2 * group_size:
        raise ValueError(f"budget_tokens must be an int of at least 2 * group_size = {2 * group_size} "
                         f"(one prompt and one response token per branch), got {budget_tokens!r}")
