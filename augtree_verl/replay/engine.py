"""``replay``: the grouped replay schedule on one device (docs/design.md §2).

Per tree:
  A. prefill: the prompt runs once; each layer's K/V and the last hidden state are detached into leaves.
  B. replay: responses run in padded micro-batches against the prompt K/V leaves; each backward
     accumulates dK/dV (and d last hidden) into the leaves.
  C. delayed prompt backward: one ``torch.autograd.backward`` of the live prompt tensors with the
     accumulated gradients. Prompt backward is linear in these adjoints, so this equals the flattened
     baseline up to float rounding.
A response of R tokens runs R - 1 tokens through the model: its last token's K/V is never read, and its
first token is scored from the prompt's last hidden state.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from augtree_verl.plan import Plan
from augtree_verl.replay.attention import NO_MASKS, PrefillContext, ResponseContext, use_augtree_attention
from augtree_verl.replay.microbatch import split_micro_batches
from augtree_verl.replay.scoring import token_logps
from augtree_verl.replay.stats import ReplayStats
from augtree_verl.replay.tree import ReplayTree

LossFn = Callable[[int, int, torch.Tensor], torch.Tensor]
LogitsHook = Callable[[int, int, torch.Tensor], None]
DEFAULT_MICRO_BATCH_TOKENS = 8192


def replay(
    model,
    trees: Sequence[ReplayTree],
    loss_fn: LossFn | None = None,
    *,
    temperature: float = 1.0,
    plans: Sequence[Plan | None] | None = None,
    micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
    stats: ReplayStats | None = None,
    keep_graph: bool = False,
    on_logits: LogitsHook | None = None,
) -> list[list[torch.Tensor]]:
    """Score (and, with ``loss_fn``, backpropagate) every response of every tree.

    Returns ``logps[t][i]``: float32 [R_i], detached. With ``loss_fn(t, i, logp_ti) -> scalar``, every
    parameter's ``.grad`` grows by the gradient of sum_{t,i} loss_fn(t, i, logp_ti) as the flattened
    baseline computes it. Without it, runs forward only under ``torch.no_grad``.
    ``plans``: one ``Plan`` (or None) per tree; a plan with degree > 1 runs context-parallel.
    ``keep_graph`` (instead of ``loss_fn``, for losses that need every log-prob at once): the returned
    log-probs stay attached to one graph in which each prompt appears once; a single backward of any
    function of them gives the flattened baseline's gradients (autograd sums every response's prompt
    adjoints before it runs the prompt's backward). All trees' activations are alive until then.
    ``on_logits(t, i, logits)``: sees each response's float32 logits [R_i, V], already divided by
    ``temperature`` and attached to the graph when one is built (e.g. for an entropy term).
    """
    trees = list(trees)
    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().num_embeddings
    for t, tree in enumerate(trees):
        tree.validate(t, vocab, device)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    plans = _check_plans(plans, trees)
    if keep_graph and loss_fn is not None:
        raise ValueError("pass either loss_fn (streamed backward) or keep_graph=True (caller's backward), not both")
    stats = stats if stats is not None else ReplayStats()
    if any(plan is not None and plan.degree > 1 for plan in plans):
        if keep_graph or on_logits is not None:
            raise ValueError("keep_graph and on_logits are not supported with context-parallel plans yet")
        from augtree_verl.cp.engine import replay_cp  # lazy: augtree_verl.cp imports this package
        return replay_cp(model, trees, loss_fn, plans, temperature=temperature,
                         micro_batch_tokens=micro_batch_tokens, stats=stats)
    logps: list[list[torch.Tensor]] = []
    use_augtree_attention(model)
    with torch.set_grad_enabled(loss_fn is not None or keep_graph):
        for t, (tree, plan) in enumerate(zip(trees, plans)):
            stats.plans[plan.primitive if plan else "single"] += 1
            logps.append(_replay_tree(model, t, tree, loss_fn, temperature, micro_batch_tokens, stats, on_logits))
    return logps


def _check_plans(plans, trees) -> list[Plan | None]:
    if plans is None:
        return [None] * len(trees)
    plans = list(plans)
    if len(plans) != len(trees):
        raise ValueError(f"got {len(plans)} plans for {len(trees)} trees; give one plan (or None) per tree")
    for t, (plan, tree) in enumerate(zip(plans, trees)):
        if plan is None:
            continue
        plan.check_responses(len(tree.responses), tree=t)
    return plans


def _replay_tree(model, t, tree, loss_fn, temperature, micro_batch_tokens, stats, on_logits) -> list[torch.Tensor]:
    train = loss_fn is not None  # streamed backward; with keep_graph the prompt simply stays in the graph
    base, lm_head = model.get_decoder(), model.get_output_embeddings()
    p = tree.prompt_len

    # Phase A: prefill.
    start = stats.start_timer(tree.prompt.device)
    prefill = PrefillContext()
    hidden = base(input_ids=tree.prompt[None], attention_mask=NO_MASKS, use_cache=False,
                  augtree_ctx=prefill).last_hidden_state
    live_kv = [prefill.kv[layer] for layer in range(len(prefill.kv))]
    live_last = hidden[0, -1]
    del hidden
    if train:
        _check_prompt_graph(live_kv)
        leaf_kv = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in live_kv]
        leaf_last = live_last.detach().requires_grad_()
    else:
        leaf_kv, leaf_last = live_kv, live_last
    stats.stop_timer("prefill_s", start)
    stats.executed_tokens += p

    # Phase B: response micro-batches.
    start = stats.start_timer(tree.prompt.device)
    lengths = tree.response_lens
    out: list[torch.Tensor | None] = [None] * len(lengths)
    for rows in split_micro_batches(lengths, micro_batch_tokens):
        rq = max(lengths[i] for i in rows) - 1   # tokens each row feeds (right padded)
        if rq > 0:
            ids = torch.zeros(len(rows), rq, dtype=tree.prompt.dtype, device=tree.prompt.device)
            for b, i in enumerate(rows):
                ids[b, : lengths[i] - 1] = tree.responses[i][:-1]
            ctx = ResponseContext(leaf_kv)
            positions = torch.arange(p, p + rq, device=ids.device)[None].expand(len(rows), -1)
            hid = base(input_ids=ids, position_ids=positions, attention_mask=NO_MASKS, use_cache=False,
                       augtree_ctx=ctx).last_hidden_state
        loss = None
        for b, i in enumerate(rows):
            states = leaf_last[None] if lengths[i] == 1 else torch.cat([leaf_last[None], hid[b, : lengths[i] - 1]])
            logp = token_logps(lm_head, states, tree.responses[i], temperature,
                               on_logits=None if on_logits is None else lambda logits: on_logits(t, i, logits))
            out[i] = logp.detach() if train else logp
            if train:
                term = loss_fn(t, i, logp)
                loss = term if loss is None else loss + term
        if train and loss is not None and loss.requires_grad:
            loss.backward()
        stats.micro_batches += 1
        stats.executed_tokens += len(rows) * rq
    stats.stop_timer("replay_s", start)
    stats.logical_tokens += sum(p + r for r in lengths)
    stats.trees += 1

    # Phase C: one delayed prompt backward.
    if train:
        start = stats.start_timer(tree.prompt.device)
        roots, grads = [], []
        for live, leaf in zip([x for kv in live_kv for x in kv] + [live_last],
                              [x for kv in leaf_kv for x in kv] + [leaf_last]):
            if leaf.grad is not None:
                roots.append(live)
                grads.append(leaf.grad)
        if roots:
            torch.autograd.backward(roots, grads)
        stats.stop_timer("prompt_backward_s", start)
    return out


def _check_prompt_graph(live_kv) -> None:
    if not live_kv[0][0].requires_grad:
        raise ValueError(
            "the prompt K/V carry no autograd graph: reentrant activation checkpointing (use_reentrant=True) "
            "hides them; enable checkpointing with use_reentrant=False (transformers' default)")
