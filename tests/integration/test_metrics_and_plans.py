"""Plans from the batch reach the replay; the step's AugTree metrics reach wandb through verl's Tracking."""

from __future__ import annotations

import glob
import json
import os
import struct
import time

import pytest
import torch
from verl.utils.metric import reduce_metrics
from verl.workers.engine.utils import prepare_micro_batches

from augtree_verl.integration.batch_trees import build_trees
from augtree_verl.plan import Plan
from augtree_verl.plan_field import PLAN_FIELD, tree_plans
from augtree_verl.replay.microbatch import split_micro_batches
from augtree_verl.testing import harness as H

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

WANDB_FLUSH_WAIT_S = 30
# group 0: a complete split plan (applies); group 1: ring; group 2: a split plan planned for 2 responses of
# which this rank holds 1 (cannot apply: a fallback); group 3: ring.
GROUPS = [(9, [3, 5, 4, 2]), (4, [6, 2, 3, 1, 5, 2]), (6, [4]), (1, [2, 1, 3])]
SPLIT = Plan(
    degree=1, primitive="tree_move_kv", rounds=2, lanes=1, placement=((0, 0), (1, 0), (0, 0), (1, 0)), est_time_s=0.5
)
RING = Plan(est_time_s=0.25)
PARTIAL = Plan(degree=1, primitive="move_q", rounds=1, lanes=1, placement=((0, 0), (0, 0)), est_time_s=4.0)


def _plan_entries(rows):
    plans = {"group-0": SPLIT, "group-1": RING, "group-2": PARTIAL, "group-3": RING}
    sizes = {"group-2": 2}
    seen: dict[str, int] = {}
    entries = []
    for row in rows:
        uid = row["uid"]
        index = seen[uid] = seen.get(uid, -1) + 1
        count = sizes.get(uid, sum(r["uid"] == uid for r in rows))
        # Response 0 of group 0 in the planner's order is the batch's last response of that group.
        if uid == "group-0":
            index = (index + 1) % count
        entries.append(
            {
                **plans[uid].to_dict(),
                "tree_id": f"{uid}|{len(row['prompt'])}",
                "response_index": index,
                "num_responses": count,
            }
        )
    return entries


def _plans(micro_batches, cp_degrees=(1,), **kw):
    """The engine's decoding of the plan field: (one plan per tree, fallbacks)."""
    entries = [e for mb in micro_batches for e in mb[PLAN_FIELD]]
    return tree_plans(build_trees(micro_batches), entries, cp_degrees, **kw)


def _expected_tokens(batch):
    """(logical tokens, executed tokens) of one replay of ``batch`` with micro_batch_tokens=8."""
    logical = (batch["prompts"].offsets().diff() + batch["responses"].offsets().diff()).sum().item()
    executed = 0
    for p, rs in GROUPS:
        executed += p
        for rows in split_micro_batches(rs, 8):
            # every micro-batch feeds at least one token per row (a call runs every layer: lock-step)
            executed += len(rows) * max(max(rs[i] for i in rows) - 1, 1)
    return logical, executed


