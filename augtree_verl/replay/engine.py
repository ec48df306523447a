"""``replay``: the grouped replay schedule on one device (docs/design.md §2).

Per tree:
  A. prefill: the prompt runs once; each layer's K/V and the last hidden state are detached into leaves
     (training: their gradient sums over many micro-batches are float32 whatever the model's dtype).
  B. replay: responses run in padded micro-batches against the prompt K/V leaves; each backward
     accumulates dK/dV (and d last hidden) into the leaves.
  C. delayed prompt backward: one ``torch.autograd.backward`` of the live prompt tensors with the
     accumulated gradients. Prompt backward is linear in these adjoints, so this equals the flattened
     baseline up to float rounding.
A response of R tokens runs R - 1 tokens through the model: its last token's K/V is never read, and its
first token is scored from the prompt's last hidden state.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import weakref
from typing import Callable, Sequence

import torch

from augtree_verl.plan import Plan
from augtree_verl.replay.attention import NO_MASKS, PrefillContext, ResponseContext, use_augtree_attention
from augtree_verl.replay.offload import Offload
from augtree_verl.replay.schedule import Slot, tree_schedule
from augtree_verl.replay.scoring import logps_from_logits
from augtree_verl.replay.stats import ReplayStats
from augtree_verl.replay.tree import ReplayTree

LossFn = Callable[[int, int, torch.Tensor], torch.Tensor]
# micro_batch_loss(t, rows, logps): the loss of tree t's response micro-batch ``rows`` (response indices),
# logps[b] float32 [R_rows[b]] attached to the graph; None or a tensor without grad contributes nothing.
MicroBatchLossFn = Callable[[int, list[int], list[torch.Tensor]], "torch.Tensor | None"]
LogitsHook = Callable[[int, int, torch.Tensor], None]
DEFAULT_MICRO_BATCH_TOKENS = 8192
PAD_ID = 0  # token of padded positions and of the lock-step dummy calls (any id of the vocabulary)


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
    micro_batch_loss: MicroBatchLossFn | None = None,
    lockstep_group=None,
    offload: Offload | None = None,
) -> list[list[torch.Tensor]]:
    """Score (and, with ``loss_fn``, backpropagate) every response of every tree.

    Returns ``logps[t][i]``: float32 [R_i], detached. With ``loss_fn(t, i, logp_ti) -> scalar``, every
    parameter's ``.grad`` grows by the gradient of sum_{t,i} loss_fn(t, i, logp_ti) as the flattened
    baseline computes it. Without it, runs forward only under ``torch.no_grad``.
    ``micro_batch_loss(t, rows, logps)`` (instead of ``loss_fn``): one loss per response micro-batch, for
    losses that are evaluated on a batch of rows at once (verl's); same gradient contract.
    ``plans``: one ``Plan`` (or None) per tree; a plan with degree > 1 runs context-parallel.
    ``keep_graph`` (instead of a loss, for losses that need every log-prob at once): the returned
    log-probs stay attached to one graph in which each prompt appears once; a single backward of any
    function of them gives the flattened baseline's gradients (autograd sums every response's prompt
    adjoints before it runs the prompt's backward). All trees' activations are alive until then.
    ``on_logits(t, i, logits)``: sees each response's float32 logits [R_i, V], already divided by
    ``temperature`` and attached to the graph when one is built (e.g. for an entropy term), before the
    micro-batch's loss.
    ``lockstep_group``: a process group whose ranks all call ``replay`` together on one FSDP2-sharded
    model; every rank then issues the same sequence of model calls and backwards (``schedule``), padding
    with dummy calls, so that per-layer all-gathers and reduce-scatters line up.
    ``offload`` (training with a streamed backward): each prompt's saved activations wait in host memory
    between its forward and its delayed backward (``replay.offload``); ignored when forward only.
    """
    trees = list(trees)
    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().num_embeddings
    for t, tree in enumerate(trees):
        tree.validate(t, vocab, device)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    plans = _check_plans(plans, trees)
    if sum(x is not None and x is not False for x in (loss_fn, micro_batch_loss, keep_graph)) > 1:
        raise ValueError("pass one of loss_fn, micro_batch_loss (streamed backward) or keep_graph=True "
                         "(caller's backward), not more than one")
    if keep_graph and lockstep_group is not None:
        raise ValueError("keep_graph leaves the backward to the caller, so it cannot run in lock-step")
    if keep_graph and offload is not None:
        raise ValueError("offload restores a prompt's activations for its delayed backward; with keep_graph the "
                         "backward is the caller's: pass loss_fn or micro_batch_loss instead")
    stats = stats if stats is not None else ReplayStats()
    if any(plan is not None and plan.degree > 1 for plan in plans):
        if keep_graph or on_logits is not None or micro_batch_loss is not None or lockstep_group is not None:
            raise ValueError("keep_graph, on_logits, micro_batch_loss and lockstep_group are not supported with "
                             "context-parallel plans yet")
        from augtree_verl.cp.engine import replay_cp  # lazy: augtree_verl.cp imports this package
        return replay_cp(model, trees, loss_fn, plans, temperature=temperature,
                         micro_batch_tokens=micro_batch_tokens, stats=stats, offload=offload)
    if loss_fn is not None:
        micro_batch_loss = functools.partial(_sum_of_response_losses, loss_fn)
    logps: list[list[torch.Tensor]] = [[] for _ in trees]
    use_augtree_attention(model)
    run = _TreeRun(model, temperature, stats, on_logits, micro_batch_loss, offload)
    with torch.set_grad_enabled(micro_batch_loss is not None or keep_graph), \
            _fp32_grad_sums(model if micro_batch_loss is not None else None):
        for slot in tree_schedule(trees, micro_batch_tokens, group=lockstep_group, device=device):
            if slot.tree is None:
                run(_dummy_tree(device), slot, tree_index=None)
                continue
            plan = plans[slot.tree]
            stats.plans[plan.primitive if plan else "single"] += 1
            logps[slot.tree] = run(trees[slot.tree], slot, tree_index=slot.tree)
    return logps


@contextlib.contextmanager
def _fp32_grad_sums(model):
    """Sum the gradients of ``model``'s bf16/fp16 parameters over the replay's many backwards in float32.

    Each backward's gradient moves into a float32 sum as soon as autograd has accumulated it
    (``register_post_accumulate_grad_hook``) and is written back, rounded once, at the end. Models without
    plain parameters (verl's FSDP2 view, whose sharded gradients FSDP reduce-scatters per backward into
    its float32 accumulators) and ``model`` None (forward only, or the caller's backward) are left alone.
    """
    params = [p for p in (model.parameters() if hasattr(model, "parameters") else ())
              if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
    sums = {p: (p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)) for p in params}

    def move(p):
        sums[p] += p.grad
        p.grad = None

    handles = [p.register_post_accumulate_grad_hook(move) for p in params]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for p in params:
            p.grad = sums[p].to(p.dtype)


def _sum_of_response_losses(loss_fn: LossFn, t: int, rows: list[int], logps: list[torch.Tensor]):
    terms = [loss_fn(t, i, logp) for i, logp in zip(rows, logps)]
    return functools.reduce(operator.add, terms)


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


def _dummy_tree(device) -> ReplayTree:
    """A lock-step dummy: a one-token prompt and one two-token response (so that the decoder runs)."""
    ids = torch.full((2,), PAD_ID, dtype=torch.long, device=device)
    return ReplayTree(prompt=ids[:1], responses=[ids])


class _TreeRun:
    """Phases A-C of one tree slot (see the module docstring)."""

    def __init__(self, model, temperature, stats, on_logits, micro_batch_loss, offload):
        self.base, self.lm_head = model.get_decoder(), model.get_output_embeddings()
        self.temperature, self.stats, self.on_logits = temperature, stats, on_logits
        self.loss = micro_batch_loss
        self.train = micro_batch_loss is not None  # with keep_graph the prompt simply stays in the graph
        self.offload = offload if self.train else None

    def __call__(self, tree: ReplayTree, slot: Slot, *, tree_index: int | None) -> list[torch.Tensor]:
        stats, train = self.stats, self.train
        p = tree.prompt_len
        dummy = tree_index is None

        # Phase A: prefill.
        start = stats.start_timer(tree.prompt.device)
        prefill = PrefillContext()
        with self.offload.saving() if self.offload else contextlib.nullcontext():
            hidden = self.base(input_ids=tree.prompt[None], attention_mask=NO_MASKS, use_cache=False,
                               augtree_ctx=prefill).last_hidden_state
        live_kv = [prefill.kv[layer] for layer in range(len(prefill.kv))]
        live_last = hidden[0, -1].clone()  # a copy: a view would keep all P rows of ``hidden`` alive
        del hidden
        if train:  # dK/dV of many response micro-batches sum in float32 (``_summing_leaf``)
            _check_prompt_graph(live_kv)
            leaf_kv = [(_summing_leaf(k), _summing_leaf(v)) for k, v in live_kv]
            leaf_last = _summing_leaf(live_last)
        else:
            leaf_kv, leaf_last = live_kv, live_last
        stats.stop_timer("prefill_s", start)
        stats.executed_tokens += p

        # Phase B: response micro-batches (and the lock-step dummies after them).
        start = stats.start_timer(tree.prompt.device)
        lengths = tree.response_lens
        out: list[torch.Tensor | None] = [None] * len(lengths)
        for call in range(slot.calls):
            real = call < len(slot.micro_batches)
            rows = slot.micro_batches[call] if real else [0]
            logps = self._score(tree_index, tree, rows, leaf_kv, leaf_last, hooks=real and not dummy)
            if real and not dummy:
                for i, logp in zip(rows, logps):
                    out[i] = logp.detach() if train else logp
            if train:
                loss = self.loss(tree_index, rows, logps) if real and not dummy else None
                if loss is None or not loss.requires_grad:  # a zero loss keeps this rank's backwards in step
                    loss = sum(logp.sum() for logp in logps) * 0.0
                loss.backward()
            stats.micro_batches += 1
        stats.stop_timer("replay_s", start)
        if not dummy:
            stats.logical_tokens += sum(p + r for r in lengths)
            stats.trees += 1

        # Phase C: one delayed prompt backward (every prompt tensor, zeros where nothing flowed back).
        if train:
            start = stats.start_timer(tree.prompt.device)
            roots = [x for kv in live_kv for x in kv] + [live_last]
            leaves = [x for kv in leaf_kv for x in kv] + [leaf_last]
            with self.offload.restoring() if self.offload else contextlib.nullcontext():
                torch.autograd.backward(roots, [leaf.grad_sum.to(root.dtype) if leaf.grad_sum is not None
                                                else torch.zeros_like(root) for root, leaf in zip(roots, leaves)])
            stats.stop_timer("prompt_backward_s", start)
        return out

    def _score(self, t, tree, rows, leaf_kv, leaf_last, *, hooks: bool) -> list[torch.Tensor]:
        """Log-probs (float32 [R_i] each) of responses ``rows`` of ``tree``: one decoder call (at least one
        token per row, so that every call runs every layer) and one LM head call."""
        p, lengths = tree.prompt_len, [tree.response_lens[i] for i in rows]
        rq = max(max(lengths) - 1, 1)  # tokens each row feeds (right padded)
        ids = torch.full((len(rows), rq), PAD_ID, dtype=tree.prompt.dtype, device=tree.prompt.device)
        for b, i in enumerate(rows):
            ids[b, : lengths[b] - 1] = tree.responses[i][:-1]
        positions = torch.arange(p, p + rq, device=ids.device)[None].expand(len(rows), -1)
        hid = self.base(input_ids=ids, position_ids=positions, attention_mask=NO_MASKS, use_cache=False,
                        augtree_ctx=ResponseContext(leaf_kv)).last_hidden_state
        states = torch.cat([torch.cat([leaf_last[None], hid[b, : n - 1]]) for b, n in enumerate(lengths)])
        logits = self.lm_head(states).split(lengths)
        self.stats.executed_tokens += len(rows) * rq
        on_logits = self.on_logits if hooks else None
        return [logps_from_logits(logits[b], tree.responses[i], self.temperature,
                                  on_logits=None if on_logits is None else functools.partial(on_logits, t, i))
                for b, i in enumerate(rows)]


_HELD_LEAVES: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()  # the prompt leaves alive now


def held_prompt_tensors() -> list[torch.Tensor]:
    """The device tensors in-flight prompts hold between their prefill and their delayed backward: each
    prompt leaf (K/V, last hidden state) and its float32 gradient sum. For memory meters (``UnshardedGroups``);
    tensors may share storage with each other or with saved activations."""
    held = []
    for leaf in list(_HELD_LEAVES):
        held.append(leaf)
        if leaf.grad_sum is not None:
            held.append(leaf.grad_sum)
    return held


def _summing_leaf(x: torch.Tensor) -> torch.Tensor:
    """A leaf sharing ``x``'s storage whose gradients, one per backward, are summed in float32 into
    ``leaf.grad_sum`` (None until the first): autograd's own ``.grad`` would sum them in ``x``'s dtype.
    Registered in ``held_prompt_tensors`` while alive."""
    leaf = x.detach().requires_grad_()
    leaf.grad_sum = None
    _HELD_LEAVES.add(leaf)

    def move(t: torch.Tensor) -> None:
        t.grad_sum = t.grad.float() if t.grad_sum is None else t.grad_sum.add_(t.grad)
        t.grad = None

    leaf.register_post_accumulate_grad_hook(move)
    return leaf


def _check_prompt_graph(live_kv) -> None:
    if not live_kv[0][0].requires_grad:
        raise ValueError(
            "the prompt K/V carry no autograd graph: reentrant activation checkpointing (use_reentrant=True) "
            "hides them; enable checkpointing with use_reentrant=False (transformers' default)")
