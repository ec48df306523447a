"""World size 2 (spawned gloo ranks): groups split across DP ranks, held-back gradient sync, FSDP sharding."""

from __future__ import annotations

import pytest
import torch

from augtree_verl.testing import harness as H

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

STEPS = 2
WORLD = 2
# Rows are dealt to ranks round-robin, so every group of two or more has samples on both ranks.
GROUPS = [(9, [3, 5, 4, 2]), (4, [6, 2, 3, 1, 5, 2]), (6, [4, 2]), (1, [2, 1, 3, 2])]


def _rank_main(
    rank: int,
    port: int,
    model_path: str,
    groups=GROUPS,
    probe_bound: float | None = None,
    mrope: bool = False,
    build: dict | None = None,
    prepare_stock=None,
) -> None:
    """STEPS optimizer steps of ``groups`` (rows dealt round-robin) on both engines: log-probs, entropies,
    losses, grad norms and weights equal; with ``probe_bound``, the start-up probe's gradient error under it.
    ``mrope``: verl's M-RoPE position ids (a vision-language model's text-only rows); ``build``: ``build_engine``
    settings of both engines; ``prepare_stock(engine)``: called on the stock engine once built."""
    H.use_cpu_platform()  # a spawned process: select verl's CPU platform before building engines
    from verl.utils import tensordict_utils as tu

    H.init_process_group(rank=rank, world_size=WORLD, port=port)
    stock, stock_loss = H.build_engine("fsdp2", model_path, **(build or {}))
    if prepare_stock is not None:
        prepare_stock(stock)
    ours, our_loss = H.build_engine("augtree", model_path, engine_knobs={"micro_batch_tokens": 8}, **(build or {}))
    if probe_bound is not None:
        assert ours.exactness_probe.grad_err <= probe_bound
    for step in range(STEPS):
        rows = H.group_rows(groups, seed=step)[rank::WORLD]
        batch = H.rows_to_batch(rows, mrope=mrope)
        # as verl's worker does: the batch carries the model config's use_remove_padding (False for hybrids)
        tu.assign_non_tensor(
            batch, global_batch_size=len(rows) * WORLD, use_remove_padding=stock.model_config.use_remove_padding
        )
        compare_step((stock, stock_loss), (ours, our_loss), batch, f"rank {rank} step {step}", step)
    torch.distributed.destroy_process_group()


def compare_step(stock: tuple, ours: tuple, batch, where: str, step: int) -> dict:
    """One step of both engines (``(engine, loss_fn)`` each) on ``batch``: log-probs and entropies, then old log-probs
    set (``H.set_old_log_probs``, seeded by ``step``) and a training step, whose losses (each verl micro-batch's), grad
    norms and weights must agree; returns our engine's training output. ``where``: names the step in a failure."""
    from tests.integration.test_engine_parity import _assert_close, _assert_params_match, _infer, _train

    want, got = _infer(stock[0], batch, entropy=True), _infer(ours[0], batch, entropy=True)
    for key in ("log_probs", "entropy"):
        for row, (g, w) in enumerate(zip(H.response_logps(got, batch, key), H.response_logps(want, batch, key))):
            _assert_close(f"{where} {key} row {row}", g, w)
    H.set_old_log_probs(batch, H.response_logps(want, batch), seed=step)
    out_stock, out_ours = _train(*stock, batch), _train(*ours, batch)
    # each verl micro-batch's loss on its own, not their sum: with advantages of both signs the sum can nearly cancel,
    # and its relative error then measures the rounding of the sum rather than the losses
    assert len(out_ours["loss"]) == len(out_stock["loss"]), (where, out_ours["loss"], out_stock["loss"])
    for m, (g, w) in enumerate(zip(out_ours["loss"], out_stock["loss"])):
        _assert_close(f"{where} loss of micro-batch {m}", torch.tensor(g), torch.tensor(w))
    _assert_close(
        f"{where} grad norm",
        torch.tensor(out_ours["metrics"]["grad_norm"]),
        torch.tensor(out_stock["metrics"]["grad_norm"]),
    )
    _assert_params_match(ours[0], stock[0], step)
    return out_ours


@pytest.mark.timeout(420)
def test_world_size_two_matches_stock_engine(tmp_path):
    model_path = H.save_tiny_qwen2(str(tmp_path / "tiny-qwen2"))
    H.start_ranks(_rank_main, (H.free_port(), model_path), WORLD)
