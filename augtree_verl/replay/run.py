"""``replay(model, step_plan, loss)``: the grouped replay of one step (docs/design.md §2-3), one device or CP.

A ``StepPlan`` (``replay.step_plan``) has decided everything before the first model call: the trees, their
plans, which subgroup of the CP group runs each tree, and this rank's lock-step slots. ``replay`` runs the
slots: without a mesh every tree on this device, as the tries of the step's rows (``trie``, ``tree_run``:
shared prefixes found from the tokens, a group is a depth-1 trie); with one (``cp.mesh.CPMesh``), each tree
on its subgroup, context-parallel trees through ``cp_tree``, the others as the tries of each rank's own, and
every response's scores are then shared over the CP group (``cp_tree.exchange_scores``). Each slot is one
prefill into a ``PromptKV`` per trie node, response calls with their losses and backwards, and one delayed
prompt backward per node; with a length-dependent rope, all of them with the frequencies of the slot's trees'
regime (``rope.pinned``).
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable

import torch

from augtree_verl.cp.comm import Meter
from augtree_verl.replay.attention import use_augtree_attention
from augtree_verl.replay.calls import ModelCalls, image_prefill
from augtree_verl.replay.cp_tree import SCORE_EXCHANGE, CPTreeRun, exchange_scores
from augtree_verl.replay.cp_trie import CPTrieRun
from augtree_verl.replay.linear_state import refuse_cp_plans
from augtree_verl.replay.lockstep import CPTreeSlot, CPTrieSlot, DummySlot, TrieSlot
from augtree_verl.replay.options import ReplayOptions
from augtree_verl.replay.rope import RopeRegimes, caller_loss, in_caller_trees, pinned
from augtree_verl.replay.step_plan import StepPlan
from augtree_verl.replay.tree_run import TrieRun

LossFn = Callable[[int, int, torch.Tensor], torch.Tensor]
# loss(t, rows, scores): the loss of tree t's responses ``rows`` (response indices) in one micro-batch,
# scores[b] [R_rows[b]] (or [R, 2] with an entropy_fn) attached to the graph; None or a tensor without grad
# contributes nothing. A trie's micro-batch may hold rows of several trees: one call per tree, summed; rows
# that end inside a trie node get theirs before its delayed backward. On a CP tree it is evaluated
# identically on every member of the step's ring.
MicroBatchLossFn = Callable[[int, list[int], list[torch.Tensor]], "torch.Tensor | None"]


def replay(
    model, step_plan: StepPlan, loss: MicroBatchLossFn | None = None, options: ReplayOptions | None = None
) -> list[list[torch.Tensor]]:
    """Score (and, with a loss, backpropagate) every response of every tree of ``step_plan``, as ``options``
    (``ReplayOptions``: temperature, entropy, offload, where to count; default: temperature 1, no entropy, no
    offload, a new ``ReplayStats``) say.

    Returns ``scores[t][i]``: float32 [R_i] log-probs, or [R_i, 2] (log-prob, entropy) with ``options.entropy_fn``,
    detached. With ``loss(t, rows, scores)`` (one loss per response micro-batch on one
    device, per CP step on a CP tree; ``per_response`` makes one from a loss per response), every
    parameter's ``.grad`` grows by the gradient of the sum of the losses as the flattened baseline computes
    it (on a CP tree: summed over the members of its subgroup). Without a loss, runs forward only under
    ``torch.no_grad``. With a mesh, every rank of the CP group gets every response's scores. Trees and
    responses are the ones ``step_plan`` was built with (where it split a tree by rope regime, its ``origin``
    maps them back); ``ValueError`` where it was built for other rope regimes than the model's.
    """
    options = options if options is not None else ReplayOptions()
    regimes = RopeRegimes.of(model.config)
    if step_plan.rope != regimes:
        raise ValueError(
            f"the step plan was built for rope regimes {step_plan.rope} but the model's rope has {regimes}: build it "
            f"with StepPlan.build(..., rope=RopeRegimes.of(model.config)) (augtree_verl.replay.rope)"
        )
    loss = caller_loss(loss, step_plan.origin)
    trees = step_plan.trees
    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().num_embeddings
    for t, tree in enumerate(trees):
        tree.check_tokens(t, vocab, device)
    check_images(model, trees)
    refuse_cp_plans(model.config, step_plan.plans)
    mesh, stats = step_plan.mesh, options.stats
    dropout = getattr(model.config, "attention_dropout", None)
    if mesh is not None and any(p is not None and p.degree > 1 for p in step_plan.plans) and model.training and dropout:
        raise ValueError(f"attention_dropout={dropout} is not supported by the CP replay")
    if mesh is None or mesh.cp_rank == 0:  # the plan's demotions; every rank of a CP group decides alike: one counts
        stats.trie_demoted += step_plan.trie_demoted
        stats.rope_splits += step_plan.rope_splits
        stats.vision_cp_demoted += step_plan.vision_cp_demoted
    calls = ModelCalls(
        model,
        temperature=options.temperature,
        stats=stats,
        entropy_fn=options.entropy_fn,
        micro_batch_loss=loss,
        offload=options.offload,
    )
    trie_run = TrieRun(calls, trees)
    cp_runs = {d: CPTreeRun(calls, mesh.group_of(d)) for d in mesh.groups} if mesh is not None else {}
    cp_trie_runs = {d: CPTrieRun(trie_run, ring) for d, ring in cp_runs.items()}
    scores: list[list[torch.Tensor] | None] = [None] * len(trees)
    reported: set[int] = set()  # CP trees whose scores this rank reports: one rank (a subgroup's first) per tree
    use_augtree_attention(model)
    with torch.set_grad_enabled(calls.train), _fp32_grad_sums(model if calls.train else None):
        for slot in step_plan.slots:
            # a slot's trees share one rope length (a trie never mixes them, ``replay.trie``); a dummy: none
            with pinned(model, trees[slot.trees[0]].rope_len if slot.trees else None):
                match slot:
                    case TrieSlot() | DummySlot():  # a trie of this rank's trees, or padding
                        trie_run(slot)
                        mine = slot.trees
                    case CPTrieSlot():  # a trie whose root runs context-parallel: each row on one member
                        cp_trie_runs[slot.degree](slot)
                        stats.cp_roots += slot.share.member == 0
                        mine = slot.trees if slot.share.member == 0 else []
                    case CPTreeSlot():
                        scores[slot.tree] = cp_runs[slot.degree](trees[slot.tree], step_plan.plans[slot.tree], slot)
                        mine = slot.trees if mesh.subgroup_rank(slot.degree) == 0 else []
                        reported.update(mine)
            for t in mine:  # counted on one rank per tree
                stats.logical_tokens += sum(trees[t].prompt_len + r for r in trees[t].response_lens)
                stats.trees += 1
                stats.vision_trees += trees[t].vision is not None
                stats.plans[step_plan.plans[t].primitive if step_plan.plans[t] else "single"] += 1
    for (t, i), value in trie_run.scores.items():
        if scores[t] is None:
            scores[t] = [None] * len(trees[t].responses)
        scores[t][i] = value
    if mesh is None:
        return in_caller_trees(scores, step_plan.origin)
    owned = {(t, i) for t in reported for i in range(len(trees[t].responses))} | set(trie_run.scores)
    shared = _share(step_plan, scores, owned, device, stats, width=None if options.entropy_fn is None else 2)
    return in_caller_trees(shared, step_plan.origin)


def check_images(model, trees) -> None:
    """``ValueError`` naming the first of ``trees`` with images that ``model`` cannot run (``vlm.ImagePrefill.check``:
    not a vision-language model of ``vlm.VLMS``, or image tokens that are not its grids' merged patches)."""
    images = [(t, tree) for t, tree in enumerate(trees) if tree.vision is not None]
    if not images:
        return
    prefill = image_prefill(model)
    for t, tree in images:
        if prefill is None:
            raise ValueError(
                f"tree {t} (uid {tree.uid!r}, batch rows {list(tree.samples)}) has images, but the model is not a "
                "vision-language model"
            )
        prefill.check(t, tree)


def per_response(loss_fn: LossFn) -> MicroBatchLossFn:
    """A micro-batch loss from ``loss_fn(t, i, scores_ti) -> scalar``, one loss per response: their sum."""
    return functools.partial(_sum_of_response_losses, loss_fn)


@contextlib.contextmanager
def _fp32_grad_sums(model):
    """Sum the gradients of ``model``'s bf16/fp16 parameters over the replay's many backwards in float32.

    Each backward's gradient moves into a float32 sum as soon as autograd has accumulated it
    (``register_post_accumulate_grad_hook``) and is written back, rounded once, at the end. Models without
    plain parameters (verl's FSDP2 view, whose sharded gradients FSDP reduce-scatters per backward into
    its float32 accumulators) and ``model`` None (forward only, or the caller's backward) are left alone.
    """
    params = [
        p
        for p in (model.parameters() if hasattr(model, "parameters") else ())
        if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)
    ]
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


