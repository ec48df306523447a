"""The cost model counts what the replay runs: padded micro-batches on one device, a call per micro-batch or CP
step, a slot per tree, a score exchange per CP step, lock-step padding calls, causal and full attention."""

import dataclasses

import numpy as np
import pytest
import torch

from augtree_verl.cp.bytes import AttentionShape
from augtree_verl.cp.layout import ZigzagLayout
from augtree_verl.cp.state_scan import scan_bytes as scan_bytes_of
from augtree_verl.groups import GroupLengths, Tree
from augtree_verl.planner import ClusterProfile, plan_tree
from augtree_verl.planner.cost import CostModel, cost_model
from augtree_verl.planner.search import _Search
from augtree_verl.replay.memory import ReplayMemory
from augtree_verl.replay.microbatch import DEFAULT_MICRO_BATCH_TOKENS
from augtree_verl.replay.trie import build_trie
from tests.families import family_model

# Round numbers, so that every term of a time can be told apart.
UNIT = dataclasses.replace(
    ClusterProfile.default(),
    flops_per_s=1e12,
    attention_flops_per_s=1e12,
    causal_attention_flops_per_s=5e11,
    call_overhead_s=1e-3,
    slot_overhead_s=1e-2,
    launch_latency_s=1e-4,
    ring_hop_s=1e-5,
    all_to_all_s=1e-6,
    activation_checkpointing=False,
)
NO_FIXED_COSTS = dataclasses.replace(
    UNIT,
    call_overhead_s=1e-300,
    slot_overhead_s=1e-300,
    launch_latency_s=1e-300,
    ring_hop_s=1e-300,
    all_to_all_s=1e-300,
)
REL = 1e-9  # the same float64 sums in another order


def test_one_device_runs_padded_micro_batches_one_call_each():
    cost = CostModel(UNIT)
    P, R = 300, [2437, 1470, 1346, 1287]  # micro-batches [2437, 1470, 1346] (padded to 2437) and [1287]
    assert DEFAULT_MICRO_BATCH_TOKENS == 8192
    want = 2 * UNIT.call_overhead_s
    for n, longest in ((3, 2437), (1, 1287)):
        want += 3 * (
            (cost.lin_flops + cost.head_flops) * n * longest / 1e12
            + cost.attn_flops * n * longest * P / 1e12
            + cost.attn_flops * n * longest**2 / 2 / 5e11
        )
    assert cost.one_device(P, R) == pytest.approx(want, rel=REL)


def test_every_plan_of_degree_one_is_the_one_device_time_with_one_slot():
    P, R = 900, [500, 40, 300, 800]
    cost = CostModel(UNIT)
    prefill = 3 * (cost.lin_flops * P / 1e12 + cost.attn_flops * P * P / 2 / 5e11) + UNIT.slot_overhead_s
    for primitive in ("ring", "tree_move_kv", "move_q"):
        plan = plan_tree(P, R, degrees=[1], profile=UNIT, force_primitive=primitive)
        assert plan.est_time_s == pytest.approx(prefill + cost.one_device(P, R), rel=REL), primitive


def test_a_cp_step_pays_a_call_ring_hops_and_a_score_exchange():
    """A response replayed on a lane of 2 ranks: one call, the K/V ring's L (f (k-1) + k) = 6 hops (2 layers)
    and the step's score exchange."""
    R = np.array([100.0, 300.0, 50.0])
    profile = dataclasses.replace(UNIT, num_layers=2)
    compute, comm = CostModel(profile).tree_responses(4000, R, 2)
    free_compute, free_comm = CostModel(dataclasses.replace(NO_FIXED_COSTS, num_layers=2)).tree_responses(4000, R, 2)
    assert compute - free_compute == pytest.approx([UNIT.call_overhead_s] * 3, rel=REL)
    assert comm - free_comm == pytest.approx([6 * UNIT.ring_hop_s + UNIT.launch_latency_s] * 3, rel=REL)


