"""Context parallelism inside the verl engine (world size 2, spawned gloo ranks), against verl's stock engine.

Ours runs ``cp_degrees=[1, 2]``: one CP group of both ranks (data-parallel size 1), so both ranks get the
whole batch and replay each tree once between them: planner-made plans of degree 2 (MoveQ, TreeMoveKV,
ring) context-parallel over both ranks, degree-1 trees on one rank each. verl's stock engine runs the same
world as data-parallel size 2, each rank on half of the rows. Log-probs, entropies, grad norms and weights
after every step must agree (RTOL), with verl's loss (token-mean and seq-mean-token-mean, an entropy term).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.integration import verl_harness as H
from augtree_verl.plan import Plan  # noqa: I001  (after the harness: it selects the CPU platform)

STEPS = 2
WORLD = 2
# (prompt length, response lengths): prompt-heavy groups for the split primitives, a response-heavy one
# for the ring, and degree-1 groups (one a group of one) that the CP group spreads over its two ranks.
GROUPS = [(17, [3, 5, 4, 2]), (12, [6, 2, 3, 1, 5]), (4, [9, 7]), (6, [4]), (3, [2, 1, 3, 2])]
# Per group: (primitive forced on the planner, degree), or a plan: TreeMoveKV in one lane of both ranks (the
# planner prefers two one-rank lanes here, which move nothing).
PLANS = [("move_q", 2), Plan(degree=2, primitive="tree_move_kv", rounds=5, lanes=1,
                             placement=tuple((r, 0) for r in range(5))), ("ring", 2), (None, 1), (None, 1)]
MICRO_BATCH_ROWS = 16  # the whole batch in one micro-batch: split plans need the whole tree in one replay unit


def _plan_entries(rows):
    from augtree_verl.planner import plan_tree
    from augtree_verl.trainer import find_trees, plan_entries

    trees = find_trees([r["uid"] for r in rows], [len(r["prompt"]) for r in rows], [len(r["response"]) for r in rows])
    plans = {}
    for tree in trees:
        plan = PLANS[int(tree.uid.split("-")[1])]
        plans[tree.tree_id] = plan if isinstance(plan, Plan) else plan_tree(
            tree.prompt_len, tree.response_lens, degrees=(plan[1],), force_primitive=plan[0])
    return plan_entries(trees, plans, len(rows))


def _rank_main(rank: int, port: int, model_path: str, loss_agg_mode: str, entropy_coeff: float) -> None:
    from verl.utils import tensordict_utils as tu

    from tests.integration.test_engine_parity import _assert_close, _assert_params_match, _infer, _train

    H.init_process_group(rank=rank, world_size=WORLD, port=port)
    common = dict(loss_agg_mode=loss_agg_mode, entropy_coeff=entropy_coeff)
    stock, stock_loss = H.build_engine("fsdp2", model_path, **common)
    ours, our_loss = H.build_engine("augtree", model_path, **common, engine_knobs={"cp_degrees": [1, 2]})
    assert (ours.get_data_parallel_size(), ours.get_data_parallel_rank()) == (1, 0)
    assert ours.is_mp_src_rank_with_outputs() == (rank == 0)
    assert (stock.get_data_parallel_size(), stock.get_data_parallel_rank()) == (WORLD, rank)
    for step in range(STEPS):
        rows = H.group_rows(GROUPS, seed=step)
        mine, theirs = list(range(rank, len(rows), WORLD)), [rows[k] for k in range(rank, len(rows), WORLD)]
        batch = H.rows_to_batch(rows, micro_batch_size=MICRO_BATCH_ROWS, extra={"augtree_plan": _plan_entries(rows)})
        stock_batch = H.rows_to_batch(theirs)
        tu.assign_non_tensor(stock_batch, global_batch_size=len(rows))
        want, got = _infer(stock, stock_batch, entropy=True), _infer(ours, batch, entropy=True)
        for key in ("log_probs", "entropy"):
            g, w = H.response_logps(got, batch, key), H.response_logps(want, stock_batch, key)
            for k, row in enumerate(mine):
                _assert_close(f"rank {rank} step {step} {key} row {row}", g[row], w[k])
        current = H.response_logps(got, batch)
        H.set_old_log_probs(batch, current, seed=step)
        stock_batch["old_log_probs"] = torch.nested.as_nested_tensor(
            [batch["old_log_probs"][k] for k in mine], layout=torch.jagged)
        for b in (batch, stock_batch):
            tu.assign_non_tensor(b, calculate_entropy=entropy_coeff != 0)
        out_stock, out_ours = _train(stock, stock_loss, stock_batch), _train(ours, our_loss, batch)
        metrics = out_ours["metrics"]
        assert metrics["augtree/plan_fallbacks"].aggregate() == 0
        assert metrics["augtree/cp_degree_max"].aggregate() == 2
        for primitive in ("move_q", "tree_move_kv", "ring"):  # each ran context-parallel (it moved bytes)
            assert metrics[f"augtree/comm_bytes/{primitive}/bwd"].aggregate() > 0, primitive
        if rank == 0:  # verl adds grad_norm on the rank whose outputs it collects
            _assert_close(f"step {step} grad norm", torch.tensor(metrics["grad_norm"]),
                          torch.tensor(out_stock["metrics"]["grad_norm"]))
        _assert_params_match(ours, stock, step)
    torch.distributed.destroy_process_group()


@pytest.mark.timeout(420)
@pytest.mark.parametrize("loss_agg_mode, entropy_coeff", [("token-mean", 0.0), ("seq-mean-token-mean", 0.01)])
def test_cp_plans_in_the_engine_match_stock_data_parallel(tmp_path, loss_agg_mode, entropy_coeff):
    model_path = H.save_tiny_qwen2(str(tmp_path / "tiny-qwen2"))
    mp.start_processes(_rank_main, args=(H.free_port(), model_path, loss_agg_mode, entropy_coeff), nprocs=WORLD,
                       join=True, start_method="spawn")
