"""MoveQ at the attention level: a prompt sharded over all d ranks, one response per lane, queries moved
to the prompt owners; every rank's output/grad shards vs plain attention, and the bytes it sends; with the value
width equal to the query/key width and (world 2) apart from it on both sides."""

import pytest
import torch

from augtree_verl.cp.comm import Meter, Ring
from augtree_verl.cp.layout import ZigzagLayout, lane_members
from augtree_verl.cp.move_q import MoveQSpec, move_q_attention, move_q_bytes
from augtree_verl.cp.ring import RingSpec
from augtree_verl.replay.stats import ReplayStats
from tests.cp.attention_reference import (
    HEADS,
    KV_HEADS,
    RTOL,
    SCALE,
    WIDTHS,
    prefix_causal_reference,
    random_heads,
    rel,
)
from tests.cp.distributed import run_distributed

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses


def _move_q_member(rank, world, prompt_len, response_lens, lanes, dtype, widths):
    """``response_lens[l]``: the response lane l replays in this step (0 = the lane is idle); ``widths``: (D_k, D_v)."""
    g = torch.Generator().manual_seed(prompt_len * 7 + sum(response_lens))
    pk_full, pv_full = (random_heads(KV_HEADS, prompt_len, dtype, g, d) for d in widths)
    refs = [
        prefix_causal_reference(prompt_len, r, dtype, seed=100 + lane, prefix_kv=(pk_full, pv_full), widths=widths)
        for lane, r in enumerate(response_lens)
    ]
    members = [lane_members(world, lanes, lane) for lane in range(lanes)]
    my_lane = next(l for l, m in enumerate(members) if rank in m)
    lane_layouts = [ZigzagLayout(r, len(m)) for r, m in zip(response_lens, members)]
    counts = tuple(lane_layouts[l].size(m.index(r)) for l, m in enumerate(members) for r in m)
    mine = members[my_lane]
    layout = lane_layouts[my_lane]
    lane_spec = RingSpec(Ring(None, mine, mine.index(rank)), layout, None, SCALE)
    prompt = ZigzagLayout(prompt_len, world)
    spec = MoveQSpec(None, rank, prompt, counts, lane_spec, SCALE)

    ref = refs[my_lane]
    pos = layout.positions(mine.index(rank))
    ppos = prompt.positions(rank)
    q, k, v = (t[:, pos].clone().requires_grad_() for t in (ref.q, ref.k, ref.v))
    pk, pv = (t[:, ppos].clone().requires_grad_() for t in (pk_full, pv_full))
    stats = ReplayStats()
    out = move_q_attention(q, k, v, (pk, pv), spec, Meter(stats, "move_q"))
    out.backward(ref.dout[:, pos])
    assert rel(out, ref.out[:, pos]) <= RTOL, (rank, rel(out, ref.out[:, pos]))
    for name, got, want in [
        ("dq", q.grad, ref.dq[:, pos]),
        ("dk", k.grad, ref.dk[:, pos]),
        ("dv", v.grad, ref.dv[:, pos]),
    ]:
        assert rel(got, want) <= RTOL, (rank, name, rel(got, want))
    # the prompt shard collects the gradient of every lane's queries
    assert rel(pk.grad, sum(r.dpk for r in refs)[:, ppos]) <= RTOL
    assert rel(pv.grad, sum(r.dpv for r in refs)[:, ppos]) <= RTOL
    want = move_q_bytes(spec, HEADS, KV_HEADS, *widths, q.element_size(), 4)
    got = {d: stats.comm_bytes.get(f"move_q/{d}", 0) for d in ("fwd", "bwd")}
    assert got == want, (rank, got, want)


CASES = {
    2: [(40, [7], 1), (13, [9, 22], 2), (3, [5, 0], 2)],  # lane 1 idle, prompt-heavy, response-heavy
    4: [(53, [11, 6], 2), (50, [3, 8, 0], 3), (6, [17], 1), (21, [2, 9, 4, 1], 4)],  # lanes of unequal size
}


def _move_q_cases(rank, world, widths):
    for prompt_len, response_lens, lanes in CASES[world]:
        for dims in widths:
            _move_q_member(rank, world, prompt_len, response_lens, lanes, torch.float32, dims)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,widths", [(2, WIDTHS), (4, WIDTHS[:1])])
def test_move_q_matches_plain_attention(world, widths):
    run_distributed(_move_q_cases, world, widths)