def _logged_history(path: str) -> dict:
    """The history rows of an offline wandb run file (a LevelDB-style log of protobuf records), merged.

    wandb 0.31 ships no reader for offline runs: records sit in 32 KiB blocks after a 7-byte file header,
    each chunk behind a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last).
    """
    from wandb.proto import wandb_internal_pb2

    raw = open(path, "rb").read()
    assert raw[:4] == b":W&B", raw[:7]
    block, pos, chunk, history = 32768, 7, b"", {}
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        chunk += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                for item in record.history.item:
                    history[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history


@pytest.fixture(scope="module")
def engine(tmp_path_factory, single_process_group):
    path = H.save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2")))
    # use_planner=false says only that the trainer planned in-process: the batch's plans still apply.
    return H.build_engine("augtree", path, engine_knobs={"micro_batch_tokens": 8, "use_planner": False})


@pytest.mark.timeout(300)
def test_plans_reach_the_replay_and_metrics_reach_wandb(engine, wandb_offline):
    ours, loss_fn = engine
    rows = H.group_rows(GROUPS)
    batch = H.rows_to_batch(rows, extra={PLAN_FIELD: _plan_entries(rows)})
    with ours.eval_mode():
        current = H.response_logps(ours.infer_batch(batch.clone()), batch)
    H.set_old_log_probs(batch, current)
    with ours.train_mode():
        out = ours.train_batch(batch.clone(), loss_function=loss_fn)

    metrics = reduce_metrics({f"actor/{k}": v for k, v in out["metrics"].items()})
    logical, executed = _expected_tokens(batch)
    expected = {
        # the fallback tree runs with the one-device plan (ring, degree 1)
        "actor/augtree/plans/tree_move_kv": 1,
        "actor/augtree/plans/ring": 3,
        "actor/augtree/plans/single": 0,
        "actor/augtree/plans/move_q": 0,
        "actor/augtree/plan_fallbacks": 1,
        "actor/augtree/trees": 4,
        "actor/augtree/predicted_replay_s": 1.0,
        "actor/augtree/cp_degree_max": 1.0,
        "actor/augtree/logical_tokens": logical,
        "actor/augtree/executed_tokens": executed,
        "actor/augtree/executed_per_logical_token": executed / logical,
        "actor/augtree/planner/cp_demoted_linear_attention": 0,  # a hybrid's CP plans (none here: Qwen2)
    }
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value), key
    for key in ("prefill_s", "replay_s", "delayed_backward_s", "measured_replay_s"):
        assert metrics[f"actor/augtree/{key}"] > 0, key
    assert metrics["actor/augtree/measured_replay_s"] == pytest.approx(
        sum(metrics[f"actor/augtree/{k}"] for k in ("prefill_s", "replay_s", "delayed_backward_s"))
    )

    # Through verl's tracker to wandb (offline), then read back from the run's files.
    from verl.utils.tracking import Tracking

    tracker = Tracking(project_name="augtree-test", experiment_name="metrics", default_backend=["wandb"], config={})
    tracker.log(data={k: float(v) for k, v in metrics.items()}, step=1)
    tracker.finish()
    runs = glob.glob(os.path.join(str(wandb_offline), "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, runs
    # wandb's service process may still be writing the run file when finish() returns.
    deadline = time.monotonic() + WANDB_FLUSH_WAIT_S
    while not set(expected) <= set(logged := _logged_history(runs[0])) and time.monotonic() < deadline:
        time.sleep(0.5)
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value), key
    assert logged["actor/augtree/measured_replay_s"] == pytest.approx(metrics["actor/augtree/measured_replay_s"])


def test_split_plan_placement_follows_the_planners_response_order():
    rows = H.group_rows(GROUPS)
    batch = H.rows_to_batch(rows, extra={PLAN_FIELD: _plan_entries(rows)})
    micro_batches, _ = prepare_micro_batches(batch)
    plans, fallbacks = _plans(micro_batches)
    # Our response i of group 0 is the planner's response (i + 1) % 4.
    assert plans[0].placement == tuple(SPLIT.placement[(i + 1) % 4] for i in range(4))
    assert (plans[1], plans[2], plans[3], fallbacks) == (RING, Plan(), RING, 1)


def test_context_parallel_plans_apply_where_the_engine_has_that_degree():
    """A degree-2 plan applies with CP subgroups of 2 ranks; without them, or for a tree shorter than the
    fallback threshold, the tree runs with the one-device plan and the planner's one-rank estimate (only the
    first counts as a planner fallback)."""
    rows = H.group_rows(GROUPS)
    cp_ring, one_device = Plan(degree=2, est_time_s=0.25, est_single_s=0.4), Plan(est_time_s=0.4)
    entries = [
        {**entry, **cp_ring.to_dict()} if row["uid"] == "group-1" else entry
        for row, entry in zip(rows, _plan_entries(rows))
    ]
    micro_batches, _ = prepare_micro_batches(H.rows_to_batch(rows, extra={PLAN_FIELD: entries}))
    plans, fallbacks = _plans(micro_batches)
    assert (plans[1], plans[3], fallbacks) == (one_device, RING, 2)
    plans, fallbacks = _plans(micro_batches, (1, 2))
    assert (plans[1], plans[3], fallbacks) == (cp_ring, RING, 1)
    longest = 4 + 6  # group 1: prompt 4, longest response 6
    for threshold, want in ((longest, cp_ring), (longest + 1, one_device)):
        plans, fallbacks = _plans(micro_batches, (1, 2), min_cp_tokens=threshold)
        assert (plans[1], fallbacks) == (want, 1), threshold


def test_training_with_plans_is_still_exact(engine):
    """Degree-1 plans do not change the math: the same step with and without plans gives the same gradient."""
    ours, loss_fn = engine
    rows = H.group_rows(GROUPS, seed=3)
    plain, planned = H.rows_to_batch(rows), H.rows_to_batch(rows, extra={PLAN_FIELD: _plan_entries(rows)})
    grads = []
    for batch in (plain, planned):
        with ours.eval_mode():
            current = H.response_logps(ours.infer_batch(batch.clone()), batch)
        H.set_old_log_probs(batch, current)
        with ours.train_mode(zero_grad_on_exit=False):
            ours.optimizer_zero_grad()
            ours.forward_backward_batch(batch.clone(), loss_fn)
            grads.append({n: p.grad.full_tensor().clone() for n, p in ours.module.named_parameters()})
        ours.optimizer_zero_grad()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


def test_group_totals_and_metrics_keep_every_counter(single_process_group):
    """A CP group's combined stats and the step's metrics carry every counter field of ``ReplayStats``, every
    byte key and plan count, and every phase time (they are read from the dataclass fields)."""
    from dataclasses import fields

    from augtree_verl.integration.metrics import group_totals, step_metrics
    from augtree_verl.replay import ReplayStats
    from augtree_verl.replay.stats import PHASES

    counters = tuple(f.name for f in ReplayStats.counters())
    assert {f.name for f in fields(ReplayStats) if f.type == "int"} == set(counters), (
        "an int field of ReplayStats that is not a counter(): nothing sums or reports it"
    )
    stats = ReplayStats(
        **{name: 0.5 + k for k, name in enumerate(PHASES)}, **{name: 10 + k for k, name in enumerate(counters)}
    )
    keyed = [(f.name, key) for f in ReplayStats.keyed() for key in f.metadata["keys"]]
    for k, (name, key) in enumerate(keyed):
        getattr(stats, name)[key] += 100 + k
    total = group_totals(stats, None, torch.device("cpu"))
    assert [getattr(total, n) for n in PHASES + counters] == [getattr(stats, n) for n in PHASES + counters]
    assert [getattr(total, name)[key] for name, key in keyed] == [100 + k for k in range(len(keyed))]
    metrics = {k: v.values[0] for k, v in step_metrics(stats, [], plan_fallbacks=0, cp_demoted=0).items()}
    for name in PHASES + counters:
        assert metrics["augtree/" + ReplayStats.metric_name(name)] == getattr(stats, name), name
    for k, (name, key) in enumerate(keyed):
        assert metrics[f"augtree/{name}/{key}"] == 100 + k
    assert metrics["augtree/delayed_backward_s"] == stats.prompt_backward_s  # the names verl users see
    assert metrics["augtree/offload/copies"] == stats.offload_copies
