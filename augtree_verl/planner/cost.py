"""The planner's cost model: per-rank time and memory of one replay tree under each primitive.

Notation: P prompt tokens, R_i response tokens, L layers, H hidden size, I MLP width, V vocab,
H_q / H_kv query / key-value heads, D_k the query/key head width and D_v the value width (equal but for
multi-head latent attention), e bytes per element (``dtype_bytes``), a = max(4, e) bytes per
gradient-accumulator element, F / F_attn / F_causal achieved dense / attention
FLOP/s (full and causal blocks).

Compute (summed over layers, forward only, per token or per query-key pair; ``model_shape.ModelShape``):
    lin  = L * (2H(H_q D_k + H_kv (D_k + D_v)) + 2 H_q D_v H + 6 H I)   QKV and output projections, SwiGLU MLP
    head = 2 H V                                        LM head, only for scored (response) tokens
    attn = L * 2 H_q (D_k + D_v)                        QK^T and PV per (query, key) pair; causal halves it
Training multiplies forward FLOPs by f + 2 (backward = 2 x forward), f = 2 forward passes with activation
checkpointing (the forward runs again in backward), else 1. A pass (one forward+backward over a chunk of
tokens) costs (f + 2) (dense / F + attention / F_attn + causal attention / F_causal): the prompt-to-prompt and
response-to-response blocks are causal, a response's queries against the prompt's keys full.

Fixed costs, what short steps are made of (fitted by the calibration on the replay itself, the CP ones on
the CP group):
    each response call (one device: a micro-batch; CP: a step): ``call_overhead_s`` (a decoder call, an
    LM-head call, the loss and the backward, beyond their FLOPs); each tree (a slot): ``slot_overhead_s``
    (its prefill call and delayed prompt backward); each exchange among more than one rank (a CP step's
    score exchange, a MoveQ round's, a TreeMoveKV tree's lane share): ``launch_latency_s``, with what a CP
    step adds around it; each K/V ring hop of a layer (below): ``ring_hop_s``; each all-to-all of a layer
    (MoveQ): ``all_to_all_s``.
A trie of trees sharing tokens beyond a group's prompt (``replay.trie``) runs on one device node by node
(``CostModel.trie``): each inner node a prefill against its ancestors' keys, its leaves as below.
One device (any plan of degree 1) runs the responses as padded micro-batches of ``DEFAULT_MICRO_BATCH_TOKENS``
(rows x longest row, ``replay.microbatch``): each row computes as many tokens as the longest.

Communication per rank (bytes / bandwidth + a fixed cost per sequential step: ``ring_hop_s`` for the K/V ring,
``all_to_all_s`` for MoveQ, ``launch_latency_s`` for the state scan's all-gathers; no overlap credited),
mirroring what the CP engine sends (cp/ring.py, cp/move_q.py, cp/state_scan.py, and ``cp.bytes.analytic_bytes``).
L counts the attention layers (a hybrid's L_lin Gated DeltaNet layers move no K/V and run no MoveQ):
    K/V ring over k > 1 ranks, keys of N tokens, kv = L H_kv (D_k + D_v):
        bytes = (f + 1) (k-1)/k N kv e  +  N kv a
        (each forward relays the other members' K/V blocks; backward relays them again, and every block's
        dK/dV accumulator visits all k members, so a rank sends k accumulators of N/k tokens)
        steps = L (f (k-1) + k)
        TreeMoveKV replaying R in a lane of m ranks carries N = P + R: C_TreeMoveKV ~ 2(L_P + L_R) H_kv.
    MoveQ, Q queries over d prompt owners: bytes = (d-1)/d Q L H_q (f (e (D_k + D_v) + 4) + (e (D_k + 2 D_v) + 4))
        forward: the queries travel (e D_k per head) and the owners return partial states (e D_v + 4 lse);
        backward: (dout, merged out, lse) travel (2 e D_v + 4), dq returns (e D_k): C_MoveQ ~ L_R H_q + T_red.
        steps = rounds L (3 f + 3) ceil(log2 d): three all-to-alls per layer forward, three backward; and
        each round one score exchange among all d.
    State scan of a hybrid, per sequence sharded over k > 1 ranks (a prefill, RingCP's [P || R_i], a response
    over a lane), two chunks per rank of at least K - 1 tokens, s = 4 H_v D_k (D_k + D_v) a chunk's summary,
    w = (K - 1)(2 H_k D_k + H_v D_v) its conv tail:
        bytes = 2 (k-1) L_lin (f (e w + s) + (a w + s)), independent of the sequence's length
        steps = 2 L_lin (f + 1): two all-gathers per layer and pass, two returns backward

Memory per rank, in the step's memory guard's per-token bytes (``replay.memory.ReplayMemory``: saved
activations, one layer's working set, prompt K/V leaves and their gradient sums, the LM head's logits per
scored token): a plan of degree 1 at exactly the guard's peak of the tree alone (``one_device_memory``: no
offload, ``DEFAULT_MICRO_BATCH_TOKENS``), so the planner never picks a one-device plan the guard would refuse
for that tree; CP plans per rank with their shards, ring/exchange buffers and float32 log-prob outputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from augtree_verl.cp.mesh import CPMesh
from augtree_verl.ops.gated_delta import STATE_DTYPE
from augtree_verl.plan import Plan
from augtree_verl.planner.profile import ClusterProfile
from augtree_verl.replay.cp_trie_schedule import cp_trie_shares
from augtree_verl.replay.lockstep import CPTreeSlot, CPTrieSlot, DummySlot, Slot, TrieSlot
from augtree_verl.replay.memory import ReplayMemory
from augtree_verl.replay.microbatch import DEFAULT_MICRO_BATCH_TOKENS, split_micro_batches
from augtree_verl.replay.step_plan import StepPlan
from augtree_verl.replay.trie import MIN_SHARED_TOKENS, StepTrie

LSE_BYTES = 4  # float32 log-sum-exp per query and head in MoveQ's partial states
MOVEQ_COLLECTIVES = 3  # all-to-alls per layer and direction: queries, outputs, lse (fwd); dout+out, lse, dq
RING_BUFFERS = 4  # send + receive buffers for K/V, and again for dK/dV, one layer at a time
OUTPUT_BYTES_PER_TOKEN = 4  # float32 log-probs of every response, held on every rank


class CostModel:
    """Vectorised cost formulas for one profile. Arrays are float64 [G] over a tree's responses."""

    def __init__(self, profile: ClusterProfile):
        p = profile
        self.profile = p
        Hq, Dk, Dv, beta = p.num_heads, p.head_dim, p.value_head_dim, p.dtype_bytes
        shape = p.shape
        kv_width = shape.kv_width  # H_kv (D_k + D_v): one token's K and V in one layer
        forward_passes = 2 if p.activation_checkpointing else 1
        self.forward_passes = forward_passes
        self.train_factor = p.train_factor
        self.lin_flops, self.head_flops, self.attn_flops = p.linear_flops, p.head_flops, p.attention_pair_flops
        La = self.attention_layers = shape.attention_layers  # the layers that keep and move K/V
        self.kv_bytes = La * kv_width * beta
        # Ring bytes per key token: relays (times (k-1)/k) and float32 (or wider) dK/dV accumulators.
        self.ring_relay_bytes = (forward_passes + 1) * self.kv_bytes
        self.ring_accumulator_bytes = La * kv_width * max(4, beta)
        self.query_state_bytes = La * Hq * ((Dk + Dv) * beta + LSE_BYTES)  # q out, (O, lse) back
        self.moveq_bytes = (
            La * Hq * (forward_passes * ((Dk + Dv) * beta + LSE_BYTES) + (Dk + 2 * Dv) * beta + LSE_BYTES)
        )
        self.moveq_steps_per_round = La * MOVEQ_COLLECTIVES * (forward_passes + 1)
        # The state scan, per other rank of the ring: two chunks' conv tails and summaries each pass, back again.
        summary = (
            STATE_DTYPE.itemsize
            * shape.linear_heads
            * shape.linear_key_dim
            * (shape.linear_key_dim + shape.linear_value_dim)
        )
        tail = (shape.linear_conv_kernel - 1) * shape.linear_conv_dim
        lin = len(shape.linear_layers)
        self.scan_bytes_per_peer = 2 * lin * (forward_passes * (beta * tail + summary) + max(4, beta) * tail + summary)
        self.scan_steps = 2 * lin * (forward_passes + 1)
        # Per-token bytes of activations, K/V and logits: the step's memory guard's (``replay.memory``), one model.
        self.memory = ReplayMemory.of_shape(
            shape, dtype_bytes=beta, checkpointing=p.activation_checkpointing, train=True
        )
        self.saved_bytes_per_token = self.memory.saved
        self.working_bytes_per_token = self.memory.layer
        self.prompt_kv_bytes_per_token = self.memory.kv + self.memory.kv_sum  # K/V leaves and their gradient sums
        self.logit_bytes_per_token = self.memory.head
        self.exchange_layers_kept = 1 if p.activation_checkpointing else La

    # ---- building blocks (``ranks`` may be an int or an int array broadcasting against the tokens) ----
    def _bandwidth(self, ranks, collective: bool):
        p = self.profile
        intra = p.collective_bytes_per_s if collective else p.p2p_bytes_per_s
        return np.where(ranks > p.ranks_per_node, p.internode_bytes_per_s, intra)

    def pass_time(self, dense_flops, attention_flops, causal_flops=0.0):
        """Seconds of the FLOPs of one forward+backward pass on a rank (dense: projections, MLP, LM head;
        attention: query-key pairs x ``attn_flops`` in full blocks, and in causal blocks)."""
        p = self.profile
        return self.train_factor * (
            dense_flops / p.flops_per_s
            + attention_flops / p.attention_flops_per_s
            + causal_flops / p.causal_attention_flops_per_s
        )

    def attention_split(self, n, ranks):
        """Attention FLOPs (in full blocks, in causal blocks) one rank computes of a causal sequence of n tokens:
        on one rank one causal block; zigzag-sharded over k > 1 ranks (chunks of c = n / 2k, two per rank),
        the two diagonal chunks' causal blocks (c^2 visible pairs) and full blocks for the rest of its
        n^2 / 2k pairs."""
        total = self.attn_flops * n * n / 2 / ranks
        causal = np.where(ranks > 1, self.attn_flops * n * n / (4 * ranks * ranks), total)
        return total - causal, causal

    def exchange(self, ranks):
        """Seconds of one small exchange among ``ranks`` (a step's scores): a latency, 0 for one rank."""
        return np.where(ranks > 1, self.profile.launch_latency_s, 0.0)

    def ring_comm(self, kv_tokens, ranks):
        """Seconds a rank spends rotating ``kv_tokens`` tokens' K/V around a ring of ``ranks`` (fwd+bwd),
        K/V relays and dK/dV accumulators as the engine sends them, with a hybrid's state scan of the sequence
        (``scan_comm``); 0 for one rank."""
        p = self.profile
        nbytes = kv_tokens * ((ranks - 1) / ranks * self.ring_relay_bytes + self.ring_accumulator_bytes)
        steps = self.attention_layers * (self.forward_passes * (ranks - 1) + ranks)
        seconds = nbytes / self._bandwidth(ranks, False) + steps * p.ring_hop_s
        return np.where(ranks > 1, seconds, 0.0) + self.scan_comm(ranks)

    def scan_bytes(self, ranks):
        """Bytes a rank sends in a hybrid's state scan of one sequence over ``ranks`` (fwd+bwd, all its linear
        layers; 0 without them or on one rank)."""
        return (ranks - 1) * self.scan_bytes_per_peer

    def scan_comm(self, ranks):
        """Seconds of ``scan_bytes`` and the scan's all-gathers (a latency each); 0 on one rank."""
        seconds = (
            self.scan_bytes(ranks) / self._bandwidth(ranks, False) + self.scan_steps * self.profile.launch_latency_s
        )
        return np.where((ranks > 1) & (self.scan_steps > 0), seconds, 0.0)

    def prefill(self, P: int, ranks):
        """(compute s, comm s) of the prompt's forward + delayed backward sharded over a ring of ``ranks``,
        with the slot's fixed cost."""
        return self.pass_time(
            self.lin_flops * P / ranks, *self.attention_split(P, ranks)
        ) + self.profile.slot_overhead_s, self.ring_comm(P, ranks)

    def one_device(self, P: int, R) -> float:
        """Seconds of the responses R [G] of a tree on one device (after its prefill): padded micro-batches
        of up to ``DEFAULT_MICRO_BATCH_TOKENS`` tokens (rows x longest row), one call each."""
        total = 0.0
        for rows in split_micro_batches([int(r) for r in R], DEFAULT_MICRO_BATCH_TOKENS):
            n, longest = len(rows), float(max(R[i] for i in rows))
            total += float(
                self.pass_time(
                    (self.lin_flops + self.head_flops) * n * longest,
                    self.attn_flops * n * longest * P,
                    self.attn_flops * n * longest**2 / 2,
                )
            )
            total += self.profile.call_overhead_s
        return total

    def trie(self, node) -> float:
        """Seconds of a trie (``replay.trie.TrieNode``, its root or any node) on one device, as ``TrieRun``
        replays it: each inner node one prefill of its tokens against its ancestors' keys (full blocks) and
        its own (causal), with the LM head on the tokens it scores and a slot's fixed cost; its leaves as
        padded micro-batches against the path (``one_device``); then its inner children. A group's depth-1
        trie costs ``prefill(P, 1)[0] + one_device(P, R)``."""
        leaves = self.one_device(node.end, [leaf.length for leaf in node.leaves]) if node.leaves else 0.0
        return self.node_prefill(node) + leaves + sum(self.trie(child) for child in node.inner)

    def node_prefill(self, node) -> float:
        """Seconds of one trie node's prefill on one device (its part of ``trie``): its tokens against its
        ancestors' keys (full blocks) and its own (causal), the LM head on the tokens it scores, a slot's
        fixed cost."""
        n, scored = node.length, node.end - node.score_from if node.score_from is not None else 0
        return (
            float(
                self.pass_time(
                    self.lin_flops * n + self.head_flops * scored,
                    self.attn_flops * n * node.start,
                    self.attn_flops * n * n / 2,
                )
            )
            + self.profile.slot_overhead_s
        )

    def cp_trie(self, root, degree: int) -> float:
        """Seconds of a trie whose root (``replay.trie.TrieNode``) runs context-parallel over ``degree`` ranks
        (``replay.cp_trie``): the root's ring prefill (``prefill``), the all-gather of its K/V and the return of
        their float32 gradients (two collectives per layer among the ``degree`` ranks), then the slowest
        member's share of the root's children (``cp_trie_schedule``: its leaf micro-batches as ``one_device``,
        its subtrees as ``trie``), its leaves in the root's ``micro_batches``."""
        p, leaves = self.profile, root.leaves
        compute, comm = self.prefill(root.length, degree)
        moved = root.length * (degree - 1) / degree * (self.kv_bytes + self.ring_accumulator_bytes)
        comm = comm + moved / self._bandwidth(degree, True) + 2 * self.attention_layers * p.launch_latency_s

        def share(s) -> float:
            batches = [[leaves[k].length for k in root.micro_batches[b]] for b in s.batches]
            return sum(self.one_device(root.end, lengths) for lengths in batches) + sum(
                self.trie(root.inner[j]) for j in s.inner
            )

        return float(compute + comm) + max(share(s) for s in cp_trie_shares(root, degree))

    # ---- per-primitive times: [K, G] arrays for ranks [K, 1] and response lengths R [G] ------------
    def ring_sequences(self, P: int, R, d):
        """RingCP: (compute s, comm s) per response of [P || R_i] sharded over d ranks, prompt recomputed;
        one call and one score exchange each."""
        seq = P + R
        dense = (self.lin_flops * seq + self.head_flops * R) / d
        return (
            self.pass_time(dense, *self.attention_split(seq, d)) + self.profile.call_overhead_s,
            self.ring_comm(seq, d) + self.exchange(d),
        )

    def tree_responses(self, P: int, R, m):
        """TreeMoveKV: (compute s, comm s) per response replayed in a lane of m ranks (prompt + own K/V ring),
        one call and one score exchange among the lane each."""
        dense = (self.lin_flops + self.head_flops) * R / m
        full, causal = self.attention_split(R, m)
        return (
            self.pass_time(dense, full + self.attn_flops * R * P / m, causal) + self.profile.call_overhead_s,
            self.ring_comm(P + R, m) + self.exchange(m),
        )

    def moveq_lane(self, R, m):
        """MoveQ, lane-local part: (compute s, comm s) of response R's projections, MLP, head and causal
        self-attention sharded over its lane's m ranks (its own K/V ring), one call each."""
        dense = (self.lin_flops + self.head_flops) * R / m
        return (self.pass_time(dense, *self.attention_split(R, m)) + self.profile.call_overhead_s, self.ring_comm(R, m))

    def moveq_owners(self, P: int, queries: float, rounds: int, d: int) -> tuple[float, float]:
        """MoveQ, all rounds together: (compute s, comm s) of every owner scoring ``queries`` queries against
        its P/d prompt keys, and of moving queries and partial states (three all-to-alls per layer and
        direction per round) and each round's scores (one exchange among all d)."""
        p = self.profile
        compute = self.train_factor * self.attn_flops * queries * P / d / p.attention_flops_per_s
        if d == 1:
            return compute, 0.0
        bandwidth = p.internode_bytes_per_s if d > p.ranks_per_node else p.collective_bytes_per_s
        per_rank = (d - 1) / d * queries * self.moveq_bytes / bandwidth
        steps = rounds * (self.moveq_steps_per_round * math.ceil(math.log2(d)) * p.all_to_all_s + p.launch_latency_s)
        return compute, per_rank + steps

    # ---- per-primitive memory (bytes per rank) ---------------------------------------------------
    def one_device_memory(self, P: int, R) -> float:
        """Peak bytes of a tree replayed on one device (any plan of degree 1): the memory guard's peak of it
        (``ReplayMemory.tree_peak``, responses micro-batched as ``one_device`` times them; no offload)."""
        return float(self.memory.tree_peak(P, [int(r) for r in R], DEFAULT_MICRO_BATCH_TOKENS, offload=False))

    def _ring_buffer(self, kv_tokens_per_rank: float) -> float:
        return RING_BUFFERS * kv_tokens_per_rank * self.kv_bytes / self.attention_layers

    def ring_memory(self, P: int, R_max: float, R_sum: float, d: int) -> float:
        seq = (P + R_max) / d
        return (
            seq * (self.saved_bytes_per_token + self.working_bytes_per_token)
            + R_max / d * self.logit_bytes_per_token
            + self._ring_buffer(seq)
            + OUTPUT_BYTES_PER_TOKEN * R_sum
        )

    def tree_memory(self, P: int, R_max: float, R_sum: float, m: int) -> float:
        prompt = P / m
        response = R_max / m
        resident = prompt * (self.saved_bytes_per_token + self.prompt_kv_bytes_per_token)
        peak = max(
            prompt * self.working_bytes_per_token,
            response * (self.saved_bytes_per_token + self.working_bytes_per_token + self.logit_bytes_per_token),
        )
        return resident + peak + self._ring_buffer(prompt + response) + OUTPUT_BYTES_PER_TOKEN * R_sum

    def moveq_memory(self, P: int, R_max: float, R_sum: float, round_max_queries: float, d: int, m: int) -> float:
        prompt = P / d
        response = R_max / m
        resident = prompt * (self.saved_bytes_per_token + self.prompt_kv_bytes_per_token)
        exchange = round_max_queries * self.query_state_bytes / self.attention_layers * self.exchange_layers_kept
        peak = max(
            prompt * self.working_bytes_per_token,
            response * (self.saved_bytes_per_token + self.working_bytes_per_token + self.logit_bytes_per_token)
            + exchange,
        )
        return resident + peak + self._ring_buffer(max(prompt, response)) + OUTPUT_BYTES_PER_TOKEN * R_sum


