"""The streamed schedule against verl's stock engine: any verl micro-batch setting, and ZeRO-3 lock-step calls.

World 1 (in-process): micro-batches of 1 and 2 rows and dynamic batch size (one sequence's tokens), with
and without gradient checkpointing. Worlds 2 and 4 (spawned gloo ranks): our ranks hold very different
work (one tree vs six; one response micro-batch vs many), so the lock-step padding (dummy trees, dummy
micro-batches) runs; verl's stock engine gets the same global batch dealt evenly (the gradient of verl's
globally normalised loss does not depend on how rows are dealt). Log-probs, entropies, grad norms and
weights must agree after every step, and our engine must hold at most one FSDP parameter group more
unsharded at once than the stock engine (no whole-model gather).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from augtree_verl.replay.trie import MIN_SHARED_TOKENS
from augtree_verl.testing import harness as H
from augtree_verl.testing import verl_batch

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses
# Under each test's pytest timeout: ranks deadlocked in mismatched collectives are killed (``H.spawn``).
SPAWN_TIMEOUT_S = {2: 540, 4: 540}

STEPS = 3
GROUPS = [(9, [3, 5, 4, 2]), (4, [6, 2, 3, 1, 5, 2]), (6, [4]), (1, [2, 1, 3])]
# The stock engine's micro-batches: (name, verl settings); dynamic: one sequence's tokens per micro-batch.
SETTINGS = {
    "rows-1": dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=1),
    "rows-2": dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=2),
    "dynamic": dict(use_dynamic_bsz=True, max_token_len_per_gpu=16),
    "dynamic-long": dict(use_dynamic_bsz=True, max_token_len_per_gpu=2 * MIN_SHARED_TOKENS + 32),  # shared_rows'
}
# Skewed worlds: rank -> its groups (ours; an even number of rows each). 32 rows: the stock engine's even deal.
# Group 0 is one response micro-batch (MICRO_BATCH_TOKENS), the others several each.
SKEWED_GROUPS = [
    (20, [2, 2, 2, 1]),
    (4, [6, 2, 3, 1, 5, 2]),
    (6, [4, 3, 2, 1]),
    (3, [2, 1, 3, 2]),
    (5, [5, 4, 3, 2]),
    (7, [2, 2, 2, 2, 2]),
    (2, [3, 6, 4, 2, 5]),
]
SKEW = {2: [[0], [1, 2, 3, 4, 5, 6]], 4: [[0], [1, 2, 3], [4], [5, 6]]}
MICRO_BATCH_TOKENS = 8
# The stock engine holds one layer plus the root (and a prefetched neighbour) at once; we may hold the
# prompt's layer of a delayed backward as well.
EXTRA_UNSHARDED = 1


def _batch(rows, setting: str, **extra):
    batch = verl_batch.rows_to_batch(rows, **SETTINGS[setting], **extra)
    if any("mask" in row for row in rows):  # tokens not trained (a tool's output inside a response)
        mask = torch.nested.as_nested_tensor(
            [row.get("mask", torch.ones(len(row["response"]), dtype=torch.int64)) for row in rows], layout=torch.jagged
        )
        batch["response_mask"], batch["loss_mask"] = mask, mask.clone()
    return batch


def _steps(stock, stock_loss, ours, our_loss, stock_rows, our_rows, setting, where, rows_of, entropy_coeff):
    """STEPS steps of both engines; rows are global row indices into ``rows_of(step)``. Returns the last
    step's metrics of ours."""
    from verl.utils import tensordict_utils as tu

    from augtree_verl.integration.memory_meter import UnshardedGroups
    from tests.integration.test_engine_cp import infer_both_and_set_old
    from tests.integration.test_engine_parity import _assert_close, _assert_params_match, _train

    seen = {"stock": 0, "ours": 0}
    for step in range(STEPS):
        rows = rows_of(step)
        # as verl's worker does: the batches carry the model config's use_remove_padding (False for hybrids)
        padding = dict(use_remove_padding=stock.model_config.use_remove_padding)
        batch = _batch([rows[k] for k in our_rows], setting, **padding)
        stock_batch = _batch([rows[k] for k in stock_rows], setting, **padding)
        for b in (batch, stock_batch):
            tu.assign_non_tensor(b, global_batch_size=len(rows))
        infer_both_and_set_old(stock, ours, stock_batch, batch, stock_rows, our_rows, len(rows), where, step)
        for b in (batch, stock_batch):
            tu.assign_non_tensor(b, calculate_entropy=entropy_coeff != 0)
        with UnshardedGroups(stock.module) as stock_seen:
            out_stock = _train(stock, stock_loss, stock_batch)
        with UnshardedGroups(ours.module) as our_seen:
            out_ours = _train(ours, our_loss, batch)
        seen["stock"], seen["ours"] = max(seen["stock"], stock_seen.max), max(seen["ours"], our_seen.max)
        losses = torch.tensor([sum(out_ours["loss"]), sum(out_stock["loss"])], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(losses)  # each rank's losses are its rows' share of the global loss
        _assert_close(f"{where} step {step} loss", losses[0], losses[1])
        if "grad_norm" in out_stock["metrics"]:
            _assert_close(
                f"{where} step {step} grad norm",
                torch.tensor(out_ours["metrics"]["grad_norm"]),
                torch.tensor(out_stock["metrics"]["grad_norm"]),
            )
        _assert_params_match(ours, stock, step)
    assert 0 < seen["ours"] <= seen["stock"] + EXTRA_UNSHARDED, f"{where}: unsharded groups at once {seen}"
    return out_ours["metrics"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, single_process_group):
    return H.save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2")))


def shared_rows(step: int) -> list[dict]:
    """Rows whose tokens are shared beyond a group's prompt (the trie of ``replay.trie``, a node wherever
    sharing saves at least its ``MIN_SHARED_TOKENS``): a system prompt S under four uids; group 0's two first
    responses share a stretch X, then branch; group 2 has group 1's prompt; group 3 is group 0's next turn
    (its prompt ends inside X), whose response starts with a tool's output, not trained; group 4 shares
    nothing (a depth-1 trie); group 5 has group 0's prompt and a response that is X (it ends where group 0's
    responses branch)."""
    g = torch.Generator().manual_seed(step)
    ids = lambda n: torch.randint(3, H.VOCAB, (n,), generator=g)
    system, shared = ids(MIN_SHARED_TOKENS + 2), ids(MIN_SHARED_TOKENS + 2)
    p0, p1 = torch.cat([system, torch.tensor([1]), ids(5)]), torch.cat([system, torch.tensor([2]), ids(4)])
    p4 = ids(7)
    adv = torch.randn(12, generator=g).tolist()
    tool = torch.ones(shared.shape[0] - 40 + 2, dtype=torch.int64)
    tool[:10] = 0
    responses = [
        ("group-0", p0, torch.cat([shared, torch.tensor([1]), ids(3)])),
        ("group-0", p0, torch.cat([shared, torch.tensor([2]), ids(5)])),
        ("group-0", p0, ids(4)),
        ("group-1", p1, ids(3)),
        ("group-1", p1, ids(6)),
        ("group-2", p1, ids(4)),
        ("group-2", p1, ids(2)),
        ("group-3", torch.cat([p0, shared[:40]]), torch.cat([shared[40:], torch.tensor([0]), ids(1)])),
        ("group-4", p4, ids(3)),
        ("group-4", p4, ids(2)),
        ("group-5", p0, shared.clone()),
        ("group-5", p0, ids(3)),
    ]
    rows = [dict(uid=uid, prompt=p, response=r, advantage=a) for (uid, p, r), a in zip(responses, adv)]
    rows[7]["mask"] = tool
    return rows


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setting", ["rows-1", "rows-2", "dynamic-long"])
def test_shared_prefixes_across_uids_match_stock_engine(model_path, setting):
    """Sharing found from the tokens (a depth-4 trie and a depth-1 one) at verl micro-batch sizes 1, 2 and
    dynamic, checkpointing with micro-batches of 2; the trie's nodes in the step metrics."""
    common = dict(loss_agg_mode="token-mean", entropy_coeff=0.01, gradient_checkpointing=setting == "rows-2")
    stock, stock_loss = H.build_engine("fsdp2", model_path, **common)
    ours, our_loss = H.build_engine("augtree", model_path, **common)
    rows = list(range(12))
    metrics = _steps(stock, stock_loss, ours, our_loss, rows, rows, setting, setting, shared_rows, 0.01)
    # S, the prompts of groups 0 and 1 (2 shares it), X up to group 3's prompt end, the rest of X; group 4's
    assert metrics["augtree/trie/nodes"].aggregate() == 6
    assert metrics["augtree/trees"].aggregate() == 6
    logical = sum(len(r["prompt"]) + len(r["response"]) for r in shared_rows(STEPS - 1))
    assert metrics["augtree/logical_tokens"].aggregate() == logical
    assert metrics["augtree/executed_tokens"].aggregate() < logical / 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "setting,checkpointing", [("rows-1", False), ("rows-2", True), ("dynamic", False), ("dynamic", True)]
)
def test_every_micro_batch_setting_matches_stock_engine(model_path, setting, checkpointing):
    compare_at_micro_batch_setting(model_path, setting, checkpointing)


