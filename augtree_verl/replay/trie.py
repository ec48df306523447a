"""The step's prefix trie: every row's [prompt || response] tokens, shared prefixes found from the tokens,
whatever the uids (docs/design.md §9).

A row is a response of a ``groups.Tree``, named ``(t, i)``; its sequence is ``trees[t].prompt`` followed by
``trees[t].responses[i]``. The compressed trie of all rows' sequences is cut

- where rows diverge (a branch), where a row ends, and
- where a row's prompt ends, so that a group (one prompt, G responses) is the depth-1 trie of today's
  ``Tree``: its prompt one node, its responses the leaves, the same model calls;

then every inner node not worth its own call is dissolved: its tokens are prepended to its children (and
to a new leaf of the rows ending in it). A node is kept when it ends a row's prompt, or when running it
once saves at least ``MIN_SHARED_TOKENS`` token passes: (branches - 1) x length, its branches being its
children and the rows that end in it. An inner node below a root shorter than ``MIN_CALL_TOKENS`` is
dissolved too (then a prompt may end inside a node): on a hybrid model it starts from its parent's
linear-attention state, and a one-token continuation takes the layers' in-place single-step path
(``linear_state``).

Rows of trees whose model calls run at different rope lengths (``Tree.rope_len``: the regime of a
length-dependent rope, ``replay.rope``) never share a node: their K/V differ. Nor do the rows of a tree whose
prompt has images (``Tree.vision``) with any other tree's: equal tokens there may stand for other images.

Inner nodes run as one prefill each (attending to their ancestors' K/V); leaves (the rows' own suffixes;
identical rows share one) run as padded micro-batches of their parent's leaves. A node scores the tokens
that some row through it scores (``score_from``); each row takes, from every node on its path, the scores of
its own response tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from augtree_verl.groups import Tree
from augtree_verl.replay.linear_state import MIN_CALL_TOKENS
from augtree_verl.replay.microbatch import DEFAULT_MICRO_BATCH_TOKENS, split_micro_batches

# A node of the trie costs one prefill call and one delayed backward more than its tokens' FLOPs: the
# planner's ``slot_overhead_s`` (its default profile: 28 layers x 36 kernels x 10 us = 10 ms of launch time
# for a 7B model). One token's forward and backward at 7B costs 3 x 2 x 7.6e9 FLOPs at 0.6 x 989 TFLOP/s
# = 77 us, so a node pays off when it saves about 10 ms / 77 us = 130 token passes; 128 rounds it.
MIN_SHARED_TOKENS = 128

Row = tuple[int, int]  # (tree index, response index)


@dataclass(eq=False)
class TrieNode:
    """One node: the tokens at positions [``start``, ``end``) shared by ``rows``.

    ``sequence``: the [L] token ids of one row through the node (``tokens`` is a view of it); ``ends``: the
    rows whose last token is the node's last; ``children``: in the order of their first row; ``prompt_ends``:
    the prompt length of every row through it (by row); ``score_from``: the first position the node scores
    (None: none; a leaf scores all its tokens, each row takes its own part); ``micro_batches``: its leaves'
    micro-batches, indices into ``leaves`` (``split_micro_batches`` of their lengths at the trie's
    ``micro_batch_tokens``, set when the trie is found and never changed).
    """

    start: int
    end: int
    sequence: torch.Tensor
    rows: list[Row]
    ends: list[Row] = field(default_factory=list)
    children: list[TrieNode] = field(default_factory=list)
    score_from: int | None = None
    micro_batches: list[list[int]] = field(default_factory=list)

    @property
    def tokens(self) -> torch.Tensor:
        """[end - start] token ids."""
        return self.sequence[self.start : self.end]

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def inner(self) -> list[TrieNode]:
        """The children with children of their own (each one prefill), heaviest subtree first."""
        kids = [c for c in self.children if c.children]
        return sorted(kids, key=lambda c: -c.weight)

    @property
    def leaves(self) -> list[TrieNode]:
        """The children without children (rows' own suffixes, micro-batched), in the order of their first row."""
        return [c for c in self.children if not c.children]

    @property
    def weight(self) -> int:
        """Tokens of the subtree, each once (orders siblings for the lock-step shape)."""
        return self.length + sum(c.weight for c in self.children)

    def depth(self) -> int:
        """1 for a node whose children are all leaves."""
        return 1 + max((c.depth() for c in self.inner), default=0)

    def trees(self) -> list[int]:
        """The trees with a row through the node, in order."""
        return sorted({t for t, _ in self.rows})


def build_trie(
    trees: Sequence[Tree],
    *,
    min_node_tokens: int = MIN_CALL_TOKENS,
    min_shared_tokens: int = MIN_SHARED_TOKENS,
    micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
) -> list[TrieNode]:
    """The tries of ``trees``' rows (``Tree.of_tokens``; see the module docstring): their roots, in the order
    of their first row (``StepTrie(...).roots``)."""
    return StepTrie(
        trees,
        min_node_tokens=min_node_tokens,
        min_shared_tokens=min_shared_tokens,
        micro_batch_tokens=micro_batch_tokens,
    ).roots


def host_token_ids(ids: torch.Tensor) -> np.ndarray:
    """[N] token ids (every row of a step, concatenated) copied to the host: a ``StepTrie``'s one
    device-to-host copy (one host sync); tests count the copies of a step through it."""
    return ids.cpu().numpy()


class StepTrie:
    """The tries of one step's rows, found once and read by every part of the step plan that needs them
    (``step_plan.shared_root_plans`` and ``assign_subgroups``: the tries' trees; ``lockstep.lockstep_slots``:
    the tries of the trees this rank runs on one device).

    ``trees``: the step's ``Tree.of_tokens`` trees; ``roots``: the tries of all their rows (``build_trie``'s),
    rows named ``(tree index, response index)``; ``min_node_tokens``, ``min_shared_tokens``: the thresholds
    (``build_trie``'s); ``micro_batch_tokens``: the token budget of a micro-batch of one node's leaves (the
    nodes' ``micro_batches``). Building reads every row's token ids to the host in one copy (``host_token_ids``) and
    keeps them, so that ``of`` finds the tries of a subset of the trees without another copy.
    """

    def __init__(
        self,
        trees: Sequence[Tree],
        *,
        min_node_tokens: int = MIN_CALL_TOKENS,
        min_shared_tokens: int = MIN_SHARED_TOKENS,
        micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
    ):
        if min_node_tokens < 1:
            raise ValueError(f"min_node_tokens must be >= 1, got {min_node_tokens}")
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        self.trees, self.min_node_tokens, self.min_shared_tokens = list(trees), min_node_tokens, min_shared_tokens
        self.micro_batch_tokens = micro_batch_tokens
        self._rows = [(t, i) for t, tree in enumerate(self.trees) for i in range(len(tree.responses))]
        # per row: its [L] token ids on the trees' device (the nodes' ``sequence``), on the host, its prompt end
        self._sequences = {(t, i): torch.cat([self.trees[t].prompt, self.trees[t].responses[i]]) for t, i in self._rows}
        self._arrays: dict[Row, np.ndarray] = {}
        if self._rows:
            host, offset = host_token_ids(torch.cat([self._sequences[r] for r in self._rows])), 0
            for r in self._rows:
                self._arrays[r] = host[offset : offset + len(self._sequences[r])]
                offset += len(self._sequences[r])
        self._prompt_ends = {(t, i): self.trees[t].prompt_len for t, i in self._rows}
        self.roots = self._build(self._rows)

    def tries(self) -> list[list[int]]:
        """The trees of each trie (root order)."""
        return [root.trees() for root in self.roots]

    def of(self, subset: Sequence[int]) -> list[TrieNode]:
        """The roots ``build_trie`` finds for the trees ``subset`` (tree indices), rows named by tree index
        as in ``roots``. Where ``subset`` is a union of whole tries, those of ``roots`` (the same objects):
        every tree's rows lie in one trie, and a node that a trie's rows shared with other tries' was dissolved
        at the top, which it is without them too, so a trie is found alike alone. Else (a trie cut into
        chunks, ``step_plan.pack_subgroups``) found again from the kept host token ids."""
        chosen = set(subset)
        whole = [root for root in self.roots if chosen.issuperset(root.trees())]
        if sum(len(root.trees()) for root in whole) == len(chosen):
            return whole
        return self._build([r for r in self._rows if r[0] in chosen])

    def _build(self, rows: list[Row]) -> list[TrieNode]:
        regimes: dict[tuple[int | None, int | None], list[Row]] = {}
        for r in rows:  # a tree with images shares with no other: its own key
            regimes.setdefault((self.trees[r[0]].rope_len, r[0] if self.trees[r[0]].vision else None), []).append(r)
        groups = [group for regime in regimes.values() for group in _by_token(regime, self._arrays, 0)]
        return self._simplify([self._node(group, 0) for group in groups], top=True)

    def _node(self, rows: list[Row], start: int) -> TrieNode:
        """The node of ``rows`` (which share their tokens up to ``start`` and the one at ``start``) and its
        subtree."""
        arrays = self._arrays
        end = min(len(arrays[r]) for r in rows)
        end = min([end] + [p for r in rows if start < (p := self._prompt_ends[r]) < end])
        ref = arrays[rows[0]]
        for r in rows[1:]:
            differ = np.flatnonzero(arrays[r][start:end] != ref[start:end])
            if differ.size:
                end = start + int(differ[0])
        node = TrieNode(start, end, self._sequences[rows[0]], rows, ends=[r for r in rows if len(arrays[r]) == end])
        rest = [r for r in rows if len(arrays[r]) > end]
        node.children = [self._node(group, end) for group in _by_token(rest, arrays, end)]
        return node

    def _simplify(self, nodes: list[TrieNode], *, top: bool) -> list[TrieNode]:
        """``nodes`` (siblings) with every inner node not worth a call dissolved, top down; scores and
        micro-batches set."""
        out: list[TrieNode] = []
        for node in nodes:
            if node.children and not self._keep(node, top):
                out += self._simplify(self._dissolve(node), top=top)
                continue
            node.children = self._simplify(node.children, top=False)
            node.score_from = self._score_from(node)
            if node.children:
                node.micro_batches = split_micro_batches([leaf.length for leaf in node.leaves], self.micro_batch_tokens)
            out.append(node)
        return sorted(out, key=lambda n: min(n.rows))

    def _keep(self, node: TrieNode, top: bool) -> bool:
        if not top and node.length < self.min_node_tokens:
            return False
        if any(self._prompt_ends[r] == node.end for r in node.rows):
            return True
        branches = len(node.children) + (1 if node.ends else 0)
        return (branches - 1) * node.length >= self.min_shared_tokens

    def _dissolve(self, node: TrieNode) -> list[TrieNode]:
        """``node``'s children starting at its start, and a leaf of its tokens for the rows ending in it."""
        for child in node.children:
            child.start = node.start
        if node.ends:
            node.children.append(TrieNode(node.start, node.end, node.sequence, node.ends, ends=node.ends))
        return node.children

    def _score_from(self, node: TrieNode) -> int | None:
        if not node.children:
            return node.start
        first = max(node.start, min(self._prompt_ends[r] for r in node.rows))
        return first if first < node.end else None


def _by_token(rows: list[Row], arrays, position: int) -> list[list[Row]]:
    groups: dict[int, list[Row]] = {}
    for r in rows:
        groups.setdefault(int(arrays[r][position]), []).append(r)
    return list(groups.values())


def row_scores(path: Sequence[tuple[TrieNode, torch.Tensor | None]], prompt_len: int) -> list[torch.Tensor]:
    """The parts of one row's scores from the nodes of its path: ``path`` holds (node, its scores [n_scored]
    or [n_scored, 2], from ``node.score_from``; None where it scores nothing); the row, of prompt length
    ``prompt_len``, takes the scores of its positions >= ``prompt_len``."""
    parts = []
    for node, scores in path:
        if node.score_from is None or prompt_len >= node.end:
            continue
        parts.append(scores[max(prompt_len, node.score_from) - node.score_from :])
    return parts
