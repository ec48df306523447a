"""One tree's slot on one device (docs/design.md §2):

  A. prefill: the prompt runs once into a ``PromptKV`` (each layer's K/V and the last hidden state as
     leaves whose gradient sums over many micro-batches are float32 whatever the model's dtype);
  B. replay: responses run in padded micro-batches against the prompt K/V leaves, each with its loss and
     backward, accumulating dK/dV (and d last hidden) into the leaves; dummy calls pad to ``slot.calls``;
  C. the ``PromptKV``'s one delayed prompt backward. Prompt backward is linear in these adjoints, so this
     equals the flattened baseline up to float rounding.
A response of R tokens runs R - 1 tokens through the model: its last token's K/V is never read, and its
first token is scored from the prompt's last hidden state.
"""

from __future__ import annotations

import torch

from augtree_verl.groups import Tree
from augtree_verl.replay.attention import PrefillContext, ResponseContext
from augtree_verl.replay.calls import PAD_ID, ModelCalls
from augtree_verl.replay.lockstep import Slot
from augtree_verl.replay.prompt_kv import PromptKV


def run_tree(calls: ModelCalls, t: int, tree: Tree, slot: Slot) -> list[torch.Tensor]:
    """Phases A-C of tree ``t`` in ``slot``; returns its scores per response ([R_i] or [R_i, 2]), detached
    in training (a forward-only replay runs under ``torch.no_grad``)."""
    stats, p = calls.stats, tree.prompt_len

    start = stats.start_timer(tree.prompt.device)
    def prefill():
        ctx = PrefillContext()
        hidden = calls.decoder(tree.prompt[None], torch.arange(p, device=tree.prompt.device)[None], ctx)
        # a copy of the last row: a view would keep all P rows of ``hidden`` alive until the delayed backward
        return [ctx.kv[layer] for layer in range(len(ctx.kv))], hidden[0, -1:].clone(), 0
    prompt = PromptKV(prefill, train=calls.train, offload=calls.offload)
    stats.stop_timer("prefill_s", start)

    start = stats.start_timer(tree.prompt.device)
    out: list[torch.Tensor | None] = [None] * len(tree.responses)
    for rows in slot.micro_batches:
        scores = _score(calls, tree, rows, prompt)
        for i, s in zip(rows, scores):
            out[i] = s.detach()
        if calls.train:
            calls.backward_zero_or(calls.loss(t, rows, scores), scores)
        stats.micro_batches += 1
    calls.finish_slot(prompt, len(slot.micro_batches), slot.calls, start)
    return out


def _score(calls: ModelCalls, tree: Tree, rows: list[int], prompt: PromptKV) -> list[torch.Tensor]:
    """Scores of responses ``rows`` of ``tree``: one decoder call (at least ``calls.min_tokens`` tokens per row,
    so that every call runs every layer) and one LM-head call."""
    p, lengths = tree.prompt_len, [tree.response_lens[i] for i in rows]
    rq = max(max(lengths) - 1, calls.min_tokens)  # tokens each row feeds (right padded)
    ids = torch.full((len(rows), rq), PAD_ID, dtype=tree.prompt.dtype, device=tree.prompt.device)
    for b, i in enumerate(rows):
        ids[b, : lengths[b] - 1] = tree.responses[i][:-1]
    positions = torch.arange(p, p + rq, device=ids.device)[None].expand(len(rows), -1)
    hid = calls.decoder(ids, positions, ResponseContext(prompt.kv))
    states = torch.cat([torch.cat([prompt.last[None], hid[b, : n - 1]]) for b, n in enumerate(lengths)])
    return list(calls.scores(states, torch.cat([tree.responses[i] for i in rows])).split(lengths))
