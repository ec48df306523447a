"""The strategies ``augtree bench`` compares, and the per-tree plans each one runs with.

- MegaN: no prompt reuse, what verl does today. One device: the flattened baseline
  (``flattened_replay``: each [prompt ‖ response] its own sequence). CP degree d > 1: ring CP over each
  [prompt ‖ response] (the "ring" primitive, prompt recomputed per response).
- MegaR: prompt reuse with plain ring CP: the prompt is prefilled once, sharded over all d ranks, and the
  responses are replayed one after another, each with a K/V ring over all d ranks that carries the prompt
  shards and that response's K/V. That is TreeMoveKV with a single lane (response i in cell (i, 0)).
  Needs d > 1; on one device it is exactly AugTree.
- AugTree: the grouped replay; with d > 1 the planner picks primitive, grid and placement per tree.
- AugTree[<primitive>]: the planner restricted to one split primitive (forced "ring" is MegaN itself).
- AugTree[one device] (d > 1): the planner's one-device plan for every tree, the step plan dealing the trees
  over the ranks (a tree whole on one rank): AugTree with its CP plans demoted to one device, the run that
  context parallelism replaces. Listed for every model: what CP buys (a lower per-rank peak for a long
  prompt) and what it costs (time, bytes) is the same question for attention-only models and hybrids.
- AugTree[depth-1] (the shared workloads only): the trie cut to the nodes that end a prompt, so each group's
  prompt runs once and nothing beyond it is shared (a prompt that begins a later turn's prompt is still one
  node: the trie always cuts at a prompt's end).
- verl-fsdp2 (CPU): verl's stock FSDP2 engine as users run it today, one sequence per verl micro-batch, data
  parallel over the step's responses at d ranks (``verl_fsdp2.py``).

The AugTree methods' trees whose trie is more than their own group run in their trie, as the engine runs
them (``StepPlan.build``: the trie's root context-parallel where one of its trees has a CP plan); MegaN and
MegaR keep their fixed CP plans (no sharing beyond the tree).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from augtree_verl.cp.mesh import CPMesh
from augtree_verl.groups import Tree
from augtree_verl.plan import Plan
from augtree_verl.planner import plan_tree
from augtree_verl.planner.cost import cost_model, step_seconds
from augtree_verl.replay.step_plan import StepPlan
from augtree_verl.replay.trie import MIN_SHARED_TOKENS

SPLIT_PRIMITIVES = ("tree_move_kv", "move_q")
# No trie node saves this many token passes, so only the nodes that end a prompt stay: depth-1 reuse.
DEPTH1_SHARED_TOKENS = 2**62


@dataclass(frozen=True)
class Method:
    name: str
    flattened: bool = False  # run the flattened baseline instead of ``replay``
    fixed: str | None = None  # "ring" or "megar": a plan built here, not by the planner
    force: str | None = None  # planner restricted to this primitive
    verl: bool = False  # verl's stock fsdp2 engine (verl_fsdp2.py) instead of ``replay``
    min_shared_tokens: int = MIN_SHARED_TOKENS  # the trie's threshold (``StepPlan.build``)
    one_device: bool = False  # the planner's plans at degree 1, whatever the CP degree

    def plans(self, trees: Sequence[Tree], degree: int, profile=None) -> list[Plan] | None:
        """One plan per tree for CP degree ``degree`` (None: single device, no plan)."""
        if degree == 1 or self.flattened or self.verl:
            return None
        if self.fixed == "ring":
            return [Plan(degree=degree, primitive="ring") for _ in trees]
        if self.fixed == "megar":
            return [
                Plan(
                    degree=degree,
                    primitive="tree_move_kv",
                    rounds=len(t.responses),
                    lanes=1,
                    placement=tuple((i, 0) for i in range(len(t.responses))),
                )
                for t in trees
            ]
        degrees = [1] if self.one_device else [degree]
        return [
            plan_tree(t.prompt_len, t.response_lens, degrees=degrees, profile=profile, force_primitive=self.force)
            for t in trees
        ]

    def as_run(
        self, trees: Sequence[Tree], plans: list[Plan] | None, profile, world: int
    ) -> tuple[Sequence[Plan | None] | None, list[tuple[list[int], int]]]:
        """(plans, cp_roots) as the step plan runs ``plans`` on ``world`` ranks (``StepPlan.build``): a CP plan of
        a tree in a trie replaced by the one-device plan where the trie runs on one device, and (trees, degree)
        of each trie whose root runs context-parallel."""
        if plans is None or world == 1:
            return plans, []
        step_plan = StepPlan.build(
            trees,
            plans=plans,
            mesh=CPMesh.for_planning((1, world), 0),
            min_shared_tokens=self.min_shared_tokens,
            cp_alone=self.fixed is not None,
            trie_cost=self.trie_cost(profile, world),
        )
        return step_plan.plans, [(root.trees(), d) for root, d in step_plan.cp_roots]

    def trie_cost(self, profile, world: int):
        """The cost model the step plan chooses tries' context-parallel roots with (``StepPlan.build``'s
        ``trie_cost``, as the engine's): AugTree methods with CP; None otherwise."""
        return cost_model(profile) if self.planned and profile is not None and world > 1 else None

    @property
    def planned(self) -> bool:
        """AugTree methods: their plans come from the planner, so the planner predicts their step time."""
        return not self.flattened and self.fixed is None and not self.verl

    def predicted_s(self, trees: Sequence[Tree], plans: list[Plan] | None, profile, world: int = 1) -> float | None:
        """The planner's predicted update-step time on ``world`` ranks (``planner.cost.step_seconds``: the trees
        placed as the step plan places them, shared prefixes once); None for the baselines."""
        if not self.planned or profile is None:
            return None
        return step_seconds(trees, plans, world, profile, min_shared_tokens=self.min_shared_tokens)


