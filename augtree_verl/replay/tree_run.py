"""One trie's slot on one device (docs/design.md §2, §9); a group (one prompt, G responses) is the depth-1
trie, run as:

  A. prefill: the prompt runs once into a ``PromptKV`` (each layer's K/V and the last hidden state as
     leaves whose gradient sums over many micro-batches are float32 whatever the model's dtype);
  B. replay: responses run in padded micro-batches against the prompt K/V leaves, each with its loss and
     backward, accumulating dK/dV (and d last hidden) into the leaves; dummy calls pad to the slot's calls;
  C. the ``PromptKV``'s one delayed prompt backward. Prompt backward is linear in these adjoints, so this
     equals the flattened baseline up to float rounding.
A response of R tokens runs R - 1 tokens through the model: its last token's K/V is never read, and its
first token is scored from the prompt's last hidden state.

A deeper trie runs depth first: a node's prefill attends to its ancestors' leaves (its path, root first)
and, for a hybrid, starts from its parent's linear-attention state; its leaves' micro-batches run (B), then
each inner child's subtree, then the losses of the rows that end in it, then its delayed backward (C),
which adds into its ancestors' leaves before theirs runs: deepest first, and only the path's state alive.
A node scores the tokens some row through it scores, once, in its prefill (one LM-head call); every row
takes its part from the node's score leaf, so each row's loss sees its own copy and their gradients sum
in float32 into that leaf, which the node's delayed backward takes. Where the lock-step shape asks for more
than this rank has, dummy nodes and dummy calls pad it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from augtree_verl.groups import Tree
from augtree_verl.replay.attention import PrefillContext, ResponseContext
from augtree_verl.replay.calls import PAD_ID, ModelCalls
from augtree_verl.replay.lockstep import DummySlot, Shape, TrieSlot
from augtree_verl.replay.prompt_kv import PromptKV
from augtree_verl.replay.trie import Row, TrieNode, row_scores
from augtree_verl.replay.vlm import span_positions


class NodeState(Protocol):
    """A path node's state as its descendants read it (a ``PromptKV``, or a context-parallel root's gathered
    copy, ``replay.cp_trie``): per-layer ``kv`` leaves, the ``last`` hidden state's, the ``scores`` leaf."""

    @property
    def kv(self) -> list: ...

    @property
    def last(self) -> torch.Tensor | None: ...

    @property
    def scores(self) -> torch.Tensor | None: ...


Path = list[tuple[TrieNode | None, NodeState]]  # the nodes from the root to the current one, with their state


