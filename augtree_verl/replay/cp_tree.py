"""One context-parallel tree's slot on one rank of its subgroup: the steps of its CP schedule (``cp.schedule``)
executed; and ``exchange_scores``, the one exchange of scores among ranks (a step's members, a lane's
responses, and ``replay``'s sharing of every tree's scores over the CP group).

Every member of the tree's subgroup runs the slot at the same time (the lock-step slots put the tree
in the same slot on all of them):

- prefill: the prompt sharded over the prefill ring (``CPPrefill``) into a ``PromptKV`` (this rank's K/V
  shard as float32-summing leaves, the last hidden state as a leaf on the owner of position P - 1); a
  ring plan has no shared prefill and runs a dummy one (so every slot has the same three parts);
- each step: ONE decoder call (my shard of the fed tokens; one dummy token where I own none, a local
  dummy where my ring feeds nothing) and ONE LM-head call on every member (my scored tokens: for split
  plans the first token of each of the step's responses on the owner of P - 1, plus the tokens my shard
  scores; a dummy row where I score none), then the exact zero-filled exchange of the step's scores among
  ``step.exchange`` (each token is non-zero on one rank). In training every member evaluates
  ``micro_batch_loss(t, responses, full scores)`` identically on leaf copies, takes g = d loss / d scores,
  and runs one backward through the tokens it owns with g (the dummy row with zero): summed over members,
  each token's gradient enters once; parameter gradients are partial per rank and add up over the group;
- dummy calls up to ``slot.calls`` (a tree_move_kv lane with fewer responses pads locally);
- the ``PromptKV``'s delayed backward on every member of the prefill ring.
Returns every response's scores on every member of the subgroup.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from augtree_verl.cp.comm import Meter, Ring, all_gather_sum
from augtree_verl.cp.context import LaneReplayContext, MoveQReplayContext, RingContext
from augtree_verl.cp.schedule import CPStep
from augtree_verl.groups import Tree
from augtree_verl.plan import Plan
from augtree_verl.replay.attention import PrefillContext
from augtree_verl.replay.calls import PAD_ID, ModelCalls
from augtree_verl.replay.lockstep import CPTreeSlot
from augtree_verl.replay.prompt_kv import PromptKV

SCORE_EXCHANGE = "logp_exchange"  # stats key for the score exchanges (not part of any primitive's bytes)


def exchange_scores(
    lens: list[int], owned, members: tuple[int, ...], group, meter: Meter, *, width: int | None, device: torch.device
) -> list[torch.Tensor]:
    """Full scores of every entry j (float32 [lens[j]], or [lens[j], width]; detached, identical on every
    member) from the tokens each member owns: a zero-filled buffer summed over ``members`` (ranks of
    ``group``), exact since each token is non-zero on one member. ``owned``: (j, token indices (LongTensor
    [k] or a slice), scores [k] or [k, width]) for what this rank holds."""
    offsets = [sum(lens[:j]) for j in range(len(lens))]
    buffer = torch.zeros(sum(lens), *(() if width is None else (width,)), dtype=torch.float32, device=device)
    for j, idx, s in owned:
        buffer[offsets[j] : offsets[j] + lens[j]][idx] = s.detach()
    full = all_gather_sum(buffer, members, group, meter)
    return [full[o : o + n] for o, n in zip(offsets, lens)]


class CPTreeRun:
    """The CP slots of one ``replay`` call on this rank; ``group``: the tree's subgroup (None: the world)."""

    def __init__(self, calls: ModelCalls, group):
        self.calls, self.group = calls, group
        self.score_meter = Meter(calls.stats, SCORE_EXCHANGE)

    def __call__(self, tree: Tree, plan: Plan, slot: CPTreeSlot) -> list[torch.Tensor]:
        t, calls, sched, stats = slot.tree, self.calls, slot.schedule, self.calls.stats
        meter = Meter(stats, plan.primitive)
        start = stats.start_timer(tree.prompt.device)
        if sched.prefill is None:
            prompt = calls.dummy_prompt()
        else:
            prompt = PromptKV(
                lambda: self.prefill(tree.prompt, sched.prefill, sched.rank, meter),
                train=calls.train,
                offload=calls.offload,
            )
        stats.stop_timer("prefill_s", start)

        start = stats.start_timer(tree.prompt.device)
        out: dict[int, torch.Tensor] = {}
        for step in sched.steps:
            out.update(
                zip(
                    step.responses,
                    self._step(t, tree, step, sched.rank, prompt, meter, sched.prefill and sched.prefill.layout),
                )
            )
            stats.micro_batches += 1
        calls.finish_slot(prompt, len(sched.steps), slot.calls, start)
        if not sched.lane_share:
            return [out[i] for i in range(len(tree.responses))]
        # Every member returns every response: the first member of each lane contributes its lane's.
        first = sched.prefill.members[0] == sched.rank
        owned = [(i, slice(None), s) for i, s in out.items() if first]
        return self._exchange(tree, list(range(len(tree.responses))), owned, tuple(range(sched.degree)))

    def prefill(self, prompt: torch.Tensor, prefill, rank: int, meter: Meter):
        index = prefill.members.index(rank)
        pos = prefill.layout.positions(index, device=prompt.device)
        capture: dict[int, tuple] = {}
        ctx = RingContext(Ring(self.group, prefill.members, index), prefill.layout, meter, capture)
        hidden = self._shard(prompt[pos], pos, ctx)
        owner, local = prefill.layout.owner(prompt.shape[0] - 1)
        return [capture[layer] for layer in range(len(capture))], hidden, local if owner == index else None, None

    def _shard(self, ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """My shard (ids/positions [n]) through the decoder -> final hidden [max(n, 1), H]: a rank with no
        token runs one dummy token (``cp.context``)."""
        if ids.shape[0] == 0:
            ids, positions = ids.new_full((1,), PAD_ID), positions.new_zeros(1)
        return self.calls.decoder(ids[None], positions[None], ctx)[0]

    def _step(
        self, t: int, tree: Tree, step: CPStep, rank: int, prompt: PromptKV, meter: Meter, prompt_layout
    ) -> list[torch.Tensor]:
        """One step (see the module docstring); returns the full scores of ``step.responses``."""
        parts = []  # (response, token indices [k], states [k, H], targets [k]) this rank scores
        if step.kind != "ring" and prompt.last is not None:  # first tokens, from the prompt's last state
            for i in step.responses:
                parts.append(
                    (
                        i,
                        torch.zeros(1, dtype=torch.long, device=tree.prompt.device),
                        prompt.last[None],
                        tree.responses[i][:1],
                    )
                )
        hidden, decoded = self._decode(tree, step, rank, prompt, meter, prompt_layout)
        parts += decoded
        # Keep-alive: where no scored row comes from this call's decoder output, a dummy row of it (zero
        # gradient) takes part in the LM-head call, so that the backward runs this rank's decoder (and the
        # communication inside it) as on every other member.
        keepalive = not decoded
        rows = parts + ([(None, None, hidden[:1], tree.prompt[:1])] if keepalive else [])
        scores = self.calls.scores(torch.cat([s for _, _, s, _ in rows]), torch.cat([x for _, _, _, x in rows]))
        owned, offset = [], 0
        for i, idx, s, _ in parts:
            owned.append((i, idx, scores[offset : offset + s.shape[0]]))
            offset += s.shape[0]
        full = self._exchange(tree, list(step.responses), owned, step.exchange)
        if self.calls.train:
            self._backward(t, list(step.responses), full, owned, scores[offset:] if keepalive else None)
        return full

    def _decode(self, tree: Tree, step: CPStep, rank: int, prompt: PromptKV, meter: Meter, prompt_layout):
        """The step's decoder call on this rank -> (hidden [max(n, 1), H], the scored parts it yields)."""
        if step.layout is None:  # my ring feeds nothing: a local dummy decoder call
            return self._shard(tree.prompt[:0], tree.prompt[:0], PrefillContext()), []
        p, index = tree.prompt_len, step.members.index(rank)
        ring = Ring(self.group, step.members, index)
        pos = step.layout.positions(index, device=tree.prompt.device)
        if step.kind == "ring":  # [prompt || response[:-1]]: positions >= P - 1 score response tokens
            seq = torch.cat([tree.prompt, tree.responses[step.fed]])
            hidden = self._shard(seq[pos], pos, RingContext(ring, step.layout, meter))
            scored = (pos >= p - 1).nonzero().squeeze(1)
            return hidden, (
                [(step.fed, pos[scored] - (p - 1), hidden[scored], seq[pos[scored] + 1])] if scored.numel() else []
            )
        ctx: LaneReplayContext | MoveQReplayContext
        if step.kind == "tree_move_kv":
            ctx = LaneReplayContext(ring, step.layout, step.prefix, prompt.kv, meter)
        else:
            ctx = MoveQReplayContext(
                self.group, rank, prompt_layout, step.query_counts, ring, step.layout, prompt.kv, meter
            )
        resp = tree.responses[step.fed] if step.fed is not None else tree.prompt[:0]  # None: my lane idles
        hidden = self._shard(resp[pos], pos + step.offset, ctx)  # fed token j scores response token j + 1
        return hidden, ([(step.fed, pos + 1, hidden[: pos.numel()], resp[pos + 1])] if pos.numel() else [])

    def _exchange(self, tree: Tree, responses: list[int], owned: list, members) -> list[torch.Tensor]:
        """Full scores of ``responses`` on every member (``exchange_scores``); ``owned``: (response, token
        indices, scores) this rank holds."""
        width = None if self.calls.entropy_fn is None else 2
        return exchange_scores(
            [tree.response_lens[i] for i in responses],
            [(responses.index(i), idx, s) for i, idx, s in owned],
            members,
            self.group,
            self.score_meter,
            width=width,
            device=tree.prompt.device,
        )

    def _backward(self, t: int, responses: list[int], full: list, owned: list, dummy) -> None:
        """g = d micro_batch_loss(t, responses, full) / d full (on leaf copies, the same on every member),
        backpropagated through the tokens this rank owns (``dummy``: the dummy row's scores, with zero)."""
        leaves = [f.clone().requires_grad_() for f in full]
        loss = self.calls.loss(t, responses, leaves)
        found: Sequence[torch.Tensor | None] = [None] * len(leaves)
        if loss is not None and loss.requires_grad:
            found = torch.autograd.grad(loss, leaves, allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(f) for g, f in zip(found, full)]
        roots = [s for _, _, s in owned] + ([dummy] if dummy is not None else [])
        seeds = [grads[responses.index(i)][idx] for i, idx, _ in owned]
        seeds += [torch.zeros_like(dummy)] if dummy is not None else []
        torch.autograd.backward(roots, seeds)
