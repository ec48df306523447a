"""Context parallelism inside the verl engine (spawned gloo ranks), against verl's stock engine on the same world.

Ours runs with CP groups (``cp_degrees``): the ranks of a group get the same samples and replay each tree
once between them: plans of degree d > 1 (MoveQ, TreeMoveKV, ring) context-parallel on d of the group's
ranks, degree-1 trees on one rank each. verl's stock engine runs the same world purely data-parallel.
Log-probs, entropies, grad norms and weights after every step must agree (RTOL), with verl's loss
(token-mean, seq-mean-token-sum, and seq-mean-token-mean with an entropy term):

- world 2, cp_degrees [1, 2]: one CP group of both ranks (data-parallel size 1);
- world 4, cp_degrees [1, 2]: two CP groups of 2 (data-parallel size 2, each its own groups of samples);
- world 4, cp_degrees [1, 2, 4]: one CP group of 4 with plans of degree 4 and of degree 2 (subgroups);
- world 2, plans of degree 2 whose estimates say the group finishes sooner running them side by side;
- world 2, every prompt behind one system prompt (the batch one trie): the trie runs with its root
  context-parallel over both ranks (``replay.cp_trie``), its subtrees dealt over them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from augtree_verl.plan import Plan
from augtree_verl.testing import harness as H

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses
# Under each test's pytest timeout: ranks deadlocked in mismatched collectives are killed (``H.spawn``).
SPAWN_TIMEOUT_S = {2: 360, 4: 540}

STEPS = 2
# (prompt length, response lengths): prompt-heavy groups for the split primitives, a response-heavy one
# for the ring, and degree-1 groups (one a group of one) that a CP group spreads over its ranks.
GROUPS = [(17, [3, 5, 4, 2]), (12, [6, 2, 3, 1, 5]), (4, [9, 7]), (6, [4]), (3, [2, 1, 3, 2])]
# TreeMoveKV in one lane of d ranks (the planner prefers one-rank lanes for these tiny trees: they move nothing).
ONE_LANE = Plan(degree=2, primitive="tree_move_kv", rounds=5, lanes=1, placement=tuple((r, 0) for r in range(5)))
# Per group: (primitive forced on the planner, degree) or a plan.
PLANS_DEGREE_2 = [("move_q", 2), ONE_LANE, ("ring", 2), (None, 1), (None, 1)]
PLANS_DEGREE_4_AND_2 = [("move_q", 4), ONE_LANE, ("ring", 4), ("tree_move_kv", 2), (None, 1)]
# A batch-wide system prompt long enough to be a trie node of its own: 5 groups x 40 tokens saved >= 128.
SYSTEM_TOKENS = 40
# The engine's profile for it: the default hardware figures but a device a million times slower, on which the
# planner's cost model predicts the system prompt sooner context-parallel than prefilled on each rank (with
# the default figures a tiny model's prefill costs nothing against the gather's latency: chunks win).
SLOW_DEVICE = dict(flops_per_s=1e9, attention_flops_per_s=1e9, causal_attention_flops_per_s=1e9)
# Every group planned at degree 2 with 50% parallel efficiency: the engine's schedule runs them side by side
# on one rank each instead.
INEFFICIENT = [Plan(degree=2, est_time_s=float(p), est_single_s=float(p)) for p, _ in GROUPS]


def _plan_entries(rows, specs):
    from augtree_verl.planner import plan_tree
    from augtree_verl.trainer import find_trees, plan_entries

    trees = find_trees([r["uid"] for r in rows], [len(r["prompt"]) for r in rows], [len(r["response"]) for r in rows])
    plans = {}
    for tree in trees:
        plan = specs[int(tree.uid.split("-")[1])]
        plans[tree.tree_id] = (
            plan
            if isinstance(plan, Plan)
            else plan_tree(tree.prompt_len, tree.response_lens, degrees=(plan[1],), force_primitive=plan[0])
        )
    return plan_entries(trees, plans, len(rows))


def _gather_rows(indices: list[int], values: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every rank's (global row index -> values), on every rank."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(zip(indices, values)))
    return {k: v for pairs in everyone for k, v in pairs}


def infer_both_and_set_old(stock, ours, stock_batch, batch, stock_idx, ours_idx, num_rows, where, step):
    """Both engines' log-probs and entropies agree on every global row (``*_idx``: each batch's global row
    indices); then both batches get the same old log-probs (the current ones plus noise)."""
    from tests.integration.test_engine_parity import _assert_close, _infer

    want, got = _infer(stock, stock_batch, entropy=True), _infer(ours, batch, entropy=True)
    for key in ("log_probs", "entropy"):
        wanted = _gather_rows(stock_idx, H.response_logps(want, stock_batch, key))
        for k, value in zip(ours_idx, H.response_logps(got, batch, key)):
            _assert_close(f"{where} step {step} {key} row {k}", value, wanted[k])
    current = _gather_rows(stock_idx, H.response_logps(want, stock_batch))
    g = torch.Generator().manual_seed(step)
    old = [current[k] + H.OLD_LOGP_NOISE * torch.randn(current[k].shape, generator=g) for k in range(num_rows)]
    for b, idx in ((batch, ours_idx), (stock_batch, stock_idx)):
        b["old_log_probs"] = torch.nested.as_nested_tensor([old[k] for k in idx], layout=torch.jagged)


def _rank_main(
    rank: int,
    world: int,
    port: int,
    model_path: str,
    cp_degrees: list[int],
    specs: list,
    cp_max: int,
    loss_agg_mode: str,
    entropy_coeff: float,
    system: int,
    rows_per_micro_batch: int | None = None,
    mrope: bool = False,
) -> None:
    """``cp_max``: the largest degree expected to run; ``system``: tokens of a system prompt in front of every
    prompt (0: none); ``rows_per_micro_batch``: verl's micro-batches, ours and the stock engine's (None: a rank's
    whole share in one of ours, 2 rows in the stock engine's); ``mrope``: verl's M-RoPE position ids (a
    vision-language model's text-only rows)."""
    H.use_cpu_platform()  # a spawned process: select verl's CPU platform before building engines
    from verl.utils import tensordict_utils as tu

    from tests.integration.test_engine_parity import _assert_close, _assert_params_match, _train

    H.init_process_group(rank=rank, world_size=world, port=port)
    common = dict(loss_agg_mode=loss_agg_mode, entropy_coeff=entropy_coeff)
    stock, stock_loss = H.build_engine("fsdp2", model_path, **common)
    knobs: dict = {"cp_degrees": cp_degrees}
    if system:
        knobs["planner_profile"] = H.fixed_profile(model_path, False, "fp32", **SLOW_DEVICE)
    ours, our_loss = H.build_engine("augtree", model_path, **common, engine_knobs=knobs)
    cp = max(cp_degrees)
    dp_size, dp_rank = world // cp, rank // cp
    assert (ours.get_data_parallel_size(), ours.get_data_parallel_rank()) == (dp_size, dp_rank)
    assert ours.is_mp_src_rank_with_outputs() == (rank % cp == 0)
    assert (stock.get_data_parallel_size(), stock.get_data_parallel_rank()) == (world, rank)
    for step in range(STEPS):
        rows = H.group_rows(GROUPS, seed=step)
        prefix = torch.randint(0, H.VOCAB, (system,), generator=torch.Generator().manual_seed(100 + step))
        for row in rows:
            row["prompt"] = torch.cat([prefix, row["prompt"]])
        # verl's dispatch: our data-parallel rank j gets whole groups j, j + dp, ...;
        # stock rank r rows r, r + world, ...
        ours_idx = [k for k, row in enumerate(rows) if int(row["uid"].split("-")[1]) % dp_size == dp_rank]
        stock_idx = list(range(rank, len(rows), world))
        our_rows = [rows[k] for k in ours_idx]
        batch = H.rows_to_batch(
            our_rows,
            micro_batch_size=rows_per_micro_batch or len(our_rows),
            extra={"augtree_plan": _plan_entries(our_rows, specs)},
            mrope=mrope,
        )
        stock_batch = H.rows_to_batch(
            [rows[k] for k in stock_idx], micro_batch_size=rows_per_micro_batch or 2, mrope=mrope
        )
        for b in (batch, stock_batch):  # use_remove_padding as verl's worker sets it (False for hybrids)
            tu.assign_non_tensor(
                b, global_batch_size=len(rows), use_remove_padding=stock.model_config.use_remove_padding
            )
        infer_both_and_set_old(stock, ours, stock_batch, batch, stock_idx, ours_idx, len(rows), f"rank {rank}", step)
        for b in (batch, stock_batch):
            tu.assign_non_tensor(b, calculate_entropy=entropy_coeff != 0)
        out_stock, out_ours = _train(stock, stock_loss, stock_batch), _train(ours, our_loss, batch)
        metrics = out_ours["metrics"]
        assert metrics["augtree/plan_fallbacks"].aggregate() == 0
        # a loss that couples the rows of a call (``loss_calls.coupling``) runs scores first, on every rank
        assert (metrics["augtree/loss/scores_first_s"].aggregate() > 0) == (loss_agg_mode == "seq-mean-token-sum-norm")
        # no CP plan ran on one device for want of a CP replay (a hybrid's too: the state scan runs them)
        assert metrics["augtree/planner/cp_demoted_linear_attention"].aggregate() == 0
        # The CP group's totals on every rank: each tree once, whichever ranks replayed it.
        assert metrics["augtree/trees"].aggregate() == len({row["uid"] for row in our_rows})
        assert metrics["augtree/logical_tokens"].aggregate() == sum(
            len(r["prompt"]) + len(r["response"]) for r in our_rows
        )
        # the batch behind one system prompt is one trie: its root ran context-parallel (it moved bytes), once
        assert metrics["augtree/trie/cp_roots"].aggregate() == (1 if system else 0)
        assert (metrics["augtree/comm_bytes/trie_root/bwd"].aggregate() > 0) == bool(system)
        if system:
            assert metrics["augtree/trie/nodes"].aggregate() == 1 + len(GROUPS)  # the root, each group's prompt
        elif rank < cp and cp_max > 1:  # the first CP group holds group 0 (MoveQ) and group 2 (ring) here
            assert metrics["augtree/cp_degree_max"].aggregate() == cp_max
            for primitive in ("move_q", "ring"):  # each ran context-parallel (it moved bytes)
                assert metrics[f"augtree/comm_bytes/{primitive}/bwd"].aggregate() > 0, primitive
        if cp_max == 1:  # every CP plan was moved to one rank: nothing moved
            assert metrics["augtree/cp_degree_max"].aggregate() == 1
            assert sum(v.aggregate() for k, v in metrics.items() if k.startswith("augtree/comm_bytes/")) == 0
        if rank == 0:  # verl adds grad_norm on the ranks whose outputs it collects
            _assert_close(
                f"step {step} grad norm",
                torch.tensor(metrics["grad_norm"]),
                torch.tensor(out_stock["metrics"]["grad_norm"]),
            )
        _assert_params_match(ours, stock, step)
    torch.distributed.destroy_process_group()


def _run(
    tmp_path,
    world,
    cp_degrees,
    specs,
    cp_max,
    loss_agg_mode="token-mean",
    entropy_coeff=0.0,
    system=0,
    rows_per_micro_batch=None,
):
    model_path = H.save_tiny_qwen2(str(tmp_path / "tiny-qwen2"))
    args = (cp_degrees, specs, cp_max, loss_agg_mode, entropy_coeff, system, rows_per_micro_batch)
    H.spawn(_rank_main, (world, H.free_port(), model_path, *args), world, SPAWN_TIMEOUT_S[world])


@pytest.mark.timeout(420)
def test_one_cp_group_of_two_matches_stock_data_parallel(tmp_path):
    _run(tmp_path, 2, [1, 2], PLANS_DEGREE_2, 2)


@pytest.mark.timeout(420)
def test_a_batch_wide_system_prompt_runs_once_context_parallel_and_matches_stock(tmp_path):
    _run(tmp_path, 2, [1, 2], PLANS_DEGREE_2, 2, system=SYSTEM_TOKENS)


@pytest.mark.timeout(420)
def test_a_loss_coupling_a_calls_rows_runs_scores_first_and_matches_stock(tmp_path):
    """seq-mean-token-sum-norm without loss_scale_factor divides by each call's padded width: on verl's one-row
    micro-batches (both engines) the stock engine's loss is a per-row function whatever the data-parallel layout,
    which the CP replay, whose own micro-batches hold a tree's rows, matches only by calling it on verl's."""
    _run(tmp_path, 2, [1, 2], PLANS_DEGREE_2, 2, "seq-mean-token-sum-norm", rows_per_micro_batch=1)


@pytest.mark.timeout(420)
def test_inefficient_cp_plans_run_side_by_side_and_match_stock(tmp_path):
    _run(tmp_path, 2, [1, 2], INEFFICIENT, 1)


@pytest.mark.timeout(600)
def test_two_cp_groups_of_two_match_stock_data_parallel(tmp_path):
    _run(tmp_path, 4, [1, 2], PLANS_DEGREE_2, 2, "seq-mean-token-sum")


@pytest.mark.timeout(600)
def test_cp_group_of_four_with_degree_two_subgroups_matches_stock(tmp_path):
    _run(tmp_path, 4, [1, 2, 4], PLANS_DEGREE_4_AND_2, 4, "seq-mean-token-mean", 0.01)
