"""Rotary embeddings whose frequencies depend on the call's length, replayed with the frequencies verl's stock
engine uses (docs/design.md §4, *Length-dependent rope*).

transformers' ``dynamic_rope_update`` (the decorator on a family's rotary ``forward``) chooses a rope's
frequencies from the call's own ``max(position_ids) + 1``:

- ``longrope`` (Phi-3, Phi-4-mini): the short factors up to ``original_max_position_embeddings``, the long ones
  beyond. A step function of the call's length: each step is a *regime* (``RopeRegimes``).
- ``dynamic`` (NTK): frequencies recomputed for every length beyond ``max_position_embeddings``, and kept for the
  calls after it (transformers 5.10.4 never resets them: a shorter call reuses the last longer call's). They
  depend on the engine's call history, which no replay reproduces: ``model_check.check_model`` refuses them by
  name (``stateful_ropes``).

verl's stock engine packs the rows of each verl micro-batch into one call (positions restart at each row), so
a row's rope sees the length of the longest row of its micro-batch (``Tree.call_lens``, from
``integration.batch_trees``; one sequence per micro-batch: the row's own length). The replay prefills a prompt
once and replays its responses in calls of other lengths, so it must not let the calls choose. Instead:

- each row's regime is that of its stock-engine call length; a tree whose rows fall in different regimes is
  split into one tree per regime (``split_regimes``), each prefilling the prompt; counted per step as
  ``ReplayStats.rope_splits`` (metric ``rope/split_trees``). A split tree's context-parallel split plan (MoveQ,
  TreeMoveKV: a placement of all its responses) runs on one device; a ring plan applies to any part;
- the prefix trie never shares a node between trees of different regimes (``replay.trie``);
- every model call of a tree's slot (prefill, responses, their backwards and checkpoint recomputes) runs with
  the rotary modules' choice pinned to the tree's regime (``pinned``): transformers' own update runs for a call
  of the regime's length, then the rope of the call's real positions.

Exact by construction: every token of a row is computed with the frequencies its stock-engine call used.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from augtree_verl.groups import Tree
from augtree_verl.plan import Plan

# rope types whose frequencies step at ``original_max_position_embeddings`` (transformers' longrope update)
STEP_ROPES = ("longrope",)

Origin = list[tuple[int, tuple[int, ...]]]  # per split tree: (the caller's tree index, its response indices)


def rope_parameters(config) -> dict[str | None, dict]:
    """``config``'s rope parameters by layer type (key None: one rope for every layer); {} without a rope."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return {}
    if "rope_type" in params:
        return {None: params}
    return {kind: p for kind, p in params.items() if isinstance(p, dict) and "rope_type" in p}


def stateful_ropes(config) -> list[str]:
    """The settings of ``config``'s ropes whose frequencies depend on earlier calls (``dynamic``, see the module
    docstring), e.g. ["rope_type 'dynamic' (factor=2.0, max_position_embeddings=4096)"]."""
    return [
        f"rope_type {p['rope_type']!r}{'' if kind is None else f' of {kind}'} (factor={p.get('factor')}, "
        f"max_position_embeddings={getattr(config, 'max_position_embeddings', None)})"
        for kind, p in rope_parameters(config).items()
        if "dynamic" in str(p.get("rope_type"))
    ]


@dataclass(frozen=True)
class RopeRegimes:
    """The regimes of a model's step-function ropes: a call of n tokens is in the regime of the thresholds below
    it (``thresholds``: sorted ``original_max_position_embeddings`` of its longrope ropes)."""

    thresholds: tuple[int, ...]

    @classmethod
    def of(cls, config) -> RopeRegimes | None:
        """``config``'s regimes; None where no rope depends on the call's length by steps."""
        found = sorted(
            {
                int(p["original_max_position_embeddings"])
                for p in rope_parameters(config).values()
                if p.get("rope_type") in STEP_ROPES and p.get("original_max_position_embeddings")
            }
        )
        return cls(tuple(found)) if found else None

    def length(self, call_len: int) -> int:
        """The length the replay pins a call of ``call_len`` tokens' regime to: the shortest call in it."""
        return max([1] + [t + 1 for t in self.thresholds if call_len > t])


