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

Two workloads share tokens beyond a group (``SHARED_WORKLOADS``; docs/design.md §9), built from chat's groups
(selected as above) and ``tables/agent.json``; ids of a shared part are equal in every row that holds it:

- agent: every group's prompt is one batch-wide system turn (the tiny-agents system prompt and tools, S tokens)
  followed by the group's user turn (its chat prompt less the chat template's default system turn, N tokens).
- multiturn: one conversation, step-wise: turn t is a group whose prompt is turn t-1's prompt, its first
  response (the branch the conversation continues), a newline and the user turn of the t-th selected group
  (again less N); so the G responses of every turn branch at a turn boundary and later turns quote earlier
  ones. The turns' user prompts and answers are consecutive chat groups (the tables hold no real
  conversation); the budget selects each turn's own group, the quoted history comes on top.
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
WORKLOADS = ("longdoc", "rag", "chat", "reasoning")  # ``--workload all``
SHARED_WORKLOADS = ("agent", "multiturn")  # sharing beyond the group: run when named
ALL_WORKLOADS = WORKLOADS + SHARED_WORKLOADS
QWEN2_5_VOCAB_SIZE = 151_665  # the tokenizer the tables were counted with
# Groups per step when not given: one tree per step for the length tables; several for the shared workloads,
# so the system prompt is shared across uids (agent) and a conversation has turns that quote each other.
DEFAULT_GROUPS = {"agent": 4, "multiturn": 4}
TURN_SEPARATOR_TOKENS = 1  # the "\n" the chat template puts after a quoted answer's <|im_end|>


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
    """All groups of workload ``name`` in corpus order, with every response they have (agent: chat's with the
    system turn in front; multiturn: chat's, the turns it picks from)."""
    _check_name(name)
    if name in SHARED_WORKLOADS:
        chat = load_table("chat")
        system, default = agent_system_turns()
        for g in chat:
            if g.prompt_len <= default:
                raise ValueError(
                    f"workload {name!r}: chat group {g.id} has a {g.prompt_len}-token prompt, not "
                    f"longer than the {default}-token default system turn it starts with"
                )
        if name == "multiturn":
            return chat
        return tuple(GroupShape(g.id, system + g.prompt_len - default, g.response_lens) for g in chat)
    table = json.loads((TABLES_DIR / f"{name}.json").read_text())
    return tuple(
        GroupShape(id=g["id"], prompt_len=g["prompt_len"], response_lens=tuple(g["response_lens"]))
        for g in table["groups"]
    )


@cache
def agent_system_turns() -> tuple[int, int]:
    """(S, N): tokens of the agent system turn, of the chat template's default system turn (tables/agent.json)."""
    table = json.loads((TABLES_DIR / "agent.json").read_text())
    return table["system_prompt_tokens"], table["default_system_tokens"]


def fit_group_size(group: GroupShape, group_size: int) -> GroupShape:
    """Truncate ``group`` to its first ``group_size`` responses, or repeat them cyclically up to it."""
    lens = group.response_lens
    return GroupShape(group.id, group.prompt_len, tuple(lens[i % len(lens)] for i in range(group_size)))


def rank_groups(
    groups: tuple[GroupShape, ...] | list[GroupShape], budget_tokens: int, group_size: int
) -> list[GroupShape]:
    """Groups sized to ``group_size``, closest to ``budget_tokens`` logical tokens first (log ratio; stable)."""
    _check_sizes(budget_tokens, group_size)
    sized = [fit_group_size(g, group_size) for g in groups]
    return sorted(sized, key=lambda g: abs(math.log(budget_tokens / g.logical_tokens)))


def select_groups(name: str, budget_tokens: int, group_size: int, num_groups: int | None = None) -> list[GroupShape]:
    """The ``num_groups`` groups of workload ``name`` that best fit ``budget_tokens`` per group (see module doc;
    None: ``DEFAULT_GROUPS``, else 1)."""
    table = load_table(name)
    num_groups = DEFAULT_GROUPS.get(name, 1) if num_groups is None else num_groups
    if not isinstance(num_groups, int) or not 1 <= num_groups <= len(table):
        raise ValueError(
            f"num_groups must be an int in [1, {len(table)}] for workload {name!r} "
            f"(it has {len(table)} groups), got {num_groups!r}"
        )
    return rank_groups(table, budget_tokens, group_size)[:num_groups]


def build_workload(
    name: str,
    budget_tokens: int,
    group_size: int,
    num_groups: int | None = None,
    *,
    vocab_size: int = QWEN2_5_VOCAB_SIZE,
    seed: int = 0,
) -> Workload:
    """Replay trees for workload ``name``: selected groups' lengths, token ids uniform in [0, vocab_size),
    equal where the module docstring shares them."""
    groups = select_groups(name, budget_tokens, group_size, num_groups)
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, vocab_size, (n,), generator=gen, dtype=torch.long)

    if name == "multiturn":
        shapes, turns = _conversation(groups, ids)
        return Workload(name=name, groups=tuple(shapes), trees=tuple(turns))
    system = ids(agent_system_turns()[0]) if name == "agent" else None

    def prompt(g: GroupShape) -> torch.Tensor:
        return ids(g.prompt_len) if system is None else torch.cat([system, ids(g.prompt_len - len(system))])

    trees = tuple(Tree.of_tokens(prompt=prompt(g), responses=[ids(r) for r in g.response_lens]) for g in groups)
    return Workload(name=name, groups=tuple(groups), trees=trees)


def _conversation(groups: list[GroupShape], ids) -> tuple[list[GroupShape], list[Tree]]:
    """The multiturn trees over ``groups`` (its turns' chat groups, in turn order) and their shapes: turn t's
    [P_t] prompt ends with turn t-1's first response, the same ids."""
    default = agent_system_turns()[1]
    shapes: list[GroupShape] = []
    trees: list[Tree] = []
    for g in groups:
        prompt = (
            torch.cat([trees[-1].prompt, trees[-1].responses[0], ids(TURN_SEPARATOR_TOKENS + g.prompt_len - default)])
            if trees
            else ids(g.prompt_len)
        )
        trees.append(Tree.of_tokens(prompt=prompt, responses=[ids(r) for r in g.response_lens]))
        shapes.append(GroupShape(g.id, len(prompt), g.response_lens))
    return shapes, trees


def _check_name(name: str) -> None:
    if name not in ALL_WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {ALL_WORKLOADS}")


def _check_sizes(budget_tokens: int, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    # The shortest possible branch is a 1-token prompt plus a 1-token response.
    if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 2 * group_size:
        raise ValueError(
            f"budget_tokens must be an int of at least 2 * group_size = {2 * group_size} "
            f"(one prompt and one response token per branch), got {budget_tokens!r}"
        )