class TrieRun:
    """The one-device slots of one ``replay`` call; ``scores[(t, i)]``: each row's scores ([R_i] or [R_i, 2]),
    detached in training (a forward-only replay runs under ``torch.no_grad``)."""

    def __init__(self, calls: ModelCalls, trees: list[Tree]):
        self.calls, self.trees = calls, trees
        self.scores: dict[Row, torch.Tensor] = {}

    def __call__(self, slot: TrieSlot | DummySlot) -> None:
        """Run ``slot`` (a trie, or a dummy) in its lock-step shape."""
        self.node(slot.node if isinstance(slot, TrieSlot) else None, slot.shape, [])

    def node(self, node: TrieNode | None, shape: Shape, path: Path) -> None:
        calls, stats = self.calls, self.calls.stats
        start = stats.start_timer(calls.device)
        prompt = (
            calls.dummy_prompt(shape.scored, shape.tower)
            if node is None
            else self._prefill(node, path, shape.scored, shape.tower)
        )
        stats.stop_timer("prefill_s", start)
        if node is not None:
            stats.nodes += 1
        path = path + [(node, prompt)]
        start = stats.start_timer(calls.device)
        batches = node.micro_batches if node is not None else []
        for leaves in batches:
            self.leaves(node, [node.leaves[k] for k in leaves], path)
            stats.micro_batches += 1
        calls.finish_calls(len(batches), shape.calls, start)
        inner = node.inner if node is not None else []
        for j, child in enumerate(shape.children):
            self.node(inner[j] if j < len(inner) else None, child, path)
        if node is not None and node.ends:  # rows that end inside the trie: their scores are all in the path
            scores = [_cat(row_scores(_scored(path), self.trees[t].prompt_len)) for t, _ in node.ends]
            loss = self._record(node.ends, scores)
            if loss is not None:
                loss.backward()
        calls.delayed_backward(prompt)

    def _prefill(self, node: TrieNode, path: Path, scored: bool, tower: bool) -> PromptKV:
        """``node``'s tokens through the decoder, attending to ``path``; with ``scored``, one LM-head call on
        the positions from ``node.score_from`` (a dummy row where it scores none); with ``tower``, through the
        vision tower (a root prompt's images, else the dummy tower call)."""
        calls, tokens = self.calls, node.tokens
        tree = self.trees[node.rows[0][0]]  # a node of a tree with images is that tree's alone (``trie``)

        def prefill():
            ctx = PrefillContext([state.kv for _, state in path])
            positions = span_positions(tree, node.start, node.end, 1)
            if tower:
                hidden = calls.tower_decoder(tokens[None], positions, tree if node.start == 0 else None, ctx)[0]
            else:
                hidden = calls.decoder(tokens[None], positions, ctx)[0]
            kv = [ctx.kv[layer] for layer in range(len(ctx.kv))]
            if not scored:
                # a copy of the last row: a view would keep all rows of ``hidden`` alive until the delayed backward
                return kv, hidden[-1:].clone(), 0, None
            if node.score_from is None:
                return kv, hidden, node.length - 1, calls.scores(hidden[-1:], tokens.new_full((1,), PAD_ID))
            first = node.score_from - node.start
            states = hidden[first - 1 : -1] if first else torch.cat([path[-1][1].last[None], hidden[:-1]])
            return kv, hidden, node.length - 1, calls.scores(states, tokens[first:])

        return PromptKV(prefill, train=calls.train, offload=calls.offload)

    def leaves(self, node: TrieNode, leaves: list[TrieNode], path: Path) -> None:
        """One micro-batch of ``node``'s ``leaves``: one decoder call (at least ``calls.min_tokens`` tokens per
        row, so that every call runs every layer), one LM-head call, the losses of their rows, one backward."""
        calls, lengths = self.calls, [leaf.length for leaf in leaves]
        rq = max(max(lengths) - 1, calls.min_tokens)  # tokens each row feeds (right padded)
        ids = torch.full((len(leaves), rq), PAD_ID, dtype=node.sequence.dtype, device=node.sequence.device)
        for b, leaf in enumerate(leaves):
            ids[b, : lengths[b] - 1] = leaf.tokens[:-1]
        positions = span_positions(self.trees[node.rows[0][0]], node.end, node.end + rq, len(leaves))
        hid = calls.decoder(ids, positions, ResponseContext([state.kv for _, state in path]))
        last = path[-1][1].last
        states = torch.cat([torch.cat([last[None], hid[b, : n - 1]]) for b, n in enumerate(lengths)])
        leaf_scores = list(calls.scores(states, torch.cat([leaf.tokens for leaf in leaves])).split(lengths))
        rows, scores = [], []
        for leaf, own in zip(leaves, leaf_scores):
            for t, i in leaf.rows:
                prompt_len = self.trees[t].prompt_len
                rows.append((t, i))
                scores.append(_cat(row_scores(_scored(path), prompt_len) + [own[max(prompt_len - leaf.start, 0) :]]))
        loss = self._record(rows, scores)
        if calls.train:
            calls.backward_zero_or(loss, leaf_scores)

    def _record(self, rows: list[Row], scores: list[torch.Tensor]):
        """Keep ``rows``' scores; in training, their loss (the micro-batch loss of each tree's rows, summed;
        None where none has a gradient)."""
        for row, s in zip(rows, scores):
            self.scores[row] = s.detach()
        if not self.calls.train:
            return None
        by_tree: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        for (t, i), s in zip(rows, scores):
            by_tree.setdefault(t, ([], []))
            by_tree[t][0].append(i)
            by_tree[t][1].append(s)
        losses = [self.calls.loss(t, ii, ss) for t, (ii, ss) in by_tree.items()]
        losses = [x for x in losses if x is not None and x.requires_grad]
        return sum(losses[1:], losses[0]) if losses else None


def _scored(path: Path) -> list[tuple[TrieNode, torch.Tensor | None]]:
    return [(node, state.scores) for node, state in path if node is not None]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
