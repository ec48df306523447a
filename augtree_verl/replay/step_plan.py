"""``StepPlan``: everything one replay step decides before any model call, built once (plan once, run once).

flashinfer's plan/run shape: ``StepPlan.build`` (or ``StepPlan.from_batch``, the engine's, which decodes
the trainer's plan field) takes the trees of the step and fixes

- the trees (``groups.Tree``, with tokens) and one ``Plan`` (or None) per tree; with a length-dependent rope
  (``replay.rope``), each tree's regime, a tree whose rows fall in different regimes split into one per regime;
- the tries of their rows (``replay.trie.StepTrie``: found once, one device-to-host copy of the token ids,
  and read by every decision below);
- the tries whose root runs context-parallel (``cp_roots``: a long shared prefix prefilled once over a
  subgroup, its K/V serving every subtree, ``replay.cp_trie``), chosen by ``shared_root_plans``;
- the subgroups: per tree, the subgroup of the CP group it runs on (``subgroups[t]``, of its plan's
  degree, or its trie's root's; a CP rank for degree 1), chosen by ``assign_subgroups`` unless given;
- the lock-step shape: this rank's slots (``replay.lockstep``: one type per kind of slot), agreed over
  ``lockstep_group``;
- the demotions, by cause (``fallbacks``, ``cp_demoted``, ``trie_demoted``, ``rope_splits``, ``vision_cp_demoted``).

It holds the decision only (frozen): how to run it (temperature, entropy, offload, where to count) is the
``replay.options.ReplayOptions`` that ``replay(model, step_plan, loss, options)`` takes. Every rank of a CP group
builds the same plan from the same trees (the policy reads only the trees and plans, which every member shares).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from augtree_verl.cp.mesh import CPMesh
from augtree_verl.groups import Tree, tree_workload
from augtree_verl.plan import Plan
from augtree_verl.plan_field import tree_plans
from augtree_verl.replay.cp_trie_schedule import cp_trie_refusal
from augtree_verl.replay.linear_state import demote_cp_plans
from augtree_verl.replay.lockstep import Slot, lockstep_slots
from augtree_verl.replay.memory import ReplayMemory, check_memory
from augtree_verl.replay.microbatch import DEFAULT_MICRO_BATCH_TOKENS
from augtree_verl.replay.rope import Origin, RopeRegimes, split_regimes
from augtree_verl.replay.trie import MIN_SHARED_TOKENS, StepTrie, TrieNode
from augtree_verl.replay.vlm import demote_image_plans


@dataclass(frozen=True)
class StepPlan:
    """One step's replay, decided (see the module docstring); build it with ``build`` or ``from_batch``.

    ``trees[t]``: tokens on the model's device; ``plans[t]``: its ``Plan`` or None (one device, no planner);
    ``mesh``: the CP group facts (None: every tree on this device); ``subgroups[t]``: the subgroup tree t runs
    on (with a mesh); ``slots``: this rank's lock-step sequence; ``fallbacks``: trees whose planned plan
    could not apply here (``plan_field.tree_plans``); ``cp_demoted``: trees whose context-parallel plan runs on
    one device because the model cannot run it (``linear_state.demote_cp_plans``); ``cp_roots``: (root,
    degree) of the tries whose root runs context-parallel (their trees' plans are not run); ``rope``: the
    model's rope regimes the trees were split by (``rope.split_regimes``); ``vision_cp_demoted``: trees with images
    whose context-parallel plan runs on one device (``vlm.demote_image_plans``); ``origin``: where a tree was split,
    each tree's (given tree, its responses), which ``replay`` reports scores and calls losses by.
    """

    trees: list[Tree]
    plans: list[Plan | None]
    slots: list[Slot]
    mesh: CPMesh | None = None
    cp_roots: list[tuple[TrieNode, int]] = field(default_factory=list)
    subgroups: list[int] | None = None
    fallbacks: int = 0
    cp_demoted: int = 0
    trie_demoted: int = 0
    rope_splits: int = 0
    vision_cp_demoted: int = 0
    rope: RopeRegimes | None = None
    origin: Origin | None = None

    @classmethod
    def build(
        cls,
        trees: Sequence[Tree],
        *,
        plans: Sequence[Plan | None] | None = None,
        mesh: CPMesh | None = None,
        subgroups: Sequence[int] | None = None,
        rebalance: bool = False,
        micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
        min_shared_tokens: int = MIN_SHARED_TOKENS,
        lockstep_group=None,
        device: torch.device | None = None,
        trie: StepTrie | None = None,
        cp_alone: bool = False,
        trie_cost: TrieCost | None = None,
        memory: ReplayMemory | None = None,
        rope: RopeRegimes | None = None,
    ) -> StepPlan:
        """The plan of one step; ``ValueError`` naming the tree, plan or value on bad input.

        ``trees``: ``Tree.of_tokens`` trees. ``plans``: one ``Plan`` (or None) per tree; a plan of degree
        d > 1 runs context-parallel on d ranks of ``mesh`` (without a mesh, over the whole world: every
        degree must then be 1 or the world size). ``subgroups``: per tree, its subgroup (default:
        ``assign_subgroups``; ``rebalance`` lets it run trees on one rank each where that finishes the CP
        group sooner, which needs the planner's estimates). ``micro_batch_tokens``: the token budget of a
        one-device response micro-batch. ``min_shared_tokens``: the token passes a trie node below a prompt must
        save to get its own call (``replay.trie``). ``lockstep_group``: a process group whose ranks all replay
        together on one FSDP2-sharded model; every rank then issues the same sequence of model calls and
        backwards (agreed here with two int64 all-reduces on ``device``, default the trees' device). ``trie``: the
        ``StepTrie`` of ``trees`` with ``min_shared_tokens`` where the caller found it already (``from_batch``);
        default: found here. A tree whose trie is more than its own group runs in its trie, whatever its
        plan: where one of the trie's trees has a plan of degree d > 1, with its root context-parallel over
        d ranks, or on one device where the root cannot (``shared_root_plans``, counted in
        ``trie_demoted``). ``cp_alone``: instead, a plan of degree > 1 runs its tree alone, sharing nothing
        beyond it (``augtree bench``'s MegaN and MegaR baselines). ``trie_cost``: the planner's cost model
        (``TrieCost``); with it and a mesh, a trie whose trees have no CP plan but which would be cut into chunks
        over several ranks (a batch-wide system prompt) runs with its root context-parallel where that is
        predicted sooner (``shared_root_plans``). ``memory`` (``replay.memory.ReplayMemory``): refuse, on every
        rank of ``lockstep_group`` at once, a step whose slots need more than its budget (``check_memory``).
        ``rope``: the model's ``rope.RopeRegimes`` (``RopeRegimes.of(model.config)``; ``replay`` refuses a plan
        built with others): each tree runs in the regime of its rows' stock-engine calls (``Tree.call_lens``), a
        tree whose rows fall in several split into one tree per regime (``rope.split_regimes``, counted in
        ``rope_splits``); the plan's ``trees`` are then the split ones, and ``replay`` reports by the given.
        """
        trees = list(trees)
        for t, tree in enumerate(trees):
            tree.check_tokens(t, device=device)
            device = tree.prompt.device  # every tree on one device (``device``, or the first tree's)
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        if min_shared_tokens < 0:
            raise ValueError(f"min_shared_tokens must be >= 0, got {min_shared_tokens}")
        plans, vision_cp_demoted = demote_image_plans(trees, _check_plans(plans, trees))
        trees, plans, origin, rope_splits = split_regimes(trees, plans, rope)
        if trie is None:
            trie = StepTrie(trees, min_shared_tokens=min_shared_tokens, micro_batch_tokens=micro_batch_tokens)
        elif len(trie.trees) != len(trees) or any(a is not b for a, b in zip(trie.trees, trees)):
            raise ValueError(f"the trie given was found for other trees ({len(trie.trees)}) than these ({len(trees)})")
        elif (trie.min_shared_tokens, trie.micro_batch_tokens) != (min_shared_tokens, micro_batch_tokens):
            raise ValueError(
                f"the trie given was found with min_shared_tokens={trie.min_shared_tokens} and micro_batch_tokens="
                f"{trie.micro_batch_tokens}, the plan asks for {min_shared_tokens} and {micro_batch_tokens}"
            )
        plans, cp_roots, shared = (
            shared_root_plans(
                trees,
                plans,
                trie=trie,
                cost=trie_cost,
                degrees=mesh.degrees if mesh is not None else (1,),
            )
            if not cp_alone
            else (plans, [], 0)
        )
        if mesh is None and (cp_roots or any(plan is not None and plan.degree > 1 for plan in plans)):
            mesh = _world_mesh()
        if mesh is not None:
            plans, subgroups = _check_subgroups(mesh, plans, subgroups, trie, rebalance, cp_roots)
        elif subgroups is not None:
            raise ValueError("subgroups place trees in a CP group: pass a mesh or a plan of degree > 1")
        if device is None:
            device = torch.device("cpu")
        slots = lockstep_slots(
            trie,
            plans,
            mesh=mesh,
            subgroups=subgroups,
            cp_roots=cp_roots,
            group=lockstep_group,
            device=device,
        )
        if memory is not None:
            check_memory(memory, slots, trees, group=lockstep_group, device=device)
        return cls(
            trees=trees,
            plans=plans,
            slots=slots,
            mesh=mesh,
            cp_roots=cp_roots,
            subgroups=subgroups,
            trie_demoted=shared,
            rope_splits=rope_splits,
            vision_cp_demoted=vision_cp_demoted,
            rope=rope,
            origin=origin,
        )

    @classmethod
    def from_batch(
        cls,
        trees: Sequence[Tree],
        entries: Sequence[dict] | None,
        *,
        mesh: CPMesh | None,
        model_config,
        min_cp_tokens: int = 0,
        **options,
    ) -> StepPlan:
        """The engine's plan: ``trees`` of a batch (``Tree.samples``: rows of the batch) with the trainer's
        plans decoded from the batch's plan field (``entries[row]``, ``plan_field.PLAN_FIELD``; None: no
        plans), demoted where they cannot apply here (counted in ``fallbacks``) or where the model
        (``model_config``: its Hugging Face config) cannot run them context-parallel (counted in
        ``cp_demoted``); a tree that shares tokens beyond its own prompt with others runs in its trie
        (``build``); placed with ``rebalance``; split by the model's rope regimes (``build``'s ``rope``).
        ``mesh``: the engine's (its degrees are the ones a plan may have). ``options``: those of ``build``."""
        degrees = mesh.degrees if mesh is not None else (1,)
        plans, fallbacks = tree_plans(trees, entries, degrees, min_cp_tokens=min_cp_tokens)
        plans, cp_demoted = demote_cp_plans(model_config, plans)
        step_plan = cls.build(
            trees,
            plans=plans,
            mesh=mesh if mesh is not None and mesh.cp_size > 1 else None,
            rebalance=True,
            rope=RopeRegimes.of(model_config),
            **options,
        )
        return dataclasses.replace(step_plan, fallbacks=fallbacks, cp_demoted=cp_demoted)


class TrieCost(Protocol):
    """What the step plan asks of the planner's cost model (``planner.cost.CostModel``), in seconds."""

    def trie(self, node: TrieNode) -> float: ...  # a trie on one device

    def node_prefill(self, node: TrieNode) -> float: ...  # one node's prefill on one device

    def cp_trie(self, root: TrieNode, degree: int) -> float: ...  # a trie with a context-parallel root


def shared_root_plans(
    trees: Sequence[Tree],
    plans: Sequence[Plan | None],
    *,
    trie: StepTrie | None = None,
    cost: TrieCost | None = None,
    degrees: Sequence[int] = (1,),
) -> tuple[list[Plan | None], list[tuple[TrieNode, int]], int]:
    """(plans, cp_roots, demoted) for the tries that are more than one tree's group (``replay.trie``: a tree
    whose prompt shares tokens with another tree's rows, or whose responses share a node). A context-parallel
    plan runs one tree, so where the planner gave a tree of such a trie a plan of degree d > 1 (the largest
    such d), the trie runs whole with its root context-parallel over d ranks (``cp_roots``: (root, d);
    ``replay.cp_trie``) where its root can (``cp_trie_refusal``) and, with ``cost``, at the degree it finds
    sooner than the trie's chunks (below); else on one device: each plan of degree > 1 replaced by the one-device plan
    carrying its one-rank estimate (``demoted`` counts those). ``trie``: the ``StepTrie`` of ``trees`` (default:
    found here, default thresholds).

    ``cost``: the planner's cost model, which searches the root's degree. The alternative to a context-parallel
    root over d ranks is the trie's trees cut into chunks over d ranks (``pack_subgroups``), each chunk
    prefilling the root again: the root's prefill plus the rest of the trie in the share of the most loaded
    rank (the trees dealt by their work, heaviest first). The candidates are the largest planned degree of the
    trie's trees and every degree d <= k of ``degrees`` (the CP degrees), where the trie's work fills k ranks
    (its share of the step's work times the CP group's size; ``pack_subgroups`` would cut it over k >= 2); the
    trie gets the candidate whose root is predicted the most below its chunks, none where no candidate is below
    them (an unplanned trie lighter than two ranks' share has no candidate). The leaves are micro-batched as the
    trie's nodes say (``StepTrie.micro_batch_tokens``), as the lock-step runs them."""
    out, cp_roots, demoted = list(plans), [], 0
    roots = (trie if trie is not None else StepTrie(trees)).roots
    work: list[int] | None = None  # each tree's, where a cost model needs it
    for root in roots:
        members = root.trees()
        degree = max(p.degree if (p := plans[t]) is not None else 1 for t in members)
        alone = len(members) == 1 and root.depth() == 1 and root.end == trees[members[0]].prompt_len
        if alone or trees[members[0]].vision is not None or (degree == 1 and (cost is None or max(degrees) == 1)):
            continue
        if cp_trie_refusal(root) is not None:
            chosen = 1
        elif cost is None:
            chosen = degree
        else:
            if work is None:
                work = [tree_workload(tree.prompt_len, tree.response_lens) for tree in trees]
            works = [work[t] for t in members]
            fills = sum(works) * max(degrees) / sum(work)  # the ranks the trie's work fills
            candidates = [d for d in degrees if 1 < d and (d == degree or d <= fills)]
            chosen = _root_degree(root, cost, candidates, works)
        if chosen > 1:
            cp_roots.append((root, chosen))
            continue
        for t in members:
            if (p := plans[t]) is not None and p.degree > 1:
                out[t], demoted = Plan(est_time_s=p.est_single_s), demoted + 1
    return out, cp_roots, demoted


def _root_degree(root: TrieNode, cost: TrieCost, candidates: Sequence[int], works: list[int]) -> int:
    """The degree d of ``candidates`` at which ``root``'s trie (its trees' ``tree_workload``: ``works``) with a
    context-parallel root is predicted the most below its chunks over d ranks; 1 where none is."""
    if not candidates:
        return 1
    whole, prefill = cost.trie(root), cost.node_prefill(root)
    best, chosen = 1.0, 1
    for d in candidates:
        busiest = _pack(list(map(float, works)), [1] * len(works), d)[1] / sum(works)
        ratio = cost.cp_trie(root, d) / (prefill + (whole - prefill) * busiest)
        if ratio < best:
            best, chosen = ratio, d
    return chosen


def assign_subgroups(
    trees: Sequence[Tree],
    plans: Sequence[Plan | None],
    cp_size: int,
    *,
    rebalance: bool = True,
    trie: StepTrie | None = None,
    cp_roots: Sequence[tuple[TrieNode, int]] = (),
) -> tuple[list[int], list[int]]:
    """(degree, subgroup) per tree, for one CP group of ``cp_size`` ranks that replays ``trees``.

    The planner plans each tree alone; a CP group holding several trees may finish sooner running some of
    them on one rank each, side by side. With ``rebalance`` and when every plan carries the planner's
    estimates (``est_time_s``, and ``est_single_s`` for a plan of degree d > 1), trees are demoted to
    degree 1 in order of their parallel efficiency T_1 / (d T_d), least efficient first, and the number of
    demotions with the smallest estimated makespan (``pack_subgroups``) wins (none, on a tie). Otherwise the
    planned degrees stand and trees are packed by their ``groups.tree_workload``. The degree-1 trees of one
    trie go to one rank together (``trie``: the ``StepTrie`` of ``trees``; default: found here, default
    thresholds). The trees of a trie with a context-parallel root (``cp_roots``: (root, degree d)) go to one
    d-subgroup together, as one item of their summed work (each tree's one-rank estimate, else its planned
    time over its degree), and are never demoted.
    """
    degrees = [plan.degree if plan is not None else 1 for plan in plans]
    together = [root.trees() for root, _ in cp_roots]
    for (_, d), members in zip(cp_roots, together):
        for t in members:
            degrees[t] = d
    fixed = {t for members in together for t in members}
    tries = (trie if trie is not None else StepTrie(trees)).tries()
    if not rebalance or not all(plan is not None and plan.est_time_s is not None for plan in plans):
        works = [float(tree_workload(tree.prompt_len, tree.response_lens)) for tree in trees]
        return degrees, pack_subgroups(works, degrees, cp_size, tries, together)[0]
    multi = [plan.est_time_s for plan in plans]
    single = [plan.est_time_s if plan.degree == 1 else plan.est_single_s for plan in plans]
    demotable = sorted(
        (t for t in range(len(plans)) if degrees[t] > 1 and single[t] is not None and t not in fixed),
        key=lambda t: (single[t] / (degrees[t] * multi[t]), t),
    )
    best = None
    for k in range(len(demotable) + 1):
        if k:
            degrees[demotable[k - 1]] = 1
        works = [
            multi[t] * degrees[t] if degrees[t] > 1 and (t not in fixed or single[t] is None) else single[t]
            for t in range(len(plans))
        ]
        subgroups, makespan = pack_subgroups(works, degrees, cp_size, tries, together)
        if best is None or makespan < best[0]:
            best = (makespan, list(degrees), subgroups)
    return best[1], best[2]


def pack_subgroups(
    works: Sequence[float],
    degrees: Sequence[int],
    cp_size: int,
    tries: Sequence[Sequence[int]] = (),
    together: Sequence[Sequence[int]] = (),
) -> tuple[list[int], float]:
    """(subgroup per tree, makespan): the subgroup (of ``degrees[t]`` consecutive CP ranks; index 0 ..
    cp_size / d - 1) each tree runs on, and the most work any rank gets.

    Longest-processing-time first: each tree, heaviest first, goes to the subgroup whose busiest member
    has the least work so far, and adds ``works[t] / d`` to every member. Ties go to the lowest index.
    ``tries``: the trees of each trie of the step (``replay.trie``); a trie's trees of degree 1 go to one
    rank together, as one tree of their summed work, so that their shared tokens run once; a trie heavier
    than a rank's fair share (the total work over ``cp_size``: a batch-wide system prompt makes the whole
    batch one trie) is cut into chunks of at most that share, heaviest trees first, each chunk together.
    ``together``: sets of trees (of one degree) that go to one subgroup as one item (a trie with a
    context-parallel root).
    """
    for t, d in enumerate(degrees):
        if d < 1 or cp_size % d:
            raise ValueError(f"tree {t}: degree {d} does not divide the CP group size {cp_size}")
    share = sum(works) / cp_size
    first: dict[int, int] = {t: members[0] for members in together for t in members}
    for trie in tries:
        chunk, load = None, 0.0
        for t in sorted((t for t in trie if degrees[t] == 1 and t not in first), key=lambda t: (-works[t], t)):
            if chunk is None or load + works[t] > share:
                chunk, load = t, 0.0
            first[t], load = chunk, load + works[t]
    items: dict[int, list[int]] = {}
    for t in range(len(works)):
        items.setdefault(first.get(t, t), []).append(t)
    placed, makespan = _pack(
        [sum(works[t] for t in item) for item in items.values()], [degrees[item[0]] for item in items.values()], cp_size
    )
    subgroups = [0] * len(works)
    for item, s in zip(items.values(), placed):
        for t in item:
            subgroups[t] = s
    return subgroups, makespan


def _pack(works: list[float], degrees: list[int], cp_size: int) -> tuple[list[int], float]:
    load = [0.0] * cp_size
    subgroups = [0] * len(works)
    for t in sorted(range(len(works)), key=lambda t: (-works[t], t)):
        d = degrees[t]
        best = min(range(cp_size // d), key=lambda s: (max(load[s * d : (s + 1) * d]), s))
        subgroups[t] = best
        for r in range(best * d, (best + 1) * d):
            load[r] += works[t] / d
    return subgroups, max(load, default=0.0)


def _check_plans(plans, trees) -> list[Plan | None]:
    if plans is None:
        return [None] * len(trees)
    plans = list(plans)
    if len(plans) != len(trees):
        raise ValueError(f"got {len(plans)} plans for {len(trees)} trees; give one plan (or None) per tree")
    for t, (plan, tree) in enumerate(zip(plans, trees)):
        if plan is not None:
            plan.check_responses(len(tree.responses), tree=t)
    return plans


def _world_mesh() -> CPMesh:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise ValueError("context-parallel replay (a plan with degree > 1) needs torch.distributed initialised")
    return CPMesh.whole_world()


def _check_subgroups(
    mesh: CPMesh, plans: list[Plan | None], subgroups, trie: StepTrie, rebalance: bool, cp_roots
) -> tuple[list[Plan | None], list[int]]:
    """(plans, subgroups): the given subgroups checked, or ``assign_subgroups``' (a tree it moves to one rank
    runs there with the one-device plan, carrying the planner's one-rank estimate)."""
    degrees = [plan.degree if plan is not None else 1 for plan in plans]
    for root, d in cp_roots:
        if d not in mesh.groups:
            raise ValueError(
                f"the trie of trees {root.trees()}: root degree {d} is not a CP degree here ({list(mesh.degrees)})"
            )
        for t in root.trees():
            degrees[t] = d
    for t, d in enumerate(degrees):
        if d > 1 and d not in mesh.groups:
            raise ValueError(
                f"tree {t}: plan degree {d} differs from the CP group size {mesh.cp_size} "
                f"(CP degrees here: {list(mesh.degrees)})"
            )
    fixed = {t for root, _ in cp_roots for t in root.trees()}
    if subgroups is None:
        degrees, subgroups = assign_subgroups(
            trie.trees, plans, mesh.cp_size, rebalance=rebalance, trie=trie, cp_roots=cp_roots
        )
        return [
            plan if plan is None or plan.degree == d or t in fixed else Plan(est_time_s=plan.est_single_s)
            for t, (plan, d) in enumerate(zip(plans, degrees))
        ], subgroups
    subgroups = list(subgroups)
    if len(subgroups) != len(trie.trees):
        raise ValueError(f"got {len(subgroups)} subgroups for {len(trie.trees)} trees")
    for t, (d, s) in enumerate(zip(degrees, subgroups)):
        if not 0 <= s < mesh.cp_size // d:
            raise ValueError(f"tree {t}: subgroup {s} outside the {mesh.cp_size // d} subgroups of degree {d}")
    for root, _ in cp_roots:
        if len({subgroups[t] for t in root.trees()}) > 1:
            raise ValueError(f"the trie of trees {root.trees()} runs on one subgroup, got {subgroups}")
    return plans, subgroups