def test_lanes_in_lock_step_pad_with_calls_and_share_their_scores():
    """Two lanes of one rank, responses [1000, 10, 10]: the long one alone on its lane, which then makes a
    dummy call while the other lane replays its second response; one exchange shares the lanes' scores."""
    profile = dataclasses.replace(UNIT, call_overhead_s=0.25)
    R = [1000, 10, 10]
    search = _Search(cost_model(profile), GroupLengths(64, R))
    (two_lanes,) = [c for c in search.candidates([2], "tree_move_kv") if c.lanes == 2]
    search.exact(two_lanes)
    compute, comm = CostModel(profile).tree_responses(64, np.array(R, dtype=float), 1)
    assert two_lanes.parts[1] == pytest.approx(max(compute[0] + 0.25, compute[1] + compute[2]), rel=REL)
    lane_comm = comm[0] if compute[0] + 0.25 >= compute[1] + compute[2] else comm[1] + comm[2]
    assert two_lanes.parts[2] == pytest.approx(lane_comm + UNIT.launch_latency_s, rel=REL)


def test_move_q_rounds_exchange_their_scores():
    cost, free = CostModel(UNIT), CostModel(NO_FIXED_COSTS)
    _, comm = cost.moveq_owners(8192, 400.0, rounds=3, d=2)
    _, free_comm = free.moveq_owners(8192, 400.0, rounds=3, d=2)
    # per round: three all-to-alls per layer and direction (x ceil(log2 2) = 1), and one score exchange
    assert comm - free_comm == pytest.approx(
        3 * (cost.moveq_steps_per_round * UNIT.all_to_all_s + UNIT.launch_latency_s), rel=REL
    )


def test_causal_blocks_run_at_the_causal_throughput():
    P = 2048
    slower, _ = CostModel(UNIT).prefill(P, 1)
    faster, _ = CostModel(dataclasses.replace(UNIT, causal_attention_flops_per_s=1e12)).prefill(P, 1)
    assert slower - faster == pytest.approx(3 * UNIT.attention_pair_flops * P * P / 2 * (1 / 5e11 - 1 / 1e12), rel=REL)


def test_a_zigzag_shard_runs_its_diagonal_chunks_causal_and_the_rest_full():
    """P tokens over 4 ranks: chunks of P/8, two per rank; its two diagonal chunks are causal blocks (P^2/64
    visible pairs), the rest of its P^2/8 pairs full blocks. On one rank, one causal block of P^2/2."""
    cost, P = CostModel(UNIT), 8000
    full, causal = cost.attention_split(P, 4)
    assert causal == pytest.approx(UNIT.attention_pair_flops * P * P / 64, rel=REL)
    assert full + causal == pytest.approx(UNIT.attention_pair_flops * P * P / 8, rel=REL)
    assert cost.attention_split(P, 1) == pytest.approx((0.0, UNIT.attention_pair_flops * P * P / 2), rel=REL)


def _tokens(*lengths: int):
    """Distinct token ids in consecutive runs of ``lengths``."""
    out, start = [], 0
    for n in lengths:
        out.append(torch.arange(start, start + n))
        start += n
    return out


def test_a_groups_depth_one_trie_costs_its_tree_on_one_device():
    P, R = 900, [500, 40, 300, 800]
    prompt, *responses = _tokens(P, *R)
    [root] = build_trie([Tree.of_tokens(prompt, responses)])
    cost = CostModel(UNIT)
    assert cost.trie(root) == pytest.approx(cost.prefill(P, 1)[0] + cost.one_device(P, R), rel=REL)


