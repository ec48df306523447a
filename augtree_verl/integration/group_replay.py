"""One replay of a set of trees by a CP group whose ranks all hold the same trees (see ``cp_mesh``).

Each tree runs once in the group: on one rank (plans of degree 1 and trees without a plan), or
context-parallel on a subgroup (``replay_cp``). Afterwards every rank of the group holds every response's
values (an exact zero-filled sum over the group), so every rank evaluates verl's loss on the whole
micro-batch, with the same value. Training gradients are split so that they add up over the group:

- a tree replayed on this rank keeps its graph (``replay(keep_graph=True)``): the loss's backward on this
  rank is that tree's whole gradient, and the other ranks see its values as constants;
- a context-parallel tree becomes a leaf on each member of its subgroup; the loss's backward fills the
  leaf's gradient g (the same on every member), and ``finish`` runs the tree's queued backward
  (``PendingBackward``) with g, in which each member backpropagates the tokens it owns.

Summed over the group's ranks, the parameter gradients are the gradient of the loss. (The engine scales
the loss by the group size: FSDP averages gradients over all ranks, and a CP group is one data-parallel
rank.)
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from augtree_verl.cp.comm import Meter, all_gather_sum
from augtree_verl.cp.engine import LOGP_EXCHANGE, PendingBackward, replay_cp
from augtree_verl.integration.cp_mesh import CPMesh
from augtree_verl.plan import Plan
from augtree_verl.replay import ReplayStats, ReplayTree, replay

Slot = tuple[int, int]  # (tree, response)
Scores = tuple[torch.Tensor, "torch.Tensor | None"]  # (log-probs [R], entropies [R] or None)


def replay_in_group(model, mesh: CPMesh, trees: Sequence[ReplayTree], plans: Sequence[Plan | None],
                    placement: Sequence[int], *, temperature: float, micro_batch_tokens: int, stats: ReplayStats,
                    train: bool, entropy_fn: Callable[[torch.Tensor], torch.Tensor] | None
                    ) -> tuple[dict[Slot, Scores], Callable]:
    """Returns ``(scores, finish)``: ``scores[(t, i)]`` for every response of every tree, on every rank of the
    group (attached to a graph as the module docstring says, when ``train``), and ``finish()``, which runs
    the context-parallel trees' backward; call it on every rank after the loss's backward. The CP replays'
    stats reach ``stats`` after their backward (forward-only: at once). ``placement[t]``: the subgroup (of
    the plan's degree; a rank for trees without a plan or with a degree-1 plan) tree t runs on."""
    degrees = [plan.degree if plan is not None else 1 for plan in plans]
    owner = [placement[t] * degrees[t] for t in range(len(trees))]  # the CP rank that reports the tree's values
    width = 1 if entropy_fn is None else 2
    mine: dict[Slot, torch.Tensor] = {}  # [R, width] values of the trees this rank reports (graph if local)
    graphs: dict[Slot, Scores] = {}      # log-probs / entropies of this rank's single-device trees

    local = [t for t in range(len(trees)) if degrees[t] == 1 and placement[t] == mesh.cp_rank]
    if local:
        entropies = {}
        logps = replay(model, [trees[t] for t in local], plans=[plans[t] for t in local], temperature=temperature,
                       micro_batch_tokens=micro_batch_tokens, stats=stats, keep_graph=train,
                       on_logits=None if entropy_fn is None else
                       lambda t, i, logits: entropies.__setitem__((local[t], i), entropy_fn(logits)))
        for t, row in zip(local, logps):
            for i, logp in enumerate(row):
                graphs[(t, i)] = (logp, entropies.get((t, i)))
                mine[(t, i)] = torch.stack([x.detach() for x in graphs[(t, i)] if x is not None], dim=-1)

    # per replay_cp call: its queued backward (None forward-only), its trees, its stats, whether to count them
    queued: list[tuple[PendingBackward | None, list[int], ReplayStats, bool]] = []
    for d in sorted(mesh.subgroups, reverse=True):
        ids = [t for t in range(len(trees)) if degrees[t] == d and placement[t] == mesh.subgroup_index(d)]
        if not ids:
            continue
        pending = PendingBackward() if train else None
        cp_stats = ReplayStats()
        values = replay_cp(model, [trees[t] for t in ids], None, [plans[t] for t in ids], temperature=temperature,
                           stats=cp_stats, group=mesh.subgroups[d], entropy_fn=entropy_fn, pending=pending)
        for t, row in zip(ids, values):
            for i, v in enumerate(row):
                mine[(t, i)] = v.reshape(v.shape[0], width)
        queued.append((pending, ids, cp_stats, mesh.cp_rank % d == 0))  # the subgroup's first member counts trees

    shared = _share(trees, mine, owner, mesh, width, stats)
    my_cp_trees = {t for _, ids, _, _ in queued for t in ids}
    scores: dict[Slot, Scores] = {}
    leaves: dict[Slot, torch.Tensor] = {}
    for slot, values in shared.items():
        if slot in graphs:
            scores[slot] = graphs[slot]
            continue
        if train and slot[0] in my_cp_trees:
            values = leaves[slot] = values.clone().requires_grad_()
        scores[slot] = (values[:, 0], values[:, 1] if width == 2 else None)

    def finish() -> None:
        if not train:
            return
        for pending, ids, cp_stats, count_trees in queued:
            def loss_fn(t, i, values, ids=ids):
                leaf = leaves[(ids[t], i)]
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                return (grad.reshape(values.shape) * values).sum()
            pending.run(loss_fn)
            stats.add(cp_stats, count_trees=count_trees)

    if not train:
        for _, _, cp_stats, count_trees in queued:
            stats.add(cp_stats, count_trees=count_trees)
    return scores, finish


def _share(trees, mine: dict[Slot, torch.Tensor], owner: list[int], mesh: CPMesh, width: int,
           stats: ReplayStats) -> dict[Slot, torch.Tensor]:
    """Every response's [R, width] values on every rank of the CP group: each tree's owner contributes it to
    a zero-filled buffer summed over the group (exact: one non-zero term per entry)."""
    slots = [(t, i) for t, tree in enumerate(trees) for i in range(len(tree.responses))]
    lens = [trees[t].response_lens[i] for t, i in slots]
    offsets = [sum(lens[:k]) for k in range(len(slots))]
    device = trees[0].prompt.device if trees else torch.device("cpu")
    buffer = torch.zeros(sum(lens), width, dtype=torch.float32, device=device)
    for (t, i), offset, n in zip(slots, offsets, lens):
        if owner[t] == mesh.cp_rank:
            buffer[offset: offset + n] = mine[(t, i)].detach()
    if mesh.cp_size > 1:
        buffer = all_gather_sum(buffer, tuple(range(mesh.cp_size)), mesh.cp_group, Meter(stats, LOGP_EXCHANGE))
    return {slot: buffer[offset: offset + n] for slot, offset, n in zip(slots, offsets, lens)}
