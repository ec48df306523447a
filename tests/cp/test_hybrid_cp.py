"""Hybrid models (Gated DeltaNet + attention: Qwen3.5, Qwen3.5-MoE, Qwen3-Next) context-parallel, on real gloo
ranks: each linear-attention layer's state passes between the chunks through the state scan
(``cp.state_scan``) in every primitive that shards a sequence (RingCP's [prompt || response], TreeMoveKV's
and MoveQ's prompt prefill and their responses over a lane from the prompt's final state) and in a trie root
run context-parallel (``replay.cp_trie``).

Checked on every rank, as ``test_engine`` and ``test_cp_trie`` check attention-only models: log-probs equal the
flattened baseline's and the sum over ranks of every gradient equals the baseline's (float32, ``RTOL``), and
the bytes each rank sent equal the analytic count, the scan's formula (``scan_bytes``) included. The sequences
are sharded into chunks of odd lengths, shorter than the conv window (K = 4: a chunk's window then spans
earlier chunks), empty (a rank with no token runs a dummy row), and longer than and not a multiple of the
kernel's 64-token block; with activation checkpointing (the scan's gathers run again in the recompute) and
with the prompts' activations offloaded to the host.
"""

import pytest
import torch

from augtree_verl.cp.comm import Meter, Ring
from augtree_verl.cp.state_scan import AllGather
from augtree_verl.replay.offload import Offload
from augtree_verl.replay.stats import ReplayStats
from tests.cp.distributed import run_distributed
from tests.cp.test_cp_trie import _check as check_trie
from tests.cp.test_cp_trie import _cp_plan
from tests.cp.test_engine import check_call, ring_plan, split_plan
from tests.families import VOCAB, family_model
from tests.parity import random_trees
from tests.replay.test_trie import SHORT, sharing_batch

pytestmark = pytest.mark.slow  # spawns process groups

# Over 2 ranks (4 chunks): a prompt of 7 (chunks 2, 2, 2, 1: every window spans two chunks), 137 (35, 34, 34, 34)
# and 301 (76, 75, 75, 75: two kernel blocks each); responses of 10 (9 fed over a lane of 2: 3, 2, 2, 2), 2 (one
# fed token: one rank runs a dummy row) and 1 (none fed).
WORLD2_TREES = dict(prompt_lens=[7, 137, 301], response_lens=[[10, 2, 5], [6, 1, 3, 8], [4, 9]])
WORLD2_PLANS = [
    [
        ring_plan(2),
        split_plan("move_q", 2, 2, ((0, 0), (0, 1), (1, 0), (1, 1))),
        split_plan("tree_move_kv", 2, 1, ((0, 0), (1, 0))),
    ],
    [
        split_plan("tree_move_kv", 2, 2, ((0, 0), (0, 1), (1, 0))),
        split_plan("move_q", 2, 1, ((0, 0), (1, 0), (1, 0), (2, 0))),
        ring_plan(2),
    ],
]
# Qwen3-Next with more value heads than key heads (the layer repeats keys and queries up to H_v) and values
# narrower than keys: the state [H_v, D_k, D_v] and the summaries at their true widths.
NEXT_SIZES = dict(linear_num_value_heads=4, linear_value_head_dim=6)


def _world2(rank, world):
    # Seed 2: A_log's and dt_bias's gradients sum g_t's adjoint over every token, with cancellation; at seed 1
    # these trees put the float32 flattened baseline itself 8e-6 from float64 there, and the one-device replay
    # 1.3e-5 from it (the CP replay 1.6e-5). At seed 2 all three agree to 1.2e-6.
    model = family_model("qwen3.5", seed=2)
    trees = random_trees(**WORLD2_TREES, seed=3, vocab=VOCAB)
    for plans in WORLD2_PLANS:
        check_call(model, trees, plans)
    check_call(model, trees, WORLD2_PLANS[0], train=False, temperature=0.7)


def _world2_checkpointing_offload(rank, world):
    model = family_model("qwen3-next", seed=2, **NEXT_SIZES)
    trees = random_trees(**WORLD2_TREES, seed=4, vocab=VOCAB)
    check_call(model, trees, WORLD2_PLANS[1], offload=Offload(ReplayStats(), min_bytes=0))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for offload in (None, Offload(ReplayStats(), min_bytes=0)):
        check_call(model, trees, WORLD2_PLANS[0], forward_runs=2, offload=offload)


def _world4(rank, world):
    model = family_model("qwen3.5-moe", seed=5)
    # a prompt of 3 over 8 chunks leaves rank 3 without a token (a dummy row in every linear layer); 203 gives
    # chunks of 26 and 25; 13 chunks of 2 and 1
    trees = random_trees([3, 203, 13], [[5, 2, 7], [9, 3, 1, 4], [12, 6]], seed=6, vocab=VOCAB)
    check_call(
        model,
        trees,
        [
            split_plan("move_q", 4, 2, ((0, 0), (0, 1), (1, 0))),
            split_plan("tree_move_kv", 4, 2, ((0, 0), (0, 1), (1, 0), (1, 1))),
            ring_plan(4),
        ],
    )
    check_call(
        model,
        trees,
        [
            ring_plan(4),
            split_plan("move_q", 4, 1, ((0, 0), (0, 0), (1, 0), (1, 0))),
            split_plan("tree_move_kv", 4, 1, ((0, 0), (1, 0))),
        ],
    )


def _trie_root(rank, world):
    """A trie whose root (the 24-token system prompt) runs context-parallel: its linear layers' final state is on
    every member after the scan, gathered nowhere."""
    trees = sharing_batch(**SHORT)
    plans = _cp_plan(trees, world)
    check_trie(family_model("qwen3.5", seed=7), trees, plans, micro_batch_tokens=6, offload=Offload())
    model = family_model("qwen3-next", seed=8, **NEXT_SIZES)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    check_trie(model, trees, plans, forward_runs=2)


def _all_gather_sums_gradients_in_member_order(rank, world):
    """The scan's all-gather: every member's parts in member order, and each part's gradients from every member
    summed at its owner; bytes as ``scan_bytes`` counts them (e per element forward, the accumulation dtype's
    backward)."""
    stats = ReplayStats()
    ring = Ring(None, tuple(range(world)), rank)
    counts = [2 * j + 1 for j in range(world)]
    mine = torch.full((counts[rank],), float(rank), dtype=torch.float64, requires_grad=True)
    gathered = AllGather.apply(mine, ring, counts, Meter(stats, "ring"))
    assert gathered.tolist() == [float(j) for j in range(world) for _ in range(counts[j])]
    (gathered * (rank + 1)).sum().backward()
    assert mine.grad.tolist() == [float(sum(range(1, world + 1)))] * counts[rank]
    assert stats.comm_bytes["ring/fwd"] == 8 * counts[rank] * (world - 1)
    assert stats.comm_bytes["ring/bwd"] == 8 * (sum(counts) - counts[rank])


@pytest.mark.timeout(600)
def test_world2_every_primitive_matches_flattened():
    run_distributed(_world2, 2)


@pytest.mark.timeout(600)
def test_world2_checkpointing_and_offload():
    run_distributed(_world2_checkpointing_offload, 2)


@pytest.mark.timeout(600)
def test_world4_lanes_and_a_rank_without_tokens():
    run_distributed(_world4, 4)


@pytest.mark.timeout(600)
def test_trie_root_context_parallel():
    run_distributed(_trie_root, 2)


@pytest.mark.timeout(200)
def test_all_gather():
    run_distributed(_all_gather_sums_gradients_in_member_order, 4)