def _sum_of_response_losses(loss_fn: LossFn, t: int, rows: list[int], scores: list[torch.Tensor]):
    terms = [loss_fn(t, i, s) for i, s in zip(rows, scores)]
    return functools.reduce(operator.add, terms)


def _share(
    step_plan: StepPlan, scores, owned_rows: set, device, stats, *, width: int | None
) -> list[list[torch.Tensor]]:
    """Every response's scores on every rank of the CP group (``exchange_scores``): ``owned_rows`` holds the
    (tree, response) rows whose scores this rank owns (each row's are owned by one rank: a CP tree's by the
    first member of its subgroup, a trie's row by the rank that ran it)."""
    trees, mesh = step_plan.trees, step_plan.mesh
    responses = [(t, i) for t, tree in enumerate(trees) for i in range(len(tree.responses))]
    owned = [(k, slice(None), scores[t][i]) for k, (t, i) in enumerate(responses) if (t, i) in owned_rows]
    full = exchange_scores(
        [trees[t].response_lens[i] for t, i in responses],
        owned,
        tuple(range(mesh.cp_size)),
        mesh.cp_group,
        Meter(stats, SCORE_EXCHANGE),
        width=width,
        device=device,
    )
    out: list[list[torch.Tensor]] = [[] for _ in trees]
    for (t, _), value in zip(responses, full):
        out[t].append(value)
    return out
