"""TreeMoveKV at the attention level, through the context the CP tree run uses (``cp.context.LaneReplayContext``):
s lanes replay different responses at the same time, each lane's ring carrying its prompt shards and its
response only; shards and bytes vs plain attention, with the value width equal to the query/key width and (world 2)
apart from it on both sides."""

import pytest
import torch

from augtree_verl.cp.comm import Meter, Ring
from augtree_verl.cp.context import LaneReplayContext
from augtree_verl.cp.layout import ZigzagLayout, lane_members
from augtree_verl.cp.ring import RingSpec, ring_bytes
from augtree_verl.replay.stats import ReplayStats
from tests.cp.attention_reference import KV_HEADS, RTOL, SCALE, WIDTHS, prefix_causal_reference, rel
from tests.cp.distributed import run_distributed

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses


def _lane_member(rank, world, lanes, prompt_len, response_lens, widths):
    lane = next(lane for lane in range(lanes) if rank in lane_members(world, lanes, lane))
    members = lane_members(world, lanes, lane)
    ref = prefix_causal_reference(
        prompt_len, response_lens[lane], torch.float32, seed=lane * 13 + prompt_len, widths=widths
    )
    ring = Ring(None, members, members.index(rank))
    layout, prompt = ZigzagLayout(response_lens[lane], len(members)), ZigzagLayout(prompt_len, len(members))
    pos, ppos = layout.positions(ring.index), prompt.positions(ring.index)
    q, k, v = (t[:, pos].clone().requires_grad_() for t in (ref.q, ref.k, ref.v))
    pk, pv = (t[:, ppos].clone().requires_grad_() for t in (ref.pk, ref.pv))
    stats = ReplayStats()
    context = LaneReplayContext(ring, layout, prompt, [(pk, pv)], Meter(stats, "tree_move_kv"))
    out = context.attend(0, q[None], k[None], v[None], SCALE)[0]
    out.backward(ref.dout[:, pos])
    for name, got, want in [
        ("out", out, ref.out[:, pos]),
        ("dq", q.grad, ref.dq[:, pos]),
        ("dk", k.grad, ref.dk[:, pos]),
        ("dv", v.grad, ref.dv[:, pos]),
        ("dpk", pk.grad, ref.dpk[:, ppos]),
        ("dpv", pv.grad, ref.dpv[:, ppos]),
    ]:
        assert rel(got, want) <= RTOL, (rank, name, rel(got, want))
    want = ring_bytes(RingSpec(ring, layout, prompt, SCALE), KV_HEADS, *widths, 4)
    got = {d: stats.comm_bytes.get(f"tree_move_kv/{d}", 0) for d in ("fwd", "bwd")}
    assert got == want, (rank, got, want)


# world: (lanes, prompt length, response length per lane)
CASES = {
    4: [(2, 45, [7, 30]), (4, 9, [3, 12, 1, 6])],  # prompt-heavy lane next to a response-heavy one; lanes of one rank
    2: [(1, 23, [17]), (2, 45, [7, 30])],  # one lane of both ranks; lanes of one rank: no comm at all
}


def _cases(rank, world, widths):
    for lanes, prompt_len, response_lens in CASES[world]:
        for dims in widths:
            _lane_member(rank, world, lanes, prompt_len, response_lens, dims)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,widths", [(4, WIDTHS[:1]), (2, WIDTHS)])
def test_lanes_replay_concurrently(world, widths):
    run_distributed(_cases, world, widths)
