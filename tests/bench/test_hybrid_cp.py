"""``augtree bench --cp 2`` on the built-in hybrid (qwen3.5-small): AugTree with a CP plan that shards the prompt
(MoveQ, the prompt's linear layers through the state scan) beside the same trees on one device each
(AugTree[one device]), both exact, each with its bytes moved and every rank's peak bytes held. The bench's workload
loop on two gloo ranks, without its calibration and verl-fsdp2 (``test_distributed`` runs the whole bench)."""

from dataclasses import replace

import pytest
from tqdm import tqdm

from augtree_verl.bench.methods import ONE_DEVICE, methods_for
from augtree_verl.bench.report import format_table
from augtree_verl.bench.runner import FLOAT32_GRAD_RTOL, _run_workload
from augtree_verl.bench.workloads import build_workload
from augtree_verl.models import load_model, vocab_size
from augtree_verl.planner import ClusterProfile
from tests.cp.distributed import run_distributed

pytestmark = pytest.mark.slow  # spawns a process group


def _bench(rank, world):
    model = load_model("qwen3.5-small")
    profile = replace(ClusterProfile.default().with_model(model.config), activation_checkpointing=False)
    # rag's shortest prompt (1,530 tokens) and two 5-token answers: the prompt is almost the whole step.
    workload = build_workload("rag", 600, 2, vocab_size=vocab_size(model))
    # The uncalibrated default profile may pick lanes of one rank each (the prompt on both ranks): force MoveQ.
    methods = [next(m for m in methods_for(world) if m.name == "AugTree[move_q]"), ONE_DEVICE]
    bar = tqdm(disable=True)
    cp, one = _run_workload(model, workload, methods, 1, 0, rank, world, profile, bar, FLOAT32_GRAD_RTOL)
    assert cp.plan.startswith("move_q(d=2") and one.plan == "single", (cp.plan, one.plan)
    for r in (cp, one):
        assert not r.wrong, (r.method, r.max_grad_rel_err)
        assert len(r.peak_bytes) == world and r.step_time_s > 0
    # Sharding the prompt moves K/V and the linear layers' state summaries; one device per tree moves only the
    # log-prob exchange.
    assert cp.comm_bytes > 100 * one.comm_bytes, (cp.comm_bytes, one.comm_bytes)
    # CP's purpose: no rank holds the whole prompt's activations. On one device, one rank holds the tree and the
    # other nothing of it.
    assert min(cp.peak_bytes) > 0 and cp.max_peak_bytes < 0.75 * one.max_peak_bytes, (cp.peak_bytes, one.peak_bytes)
    assert min(one.peak_bytes) < 0.1 * one.max_peak_bytes, one.peak_bytes
    rows = format_table([cp, one]).splitlines()
    assert "peak/rank" in rows[0] and rows[3].split()[:2] == ["rag", "AugTree[one"] and "single" in rows[3]


@pytest.mark.timeout(120)
def test_hybrid_cp2_against_one_device_reports_bytes_and_peak_per_rank():
    run_distributed(_bench, 2)
