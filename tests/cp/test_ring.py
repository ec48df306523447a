"""The K/V ring (RingCP, and the ring TreeMoveKV runs with a prompt prefix) vs plain attention on one
process: every member's output shard and its q/k/v/prefix gradient shards, plus the bytes it sends; with the
value width equal to the query/key width and (world 2) apart from it on both sides."""

import pytest
import torch

from augtree_verl.cp.comm import Meter, Ring
from augtree_verl.cp.layout import ZigzagLayout
from augtree_verl.cp.ring import RingSpec, ring_attention, ring_bytes
from augtree_verl.replay.stats import ReplayStats
from tests.cp.attention_reference import KV_HEADS, RTOL, SCALE, WIDTHS, prefix_causal_reference, rel
from tests.cp.distributed import run_distributed

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses


def _ring_member(rank, world, seq_len, prefix_len, dtype, widths):
    ref = prefix_causal_reference(prefix_len, seq_len, dtype, seed=seq_len * 31 + prefix_len, widths=widths)
    layout = ZigzagLayout(seq_len, world)
    prefix = ZigzagLayout(prefix_len, world) if prefix_len else None
    spec = RingSpec(Ring(None, tuple(range(world)), rank), layout, prefix, SCALE)
    mine = layout.positions(rank)
    q = ref.q[:, mine].clone().requires_grad_()
    k = ref.k[:, mine].clone().requires_grad_()
    v = ref.v[:, mine].clone().requires_grad_()
    stats = ReplayStats()
    meter = Meter(stats, "ring")
    if prefix is not None:
        pmine = prefix.positions(rank)
        pk = ref.pk[:, pmine].clone().requires_grad_()
        pv = ref.pv[:, pmine].clone().requires_grad_()
        out = ring_attention(q, k, v, spec, meter, prefix_kv=(pk, pv))
    else:
        out = ring_attention(q, k, v, spec, meter)
    out.backward(ref.dout[:, mine])
    assert rel(out, ref.out[:, mine]) <= RTOL
    for name, got, want in [
        ("dq", q.grad, ref.dq[:, mine]),
        ("dk", k.grad, ref.dk[:, mine]),
        ("dv", v.grad, ref.dv[:, mine]),
    ]:
        assert rel(got, want) <= RTOL, (rank, name, rel(got, want))
    if prefix is not None:
        assert rel(pk.grad, ref.dpk[:, pmine]) <= RTOL and rel(pv.grad, ref.dpv[:, pmine]) <= RTOL
    want = ring_bytes(spec, KV_HEADS, *widths, ref.k.element_size())
    got = {d: stats.comm_bytes.get(f"ring/{d}", 0) for d in ("fwd", "bwd")}
    assert got == want, (rank, got, want)


CASES = [
    (37, 0),  # RingCP: length not divisible by 2d
    (5, 0),  # shorter than 2d chunks at d=4: empty chunks and (at d=4) an empty member
    (11, 23),  # TreeMoveKV shape: a prompt prefix carried by the ring, prompt-heavy
    (29, 3),  # response-heavy
]


def _ring_cases(rank, world, widths):
    for seq_len, prefix_len in CASES:  # one process group for all cases: spawning dominates the run time
        for dims in widths:
            _ring_member(rank, world, seq_len, prefix_len, torch.float32, dims)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,widths", [(2, WIDTHS), (4, WIDTHS[:1])])
def test_ring_matches_plain_attention(world, widths):
    run_distributed(_ring_cases, world, widths)


def _ring_d1(rank, world):
    _ring_member(rank, world, 9, 4, torch.float64, WIDTHS[1])


@pytest.mark.timeout(120)
def test_ring_degree_one_sends_nothing():
    run_distributed(_ring_d1, 1)