def compare_at_micro_batch_setting(model_path, setting: str, checkpointing: bool) -> None:
    """Both engines, built from ``model_path``, train ``GROUPS``' rows for STEPS steps at a verl micro-batch
    ``setting`` on one rank; they must agree (``_steps``)."""
    common = dict(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01, gradient_checkpointing=checkpointing)
    stock, stock_loss = H.build_engine("fsdp2", model_path, **common)
    ours, our_loss = H.build_engine("augtree", model_path, **common)
    rows = list(range(sum(len(rs) for _, rs in GROUPS)))
    _steps(
        stock,
        stock_loss,
        ours,
        our_loss,
        rows,
        rows,
        setting,
        setting,
        lambda step: H.group_rows(GROUPS, seed=step),
        0.01,
    )


def _skewed_main(rank: int, world: int, port: int, model_path: str, setting: str, checkpointing: bool) -> None:
    H.use_cpu_platform()  # a spawned process: select verl's CPU platform before building engines
    H.init_process_group(rank=rank, world_size=world, port=port)
    common = dict(loss_agg_mode="token-mean", gradient_checkpointing=checkpointing)
    stock, stock_loss = H.build_engine("fsdp2", model_path, **common)
    ours, our_loss = H.build_engine(
        "augtree", model_path, **common, engine_knobs={"micro_batch_tokens": MICRO_BATCH_TOKENS}
    )
    rows = H.group_rows(SKEWED_GROUPS)
    group_of = [int(row["uid"].split("-")[1]) for row in rows]
    our_rows = [k for k, g in enumerate(group_of) if g in SKEW[world][rank]]
    stock_rows = list(range(rank, len(rows), world))
    _steps(
        stock,
        stock_loss,
        ours,
        our_loss,
        stock_rows,
        our_rows,
        setting,
        f"rank {rank}",
        lambda step: H.group_rows(SKEWED_GROUPS, seed=step),
        0.0,
    )
    dist.destroy_process_group()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "world,setting,checkpointing",
    [(2, "rows-1", False), (2, "rows-2", True), (4, "rows-2", False), (4, "rows-1", True)],
)
def test_ranks_with_very_different_work_match_stock_engine(tmp_path, world, setting, checkpointing):
    model_path = H.save_tiny_qwen2(str(tmp_path / "tiny-qwen2"))
    H.spawn(_skewed_main, (world, H.free_port(), model_path, setting, checkpointing), world, SPAWN_TIMEOUT_S[world])


@pytest.mark.timeout(300)
def test_a_step_over_the_replay_memory_budget_is_refused_naming_its_samples(model_path):
    """``replay_memory_budget_gib`` below any step's need: the step is refused, before any model call (the
    parameters' gradients stay unset), naming the group's uid and batch rows (``replay.memory``)."""
    from augtree_verl.replay.memory import ReplayMemoryError
    from tests.integration.test_engine_parity import _train

    ours, loss_fn = H.build_engine("augtree", model_path, engine_knobs={"replay_memory_budget_gib": 1e-6})
    batch = _batch(H.group_rows(GROUPS), "rows-2")
    with pytest.raises(ReplayMemoryError, match=r"trie of tree 1 \(uid 'group-1', samples \[4, 5, 6, 7, 8, 9\]\)"):
        _train(ours, loss_fn, batch)
    assert all(p.grad is None for p in ours.module.parameters())
