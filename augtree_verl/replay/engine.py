"""``replay``: the grouped replay of one step (docs/design.md §2-3), one device or context-parallel.

The choice happens once, here: without a mesh every tree runs on this device (``tree_run``); with one
(``cp.mesh.CPMesh``), each tree runs on the rank or the subgroup its degree and placement give it,
context-parallel trees through ``cp_tree``, and every response's scores are then shared over the CP group.
Either way the step is a list of slots (``schedule``), each one prefill into a ``PromptKV``, response
calls with their losses and backwards, and one delayed prompt backward; with ``lockstep_group`` every rank
of it issues the same sequence of calls (FSDP2's per-layer collectives line up).
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Sequence

import torch

from augtree_verl.cp.comm import Meter, all_gather_sum
from augtree_verl.cp.mesh import CPMesh, place_by_workload
from augtree_verl.plan import Plan
from augtree_verl.replay.attention import use_augtree_attention
from augtree_verl.replay.calls import ModelCalls
from augtree_verl.replay.cp_tree import LOGP_EXCHANGE, CPTreeRun
from augtree_verl.replay.linear_state import refuse_cp_plans
from augtree_verl.replay.schedule import tree_schedule
from augtree_verl.replay.scoring import EntropyFn
from augtree_verl.replay.stats import ReplayStats
from augtree_verl.replay.tree import ReplayTree
from augtree_verl.replay.tree_run import run_tree

LossFn = Callable[[int, int, torch.Tensor], torch.Tensor]
# micro_batch_loss(t, rows, scores): the loss of tree t's response micro-batch ``rows`` (response indices),
# scores[b] [R_rows[b]] (or [R, 2] with ``entropy_fn``) attached to the graph; None or a tensor without grad
# contributes nothing. On a CP tree it is evaluated identically on every member of the step's ring.
MicroBatchLossFn = Callable[[int, list[int], list[torch.Tensor]], "torch.Tensor | None"]
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
    entropy_fn: EntropyFn | None = None,
    micro_batch_loss: MicroBatchLossFn | None = None,
    mesh: CPMesh | None = None,
    placement: Sequence[int] | None = None,
    lockstep_group=None,
    offload=None,
) -> list[list[torch.Tensor]]:
    """Score (and, with a loss, backpropagate) every response of every tree.

    Returns ``scores[t][i]``: float32 [R_i] log-probs, or [R_i, 2] (log-prob, entropy) with ``entropy_fn``
    (tempered float32 logits [N, V] -> entropy [N]), detached. With ``loss_fn(t, i, scores_ti) -> scalar``,
    every parameter's ``.grad`` grows by the gradient of sum_{t,i} loss_fn(t, i, scores_ti) as the flattened
    baseline computes it (on a CP tree: summed over the members of its subgroup). Without a loss, runs
    forward only under ``torch.no_grad``. ``micro_batch_loss(t, rows, scores)`` (instead of ``loss_fn``):
    one loss per response micro-batch (one device) or CP step, for losses evaluated on a batch of rows at
    once (verl's); same gradient contract.
    ``plans``: one ``Plan`` (or None) per tree; a plan with degree d > 1 runs context-parallel on d ranks.
    ``mesh`` and ``placement``: the CP group facts and, per tree, the subgroup (of its plan's degree; a CP
    rank for degree 1) it runs on; every rank of the CP group passes the same trees, plans and placement,
    and gets every response's scores. Without a mesh, plans of degree > 1 run over the whole world (every
    tree's degree must then be 1 or the world size; degree-1 trees are placed by ``tree_workload``).
    ``lockstep_group``: a process group whose ranks all call ``replay`` together on one FSDP2-sharded
    model; every rank then issues the same sequence of model calls and backwards (``schedule``).
    ``offload`` (``replay.offload.Offload``; training only, ignored forward only): each prompt's saved
    activations wait in host memory between its prefill forward and its delayed backward (``PromptKV``
    enters ``offload.saving()`` and ``offload.restoring()`` around them); on CP, each rank's own shard.
    """
    trees = list(trees)
    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().num_embeddings
    for t, tree in enumerate(trees):
        tree.validate(t, vocab, device)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    plans = _check_plans(plans, trees)
    refuse_cp_plans(model.config, plans)
    if loss_fn is not None and micro_batch_loss is not None:
        raise ValueError("pass one of loss_fn and micro_batch_loss, not both")
    if loss_fn is not None:
        micro_batch_loss = functools.partial(_sum_of_response_losses, loss_fn)
    if mesh is None and any(plan is not None and plan.degree > 1 for plan in plans):
        mesh = _world_mesh()
    if mesh is not None:
        placement = _check_placement(mesh, plans, placement, trees, model)
    stats = stats if stats is not None else ReplayStats()
    calls = ModelCalls(model, temperature=temperature, stats=stats, entropy_fn=entropy_fn,
                       micro_batch_loss=micro_batch_loss, offload=offload)
    cp_runs = {d: CPTreeRun(calls, mesh.group_of(d)) for d in mesh.subgroups} if mesh is not None else {}
    scores: list[list[torch.Tensor] | None] = [None] * len(trees)
    reported: set[int] = set()  # trees this rank counts and reports: one rank (a subgroup's first) per tree
    use_augtree_attention(model)
    with torch.set_grad_enabled(calls.train), _fp32_grad_sums(model if calls.train else None):
        for slot in tree_schedule(trees, plans, micro_batch_tokens, mesh=mesh, placement=placement,
                                  group=lockstep_group, device=device):
            if slot.tree is None:  # a dummy slot: prefill, calls, prompt backward
                calls.finish_slot(calls.dummy_prompt(), 0, slot.calls, stats.start_timer(device))
                continue
            t, plan = slot.tree, plans[slot.tree]
            if slot.degree == 1:
                scores[t] = run_tree(calls, t, trees[t], slot)
            else:
                scores[t] = cp_runs[slot.degree](t, trees[t], plan, slot)
            if slot.degree == 1 or mesh.subgroup_rank(slot.degree) == 0:
                reported.add(t)
                stats.logical_tokens += sum(trees[t].prompt_len + r for r in trees[t].response_lens)
                stats.trees += 1
                stats.plans[plan.primitive if plan else "single"] += 1
    if mesh is None:
        return scores
    return _share(trees, scores, reported, mesh, width=1 if entropy_fn is None else 2, stats=stats)


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


def _sum_of_response_losses(loss_fn: LossFn, t: int, rows: list[int], scores: list[torch.Tensor]):
    terms = [loss_fn(t, i, s) for i, s in zip(rows, scores)]
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


def _world_mesh() -> CPMesh:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise ValueError("context-parallel replay (a plan with degree > 1) needs torch.distributed initialised")
    return CPMesh.whole_world()


def _check_placement(mesh: CPMesh, plans, placement, trees, model) -> list[int]:
    degrees = [plan.degree if plan is not None else 1 for plan in plans]
    for t, d in enumerate(degrees):
        if d > 1 and d not in mesh.subgroups:
            raise ValueError(f"tree {t}: plan degree {d} differs from the CP group size {mesh.cp_size} "
                             f"(CP degrees here: {list(mesh.degrees)})")
    if any(d > 1 for d in degrees) and model.training and getattr(model.config, "attention_dropout", 0.0):
        raise ValueError(f"attention_dropout={model.config.attention_dropout} is not supported by the CP replay")
    if placement is None:
        return place_by_workload(trees, degrees, mesh.cp_size)
    placement = list(placement)
    if len(placement) != len(trees):
        raise ValueError(f"got {len(placement)} placements for {len(trees)} trees")
    for t, (d, s) in enumerate(zip(degrees, placement)):
        if not 0 <= s < mesh.cp_size // d:
            raise ValueError(f"tree {t}: placement {s} outside the {mesh.cp_size // d} subgroups of degree {d}")
    return placement


def _share(trees, scores, reported: set[int], mesh: CPMesh, *, width: int,
           stats: ReplayStats) -> list[list[torch.Tensor]]:
    """Every response's scores on every rank of the CP group: the rank that ran a tree (the first member of
    its subgroup) contributes it to a zero-filled buffer summed over the group (exact: one non-zero term
    per entry)."""
    slots = [(t, i) for t, tree in enumerate(trees) for i in range(len(tree.responses))]
    lens = [trees[t].response_lens[i] for t, i in slots]
    offsets = [sum(lens[:k]) for k in range(len(slots))]
    device = trees[0].prompt.device if trees else torch.device("cpu")
    buffer = torch.zeros(sum(lens), width, dtype=torch.float32, device=device)
    for (t, i), offset, n in zip(slots, offsets, lens):
        if t in reported:
            buffer[offset: offset + n] = scores[t][i].reshape(n, width)
    if mesh.cp_size > 1:
        buffer = all_gather_sum(buffer, tuple(range(mesh.cp_size)), mesh.cp_group, Meter(stats, LOGP_EXCHANGE))
    out = [[None] * len(tree.responses) for tree in trees]
    for (t, i), offset, n in zip(slots, offsets, lens):
        value = buffer[offset: offset + n]
        out[t][i] = value[:, 0] if width == 1 else value
    return out