@lru_cache(maxsize=16)
def cost_model(profile: ClusterProfile) -> CostModel:
    """The (cached) cost model of a profile; profiles are frozen and hashable."""
    return CostModel(profile)


def slot_seconds(cost: CostModel, slot: Slot, plans: Sequence[Plan | None]) -> float:
    """Predicted seconds of one lock-step slot: a trie on one device at ``CostModel.trie``, a trie with a
    context-parallel root at ``CostModel.cp_trie``, a CP tree at its plan's estimate, padding at 0."""
    match slot:
        case TrieSlot():
            return cost.trie(slot.node)
        case CPTrieSlot():
            return cost.cp_trie(slot.node, slot.degree)
        case CPTreeSlot():
            return plans[slot.tree].est_time_s
        case DummySlot():
            return 0.0
    raise TypeError(f"not a lock-step slot: {slot!r}")


def step_seconds(
    trees,
    plans,
    cp_size: int,
    profile: ClusterProfile,
    *,
    min_shared_tokens: int = MIN_SHARED_TOKENS,
    choose_roots: bool = True,
) -> float:
    """Predicted seconds of one step replaying ``trees`` (``groups.Tree.of_tokens``) with ``plans`` (one ``Plan``
    or None per tree; None for all: one device) on a CP group of ``cp_size`` ranks, placed as the step plan
    places them (``StepPlan.build`` at each rank of ``CPMesh.for_planning``): a rank's tries on one device at
    ``CostModel.trie``, its tries with a context-parallel root at ``CostModel.cp_trie``, its CP trees at their
    plans' estimates; the slowest rank's sum. Each tree's plan was made alone, so only this sees the sharing
    between trees. ``choose_roots``: the step plan chooses each trie's arrangement with this cost model, as the
    engine does (False: the plans alone decide, as without a cost model)."""
    cost = cost_model(profile)
    plans = list(plans) if plans is not None else [None] * len(trees)
    ranks = [None] if cp_size == 1 else [CPMesh.for_planning((1, cp_size), r) for r in range(cp_size)]
    trie = StepTrie(trees, min_shared_tokens=min_shared_tokens)
    return max(
        sum(
            slot_seconds(cost, slot, plans)
            for slot in StepPlan.build(
                trees,
                plans=plans,
                mesh=mesh,
                trie=trie,
                min_shared_tokens=min_shared_tokens,
                trie_cost=cost if cp_size > 1 and choose_roots else None,
            ).slots
        )
        for mesh in ranks
    )