VERL_FSDP2 = Method("verl-fsdp2", verl=True)
DEPTH1 = Method("AugTree[depth-1]", min_shared_tokens=DEPTH1_SHARED_TOKENS)
ONE_DEVICE = Method("AugTree[one device]", one_device=True)


def methods_for(cp: int, device: str = "cpu", depth1: bool = False) -> list[Method]:
    """MegaN first (the reference every other method is compared with); with d > 1, AugTree[one device] right
    after AugTree; with ``depth1``, AugTree[depth-1] next; verl-fsdp2 last, on CPU only (verl's engine runs here
    on our CPU platform; on CUDA it is not wired up yet)."""
    verl = [VERL_FSDP2] if device == "cpu" else []
    depth = [DEPTH1] if depth1 else []
    if cp == 1:
        return [Method("MegaN", flattened=True), Method("AugTree")] + depth + verl
    return (
        [Method("MegaN", fixed="ring"), Method("MegaR", fixed="megar"), Method("AugTree"), ONE_DEVICE]
        + depth
        + [Method(f"AugTree[{p}]", force=p) for p in SPLIT_PRIMITIVES]
        + verl
    )


def describe_plans(
    plans: Sequence[Plan] | None,
    cp_roots: Sequence[tuple[Sequence[int], int]],
    flattened: bool,
    verl_world: int | None = None,
) -> str:
    """Short text for the table: "flattened", "single", each distinct plan as primitive(d,b,s), "trie_root(d=D)"
    for the trees of a trie with a context-parallel root (``cp_roots``: (its trees, D)), or for verl-fsdp2
    (``verl_world`` its data-parallel size) "fsdp2(dp=d,mb=1)"."""
    if verl_world is not None:
        return f"fsdp2(dp={verl_world},mb=1)"
    if flattened:
        return "flattened"
    if plans is None:
        return "single"
    seen: list[str] = []
    in_root = {t: d for trees, d in cp_roots for t in trees}
    for t, p in enumerate(plans):
        text = (
            f"trie_root(d={in_root[t]})"
            if t in in_root
            else "single"
            if p.degree == 1
            else f"{p.primitive}(d={p.degree})"
            if p.primitive == "ring"
            else f"{p.primitive}(d={p.degree},b={p.rounds},s={p.lanes})"
        )
        if text not in seen:
            seen.append(text)
    return "+".join(seen)