def split_regimes(
    trees: Sequence[Tree], plans: Sequence[Plan | None], regimes: RopeRegimes | None
) -> tuple[list[Tree], list[Plan | None], Origin | None, int]:
    """(trees, plans, origin, split): each tree with its regime's ``rope_len``, a tree whose rows' stock-engine
    calls (``Tree.row_call_lens``) fall in different regimes split into one tree per regime (in the order of
    their first row); ``origin``: per tree, (the given tree, its responses) where some tree was split, else None
    (the given indices); ``split``: trees split. ``regimes`` None: everything as given."""
    if regimes is None:
        return list(trees), list(plans), None, 0
    out: list[Tree] = []
    out_plans: list[Plan | None] = []
    origin: Origin = []
    split = 0
    for t, (tree, plan) in enumerate(zip(trees, plans)):
        rows: dict[int, list[int]] = {}
        for i, n in enumerate(tree.row_call_lens):
            rows.setdefault(regimes.length(n), []).append(i)
        split += len(rows) > 1
        for length, members in rows.items():
            out.append(tree.part(members, rope_len=length))
            kept = plan is None or len(rows) == 1 or plan.primitive == "ring"
            out_plans.append(plan if kept else Plan(est_time_s=plan.est_single_s))
            origin.append((t, tuple(members)))
    return out, out_plans, origin if split else None, split


def in_caller_trees(scores: list[list[torch.Tensor]], origin: Origin | None) -> list[list[torch.Tensor]]:
    """``scores`` of the split trees as the caller's trees' (``split_regimes``' ``origin``)."""
    if origin is None:
        return scores
    sizes: dict[int, int] = {}
    for t, members in origin:
        sizes[t] = sizes.get(t, 0) + len(members)
    out: list[list] = [[None] * sizes[t] for t in range(len(sizes))]
    for (t, members), values in zip(origin, scores):
        for i, value in zip(members, values):
            out[t][i] = value
    return out


def caller_loss(loss: Callable | None, origin: Origin | None) -> Callable | None:
    """A micro-batch loss ``loss(t, rows, scores)`` over the caller's trees, called with the split trees'."""
    if loss is None or origin is None:
        return loss
    return lambda t, rows, scores: loss(origin[t][0], [origin[t][1][i] for i in rows], scores)


@contextlib.contextmanager
def pinned(model, length: int | None):
    """Every rotary module of ``model`` that chooses its frequencies by the call's length computes them as for a
    call of ``length`` tokens, for the duration (None: as for the call's own positions)."""
    modules = [] if length is None else [m for m in model.modules() if _length_update(type(m)) is not None]
    for module in modules:
        module.forward = functools.partial(_pinned_forward, module, length)
    try:
        yield
    finally:
        for module in modules:
            del module.forward


@functools.cache
def _update_code():
    """The code object every ``dynamic_rope_update`` wrapper shares: how a rotary module that chooses by length is
    told apart from one that does not (a decorator leaves no other mark than ``__wrapped__``). Read on first use:
    the planner imports this module (``split_regimes``), and its Ray actor need not import transformers."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def _length_update(cls) -> Any:
    """The ``dynamic_rope_update`` wrapper in ``cls.forward``'s decorators (e.g. under ``torch.no_grad``), or None;
    its ``__wrapped__`` is the family's own rope forward."""
    fn = getattr(cls, "forward", None)
    while fn is not None:
        if getattr(fn, "__code__", None) is _update_code():
            return fn
        fn = getattr(fn, "__wrapped__", None)
    return None


def _pinned_forward(module, length: int, x, position_ids, *args, **kwargs):
    update = _length_update(type(module))
    with torch.no_grad():
        # transformers' own choice for a call of ``length`` tokens (its one-position rope is discarded) ...
        update(module, x, position_ids.new_full((1, 1), length - 1), *args, **kwargs)
        # ... then the rope of the call's positions with the frequencies it set
        return update.__wrapped__(module, x, position_ids, *args, **kwargs)
