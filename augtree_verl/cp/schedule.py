"""The schedule of one context-parallel tree on one rank: pure data from the plan, the prompt length, the
response lengths and the rank (no model, no tensors).

``cp_tree_schedule`` is read by three consumers, so the schedule is written once:
- the CP tree run (``replay.cp_tree``) executes exactly these steps;
- ``cost.analytic_bytes`` sums each primitive's per-layer byte formula over the same steps;
- the lock-step slots (``replay.lockstep``) count its calls (``len(steps)``).

Ranks are indices inside the tree's CP subgroup of ``plan.degree`` ranks; "lane" = ``layout.lane_members``.
Every sequence is zigzag-sharded (``layout.ZigzagLayout``).

- ring (RingCP): no shared prefill; one step per response, [prompt || response[:-1]] over all d ranks.
- tree_move_kv: my lane prefills the prompt over its members; one step per response placed on my lane
  (round order), its R - 1 fed tokens over the lane with the lane's prompt shards as the visible prefix.
  Lanes never talk, so lanes may have different step counts (the run pads the shorter lanes locally).
- move_q: the prompt is prefilled over all d ranks; per round, as many steps as the fullest cell of the
  round; each step feeds one response per lane (None: the lane idles, serving its prompt shard), the
  queries going to every prompt owner.
A step in which no rank of my ring feeds a token (responses of one token) has ``layout`` None: it scores
only first tokens (from the prompt's last hidden state), and its decoder call is a local dummy.
"""

from __future__ import annotations

from dataclasses import dataclass

from augtree_verl.cp.layout import ZigzagLayout, lane_members
from augtree_verl.plan import Plan


@dataclass(frozen=True)
class CPPrefill:
    """The prompt's prefill ring: ``members`` (subgroup ranks, ring order) and the prompt's ``layout`` over
    them (one part per member)."""

    members: tuple[int, ...]
    layout: ZigzagLayout


@dataclass(frozen=True)
class CPStep:
    """One replay step on this rank: one decoder call, one LM-head call and (training) one backward.

    ``kind``: the primitive: "ring" | "tree_move_kv" | "move_q".
    ``responses``: the responses scored in this step (every lane's, for move_q), in exchange order.
    ``fed``: the response whose tokens this rank's ring feeds (None: my lane idles this step).
    ``members``: my ring (subgroup ranks, ring order); ``layout``: the fed sequence over it (None: nothing
    fed by my ring, see the module docstring); ``offset``: position of the first fed token.
    ``prefix``: the lane's prompt layout riding along the ring (tree_move_kv), else None.
    ``query_counts``: queries each subgroup rank holds (move_q), else None.
    ``exchange``: the members that sum the step's zero-filled scores (exact: one owner per token).
    """

    kind: str
    responses: tuple[int, ...]
    fed: int | None
    members: tuple[int, ...]
    layout: ZigzagLayout | None
    offset: int
    prefix: ZigzagLayout | None
    query_counts: tuple[int, ...] | None
    exchange: tuple[int, ...]


@dataclass(frozen=True)
class CPTreeSchedule:
    """``prefill``: None for the ring (its prompt runs inside every step); ``steps`` in execution order;
    ``lane_share``: after the steps, the members of each lane hold only their lane's responses, and one
    exchange over the whole subgroup (each lane's first member contributing) gives every rank all of them."""

    rank: int
    degree: int
    prefill: CPPrefill | None
    steps: tuple[CPStep, ...]
    lane_share: bool


def cp_tree_schedule(plan: Plan, prompt_len: int, response_lens: list[int], rank: int) -> CPTreeSchedule:
    """The schedule of ``plan`` for a tree of ``prompt_len`` prompt tokens and responses of
    ``response_lens`` tokens, on subgroup rank ``rank`` (see the module docstring)."""
    d = plan.degree
    if not 0 <= rank < d:
        raise ValueError(f"rank {rank} outside a CP subgroup of {d} ranks")
    plan.check_responses(len(response_lens))
    everyone = tuple(range(d))
    if plan.primitive == "ring":
        steps = tuple(
            CPStep("ring", (i,), i, everyone, ZigzagLayout(prompt_len + r - 1, d), 0, None, None, everyone)
            for i, r in enumerate(response_lens)
        )
        return CPTreeSchedule(rank, d, None, steps, False)
    lanes = [lane_members(d, plan.lanes, lane) for lane in range(plan.lanes)]
    my_lane = next(lane for lane, m in enumerate(lanes) if rank in m)
    members = lanes[my_lane]
    if plan.primitive == "tree_move_kv":
        prefix = ZigzagLayout(prompt_len, len(members))
        mine = sorted((r, i) for i, (r, lane) in enumerate(plan.placement) if lane == my_lane)
        steps = tuple(
            CPStep(
                "tree_move_kv",
                (i,),
                i,
                members,
                ZigzagLayout(response_lens[i] - 1, len(members)) if response_lens[i] > 1 else None,
                prompt_len,
                prefix,
                None,
                members,
            )
            for _, i in mine
        )
        return CPTreeSchedule(rank, d, CPPrefill(members, prefix), steps, True)
    move_q_steps: list[CPStep] = []
    for rnd in range(plan.rounds):
        cells = [[i for i, cell in enumerate(plan.placement) if cell == (rnd, lane)] for lane in range(plan.lanes)]
        for k in range(max(len(c) for c in cells)):
            per_lane = [c[k] if k < len(c) else None for c in cells]
            fed = [response_lens[i] - 1 if i is not None else 0 for i in per_lane]
            layouts = [ZigzagLayout(n, len(m)) for n, m in zip(fed, lanes)]
            counts = tuple(layouts[lane].size(j) for lane, m in enumerate(lanes) for j in range(len(m)))
            move_q_steps.append(
                CPStep(
                    "move_q",
                    tuple(i for i in per_lane if i is not None),
                    per_lane[my_lane],
                    members,
                    layouts[my_lane] if any(fed) else None,
                    prompt_len,
                    None,
                    counts if any(fed) else None,
                    everyone,
                )
            )
    return CPTreeSchedule(rank, d, CPPrefill(everyone, ZigzagLayout(prompt_len, d)), tuple(move_q_steps), False)