def test_a_shared_system_prompt_is_one_prefill_each_prompt_attends_to_it():
    """Two trees whose prompts begin with one 600-token system prompt: the trie's root is the system prompt
    (one slot), each prompt's own 100 tokens a prefill against its 600 keys, then their responses."""
    system, own_a, own_b, *responses = _tokens(600, 100, 100, 50, 70, 60, 80)
    trees = [
        Tree.of_tokens(torch.cat([system, own_a]), responses[:2]),
        Tree.of_tokens(torch.cat([system, own_b]), responses[2:]),
    ]
    [root] = build_trie(trees)
    cost = CostModel(UNIT)
    own = (
        3 * (cost.lin_flops * 100 / 1e12 + cost.attn_flops * 100 * 600 / 1e12 + cost.attn_flops * 100 * 100 / 2 / 5e11)
        + UNIT.slot_overhead_s
    )
    want = cost.prefill(600, 1)[0] + 2 * own + cost.one_device(700, [50, 70]) + cost.one_device(700, [60, 80])
    assert root.length == 600 and cost.trie(root) == pytest.approx(want, rel=REL)


def test_a_hybrids_sharded_sequence_moves_the_state_scans_bytes():
    """A hybrid (Qwen3.5: one Gated DeltaNet layer, one attention layer): the K/V ring counts the attention layer
    only, and each sequence sharded over k ranks adds the state scan's bytes, ``cp.state_scan.scan_bytes`` per
    linear layer (forward per pass, then backward) for chunks of at least K - 1 tokens, and its all-gathers."""
    config = family_model("qwen3.5").config
    hybrid = dataclasses.replace(UNIT.with_model(config), activation_checkpointing=True)
    attention_only = dataclasses.replace(hybrid, num_layers=1, linear_layers=0)
    shape = AttentionShape.of(config, hybrid.dtype_bytes)
    cost, kv = CostModel(hybrid), CostModel(attention_only)
    for k in (2, 4):
        per_layer = [
            scan_bytes_of(ZigzagLayout(1000, k), member, shape.linear, hybrid.dtype_bytes) for member in range(k)
        ]
        assert {2 * b["fwd"] + b["bwd"] for b in per_layer} == {cost.scan_bytes(k) / shape.linear_layers}
        seconds = cost.scan_bytes(k) / hybrid.p2p_bytes_per_s + 2 * 3 * hybrid.launch_latency_s
        assert cost.ring_comm(500, k) == pytest.approx(kv.ring_comm(500, k) + seconds, rel=REL)
    assert cost.ring_comm(500, 1) == 0 and kv.scan_bytes(4) == 0


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("family", ["qwen2", "deepseek-v3", "qwen3.5"])
def test_the_planners_memory_is_the_guards_on_the_same_tree(family, checkpointing):
    """One model of memory: a plan of degree 1 needs what the step's memory guard (``replay.memory``) counts for
    the tree's trie, byte for byte, so a budget just under it leaves the planner no one-device plan (the guard
    would refuse the step) and one at it keeps that plan."""
    config = family_model(family).config
    profile = dataclasses.replace(
        UNIT.with_model(config), activation_checkpointing=checkpointing, dtype_bytes=2, memory_per_rank_bytes=1e18
    )
    guard = ReplayMemory.of(config, dtype=torch.bfloat16, checkpointing=checkpointing, train=True, budget_bytes=1 << 62)
    gen = torch.Generator().manual_seed(0)
    for P, R in [(3000, [5000, 40, 1700, 4000, 3]), (1, [2, 1]), (20000, [7000, 20, 20, 20])]:
        tree = Tree.of_tokens(torch.randint(0, 100, (P,), generator=gen), [torch.randint(0, 100, (r,)) for r in R])
        (root,) = build_trie([tree], micro_batch_tokens=DEFAULT_MICRO_BATCH_TOKENS)
        peak, _ = guard.peak(root, offload=False)
        assert cost_model(profile).one_device_memory(P, R) == peak
        over = dataclasses.replace(profile, memory_per_rank_bytes=float(peak))
        assert plan_tree(P, R, degrees=(1,), profile=over).degree == 1
        under = dataclasses.replace(profile, memory_per_rank_bytes=float(peak - 1))
        with pytest.raises(ValueError, match="no plan fits in memory"):
            plan_tree(P, R, degrees=(1,), profile=under)
        assert plan_tree(P, R, degrees=(1, 2), profile=under).degree == 2
