"""``replay_cp``: the grouped replay run context-parallel over a CP group, one plan per tree.

Every rank of the group calls it with the same model replica, trees and plans. Per tree (d = plan.degree
= the group size; "lane" = ``layout.lane_members``; all sequences zigzag-sharded, ``layout.ZigzagLayout``):

- ring (RingCP, b = 0): each [prompt || response[:-1]] in turn is sharded over all d ranks and run with
  ring attention; the prompt is recomputed per response. This is the baseline schedule.
- tree_move_kv: each lane prefills the prompt sharded over its members (causal ring in the lane), then
  replays its responses (placement lane, in round order), each response's R - 1 fed tokens sharded over
  the lane, with the lane ring carrying the prompt shards and that response's K/V.
- move_q: the prompt is sharded over all d ranks and prefilled once (ring over all d); in each round the
  lanes replay one response each at the same time (a round cell with several responses takes several
  steps; a lane with nothing left idles, serving its prompt shard), queries moving to the prompt owners.

As in the one-device engine, a response's first token is scored from the prompt's last hidden state (a
leaf on the rank that owns prompt position P - 1) and its last token is never fed; each rank keeps the
prompt K/V it owns as leaves, accumulates their gradients over the replay, and one delayed backward per
tree (all members of the prefill ring together) pushes them through the prompt graph.

Loss: a response's log-probs are spread over ranks. After each replay step the ranks that took part sum
their zero-filled log-prob buffers (each token is non-zero on exactly one rank, so the sum is exact and
bitwise identical everywhere). Every rank owning at least one token of response i evaluates
``loss_fn(t, i, full_logp)`` on that identical copy, takes g = d loss / d logp there (the same g on every
rank), and backpropagates g only through the tokens it owns: summed over ranks, each token's gradient
enters exactly once. Parameter gradients are therefore partial per rank and sum to the one-process ones;
this engine never all-reduces them. Returned log-probs are complete on every rank.

Scores: with ``entropy_fn`` each scored token carries (log-prob, entropy) and every per-response value
below is [R, 2] instead of [R]; ``loss_fn`` then sees both, so an entropy term backpropagates the same way.
Deferred backward (``pending``): the forward keeps every step's graph and queues each step's backprop
and each prompt backward, in forward order, into ``pending``; ``pending.run(loss_fn)`` runs them later
on every member (for a loss that needs all log-probs first, as verl's does). The result is the same.

Not supported here (ValueError): plans whose degree differs from the group size, missing plans, and
dropout inside attention. ``micro_batch_tokens`` does not apply: a CP replay step is one response per lane.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from augtree_verl.cp.comm import Meter, Ring, all_gather_sum
from augtree_verl.cp.context import LaneReplayContext, MoveQReplayContext, RingContext
from augtree_verl.cp.layout import ZigzagLayout, lane_members
from augtree_verl.plan import Plan
from augtree_verl.replay.attention import NO_MASKS, use_augtree_attention
from augtree_verl.replay.offload import Offload
from augtree_verl.replay.scoring import token_logps
from augtree_verl.replay.stats import ReplayStats
from augtree_verl.replay.tree import ReplayTree

LOGP_EXCHANGE = "logp_exchange"  # stats key for the log-prob exchange (not part of any primitive's bytes)


class PendingBackward:
    """The queued backward of ``replay_cp(..., pending=this)``: ``run(loss_fn)`` backpropagates each replay
    step's owned tokens with d loss_fn / d scores, then each prompt, in forward order. Every member of the
    group calls it (the primitives communicate in their backward)."""

    def __init__(self):
        self.steps: list[Callable] = []

    def run(self, loss_fn) -> None:
        steps, self.steps = self.steps, []
        for step in steps:
            step(loss_fn)


def replay_cp(model, trees: Sequence[ReplayTree], loss_fn, plans: Sequence[Plan], *, temperature: float = 1.0,
              micro_batch_tokens: int | None = None, stats: ReplayStats | None = None, group=None,
              entropy_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
              pending: PendingBackward | None = None, offload: Offload | None = None) -> list[list[torch.Tensor]]:
    """Same contract as ``replay`` (logps[t][i] float32 [R_i] on every rank), context-parallel over
    ``group`` (default: the world); see the module docstring for the schedule and the gradient contract.

    ``entropy_fn(logits [n, V] float32, tempered) -> [n]``: values become [R_i, 2] (log-prob, entropy).
    ``pending`` (instead of ``loss_fn``): build the graph and queue the backward there.
    ``offload`` (training): each prompt shard's saved activations wait on the host until its prompt backward.
    """
    del micro_batch_tokens  # one response per lane per step; kept for the ``replay`` signature
    if loss_fn is not None and pending is not None:
        raise ValueError("pass either loss_fn (streamed backward) or pending (queued backward), not both")
    trees, plans = list(trees), list(plans)
    size = _check(model, trees, plans, temperature, group)
    stats = stats if stats is not None else ReplayStats()
    run = _Run(model, loss_fn, temperature, stats, group, dist.get_rank(group), size, entropy_fn, pending, offload)
    schedules = {"ring": run.ring_tree, "tree_move_kv": run.tree_move_kv_tree, "move_q": run.move_q_tree}
    logps = []
    use_augtree_attention(model)
    with torch.set_grad_enabled(run.train):
        for t, (tree, plan) in enumerate(zip(trees, plans)):
            stats.plans[plan.primitive] += 1
            logps.append(schedules[plan.primitive](t, tree, plan))
            stats.logical_tokens += sum(tree.prompt_len + r for r in tree.response_lens)
            stats.trees += 1
    return logps


def _check(model, trees, plans, temperature, group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("context-parallel replay (a plan with degree > 1) needs torch.distributed initialised")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if len(plans) != len(trees):
        raise ValueError(f"got {len(plans)} plans for {len(trees)} trees; give one plan per tree")
    size = dist.get_world_size(group)
    embed = model.get_input_embeddings()
    for t, (tree, plan) in enumerate(zip(trees, plans)):
        tree.validate(t, embed.num_embeddings, embed.weight.device)
        if plan is None:
            raise ValueError(f"tree {t} has no plan; a context-parallel replay needs one plan per tree")
        plan.check_responses(len(tree.responses), tree=t)
        if plan.degree != size:
            raise ValueError(f"tree {t}: plan degree {plan.degree} differs from the CP group size {size}")
    if model.training and getattr(model.config, "attention_dropout", 0.0):
        raise ValueError(f"attention_dropout={model.config.attention_dropout} is not supported by the CP replay")
    return size


@dataclass
class _Prefill:
    """A prefilled prompt shard on this rank: live tensors (in the prompt graph) and their leaves."""

    layout: ZigzagLayout
    hidden: torch.Tensor           # live final hidden states of my real prompt tokens [n, hidden]
    live_kv: list                  # per layer (k, v) [H_kv, n, D], live
    leaf_kv: list                  # per layer leaves (or the live tensors when not training)
    last: torch.Tensor | None      # leaf of the hidden state at P - 1 [hidden], on its owner only
    last_local: int | None         # its row in ``hidden``


class _Run:
    def __init__(self, model, loss_fn, temperature, stats, group, rank, size, entropy_fn, pending, offload):
        self.base, self.lm_head = model.get_decoder(), model.get_output_embeddings()
        self.loss_fn, self.temperature, self.stats = loss_fn, temperature, stats
        self.group, self.rank, self.size = group, rank, size
        self.entropy_fn, self.pending = entropy_fn, pending
        self.train = loss_fn is not None or pending is not None
        self.offload = offload if self.train else None
        self.logp_meter = Meter(stats, LOGP_EXCHANGE)

    # ---- shared pieces -------------------------------------------------------------------------------

    def forward_shard(self, ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """Run my shard (ids/positions [n]) through the decoder -> final hidden [n, hidden]; a rank with
        no token runs one dummy token (see ``context``)."""
        n = ids.shape[0]
        if n == 0:
            ids, positions = ids.new_zeros(1), positions.new_zeros(1)
        hidden = self.base(input_ids=ids[None], position_ids=positions[None], attention_mask=NO_MASKS,
                           use_cache=False, augtree_ctx=ctx).last_hidden_state
        self.stats.executed_tokens += ids.shape[0]
        return hidden[0, :n]

    def score(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden], targets [n] -> log-probs [n], or [n, 2] (log-prob, entropy) with ``entropy_fn``."""
        if self.entropy_fn is None:
            return token_logps(self.lm_head, hidden, targets, self.temperature)
        entropy = []
        logp = token_logps(self.lm_head, hidden, targets, self.temperature,
                           on_logits=lambda logits: entropy.append(self.entropy_fn(logits)))
        return torch.stack([logp, entropy[0].float()], dim=-1)

    def backward_step(self, step: Callable) -> None:
        """Run ``step(loss_fn)`` now (streamed backward) or queue it in ``pending``; nothing when not training."""
        if not self.train:
            return
        if self.pending is not None:
            self.pending.steps.append(step)
        else:
            step(self.loss_fn)

    def prefill(self, prompt: torch.Tensor, members: tuple[int, ...], meter: Meter) -> _Prefill:
        start = self.stats.start_timer(prompt.device)
        index = members.index(self.rank)
        layout = ZigzagLayout(prompt.shape[0], len(members))
        pos = layout.positions(index, device=prompt.device)
        capture = {}
        with self.offload.saving() if self.offload else contextlib.nullcontext():
            hidden = self.forward_shard(prompt[pos], pos, RingContext(Ring(self.group, members, index), layout,
                                                                      meter, capture))
        live_kv = [capture[layer] for layer in range(len(capture))]
        owner, local = layout.owner(prompt.shape[0] - 1)
        last = hidden[local] if owner == index else None
        if self.train:
            leaf_kv = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in live_kv]
            last = last.detach().requires_grad_() if last is not None else None
        else:
            leaf_kv = live_kv
        self.stats.stop_timer("prefill_s", start)
        return _Prefill(layout, hidden, live_kv, leaf_kv, last, local if owner == index else None)

    def prompt_backward(self, pre: _Prefill) -> None:
        self.backward_step(lambda loss_fn: self._prompt_backward(pre))

    def _prompt_backward(self, pre: _Prefill) -> None:
        """Phase C on every member of the prefill ring: all layers' K/V and the whole final hidden shard
        are roots (zero where nothing flowed), so every rank reaches every ring step of the prompt graph."""
        start = self.stats.start_timer(pre.hidden.device)
        roots, grads = [], []
        for live, leaf in zip(pre.live_kv, pre.leaf_kv):
            for x, lx in zip(live, leaf):
                roots.append(x)
                grads.append(lx.grad if lx.grad is not None else torch.zeros_like(x))
        hidden_grad = torch.zeros_like(pre.hidden)
        if pre.last is not None and pre.last.grad is not None:
            hidden_grad[pre.last_local] = pre.last.grad
        roots.append(pre.hidden)
        grads.append(hidden_grad)
        with self.offload.restoring() if self.offload else contextlib.nullcontext():
            torch.autograd.backward(roots, grads)
        self.stats.stop_timer("prompt_backward_s", start)

    def first_token_logps(self, pre: _Prefill, tree: ReplayTree, responses) -> list:
        """(response, token index 0, logp [1]) for each response, on the owner of prompt position P - 1."""
        if pre.last is None:
            return []
        return [(i, torch.zeros(1, dtype=torch.long, device=pre.last.device),
                 self.score(pre.last[None], tree.responses[i][:1]))
                for i in responses]

    def exchange(self, tree: ReplayTree, responses: list[int], owned: list, members) -> list:
        """Full scores of ``responses`` (float32, detached, identical on every member) from the tokens
        each member owns: an exact zero-filled sum. ``owned``: (response, token indices, scores)."""
        lens = [tree.response_lens[i] for i in responses]
        offsets = [sum(lens[:j]) for j in range(len(responses))]
        width = () if self.entropy_fn is None else (2,)
        buffer = torch.zeros(sum(lens), *width, dtype=torch.float32, device=tree.prompt.device)
        for i, idx, logp in owned:
            buffer[offsets[responses.index(i)] + idx] = logp.detach()
        full = all_gather_sum(buffer, members, self.group, self.logp_meter)
        return [full[o: o + n].clone() for o, n in zip(offsets, lens)]

    def backprop(self, t: int, responses: list[int], full: list, owned: list, keepalive: list) -> None:
        """Backpropagate d loss_fn(t, i, full_i) / d scores through the tokens this rank owns. ``keepalive``:
        outputs of this step's forward that own no scored token but must be reached by the backward (the
        primitives communicate in it)."""
        self.backward_step(lambda loss_fn: self._backprop(loss_fn, t, responses, full, owned, keepalive))

    def _backprop(self, loss_fn, t: int, responses: list[int], full: list, owned: list, keepalive: list) -> None:
        roots, grads, grad_of = [], [], {}
        for i, idx, logp in owned:
            if i not in grad_of:
                grad_of[i] = _loss_grad(loss_fn, t, i, full[responses.index(i)])
            roots.append(logp)
            grads.append(grad_of[i][idx])
        roots += keepalive
        grads += [torch.zeros_like(x) for x in keepalive]
        if roots:
            torch.autograd.backward(roots, grads)

    def replay_rows(self, resp: torch.Tensor, layout: ZigzagLayout, index: int, offset: int, ctx, i: int,
                    owned: list, keepalive: list) -> None:
        """Feed my shard of ``resp[:-1]`` (positions offset + j); fed token j scores response token j + 1.
        Appends (i, token indices [n], logp [n]) to ``owned``, or my empty output to ``keepalive``."""
        pos = layout.positions(index, device=resp.device)
        hidden = self.forward_shard(resp[pos], pos + offset, ctx)
        if pos.numel():
            owned.append((i, pos + 1, self.score(hidden, resp[pos + 1])))
        else:
            keepalive.append(hidden)

    # ---- the three schedules -------------------------------------------------------------------------

    def ring_tree(self, t: int, tree: ReplayTree, plan: Plan) -> list:
        meter, members = Meter(self.stats, "ring"), tuple(range(self.size))
        ring, p, out = Ring(self.group, members, self.rank), tree.prompt_len, []
        start = self.stats.start_timer(tree.prompt.device)
        for i, resp in enumerate(tree.responses):
            seq = torch.cat([tree.prompt, resp])
            layout = ZigzagLayout(seq.shape[0] - 1, self.size)
            pos = layout.positions(self.rank, device=seq.device)
            hidden = self.forward_shard(seq[pos], pos, RingContext(ring, layout, meter))
            scored = (pos >= p - 1).nonzero().squeeze(1)
            owned, keepalive = [], []
            if scored.numel():
                owned.append((i, pos[scored] - (p - 1), self.score(hidden[scored], seq[pos[scored] + 1])))
            else:
                keepalive.append(hidden)
            full = self.exchange(tree, [i], owned, members)
            self.backprop(t, [i], full, owned, keepalive)
            out += full
            self.stats.micro_batches += 1
        self.stats.stop_timer("replay_s", start)
        return out

    def tree_move_kv_tree(self, t: int, tree: ReplayTree, plan: Plan) -> list:
        meter = Meter(self.stats, "tree_move_kv")
        lane = next(l for l in range(plan.lanes) if self.rank in lane_members(self.size, plan.lanes, l))
        members = lane_members(self.size, plan.lanes, lane)
        index, ring = members.index(self.rank), Ring(self.group, members, members.index(self.rank))
        pre = self.prefill(tree.prompt, members, meter)
        start = self.stats.start_timer(tree.prompt.device)
        mine = sorted((r, i) for i, (r, l) in enumerate(plan.placement) if l == lane)
        lane_logps = {}
        for _, i in mine:
            resp = tree.responses[i]
            owned, keepalive = self.first_token_logps(pre, tree, [i]), []
            if resp.shape[0] > 1:
                layout = ZigzagLayout(resp.shape[0] - 1, len(members))
                ctx = LaneReplayContext(ring, layout, pre.layout, pre.leaf_kv, meter)
                self.replay_rows(resp, layout, index, tree.prompt_len, ctx, i, owned, keepalive)
                self.stats.micro_batches += 1
            full = self.exchange(tree, [i], owned, members)
            self.backprop(t, [i], full, owned, keepalive)
            lane_logps[i] = full[0]
        self.stats.stop_timer("replay_s", start)
        self.prompt_backward(pre)
        # Every rank returns every response: the first member of each lane contributes its lane's.
        everything = list(range(len(tree.responses)))
        shared = [(i, torch.arange(tree.response_lens[i], device=tree.prompt.device), logp)
                  for i, logp in lane_logps.items() if index == 0]
        return self.exchange(tree, everything, shared, tuple(range(self.size)))

    def move_q_tree(self, t: int, tree: ReplayTree, plan: Plan) -> list:
        meter, everyone = Meter(self.stats, "move_q"), tuple(range(self.size))
        lanes = [lane_members(self.size, plan.lanes, l) for l in range(plan.lanes)]
        lane = next(l for l, m in enumerate(lanes) if self.rank in m)
        index, ring = lanes[lane].index(self.rank), Ring(self.group, lanes[lane], lanes[lane].index(self.rank))
        pre = self.prefill(tree.prompt, everyone, meter)
        start = self.stats.start_timer(tree.prompt.device)
        out: dict[int, torch.Tensor] = {}
        for rnd in range(plan.rounds):
            cells = [[i for i, cell in enumerate(plan.placement) if cell == (rnd, l)] for l in range(plan.lanes)]
            for step in range(max(len(c) for c in cells)):
                step_resp = [c[step] if step < len(c) else None for c in cells]
                active = [i for i in step_resp if i is not None]
                owned, keepalive = self.first_token_logps(pre, tree, active), []
                fed = [tree.response_lens[i] - 1 if i is not None else 0 for i in step_resp]
                if any(fed):
                    layouts = [ZigzagLayout(n, len(m)) for n, m in zip(fed, lanes)]
                    counts = tuple(layouts[l].size(j) for l, m in enumerate(lanes) for j in range(len(m)))
                    ctx = MoveQReplayContext(self.group, self.rank, pre.layout, counts, ring, layouts[lane],
                                             pre.leaf_kv, meter)
                    i = step_resp[lane]
                    if i is None:  # idle lane: a dummy token keeps this rank serving its prompt shard
                        keepalive.append(self.forward_shard(tree.prompt[:0], tree.prompt[:0], ctx))
                    else:
                        self.replay_rows(tree.responses[i], layouts[lane], index, tree.prompt_len, ctx, i,
                                         owned, keepalive)
                    self.stats.micro_batches += 1
                full = self.exchange(tree, active, owned, everyone)
                self.backprop(t, active, full, owned, keepalive)
                out.update(zip(active, full))
        self.stats.stop_timer("replay_s", start)
        self.prompt_backward(pre)
        return [out[i] for i in range(len(tree.responses))]


def _loss_grad(loss_fn, t: int, i: int, scores: torch.Tensor) -> torch.Tensor:
    """d loss_fn(t, i, scores) / d scores, on a detached copy (zeros where the loss does not depend on it)."""
    leaf = scores.clone().requires_grad_()
    (grad,) = torch.autograd.grad(loss_fn(t, i, leaf), leaf, allow_unused=True)
    return grad if grad is not None else torch.zeros_like(leaf)
