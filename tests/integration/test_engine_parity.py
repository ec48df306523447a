"""Our engine against verl's stock FSDP engine on CPU (world size 1, in-process): same model, batch, loss."""

from __future__ import annotations

import random

import pytest
import torch
from verl.utils import tensordict_utils as tu

from augtree_verl.replay import offload as offload_module
from augtree_verl.testing import harness as H
from tests.parity import RTOL, rel_err

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

STEPS = 3
# (prompt length, response lengths): groups of several sizes, a group of one, 1-token prompt and responses.
GROUPS = [(9, [3, 5, 4, 2]), (4, [6, 2, 3, 1, 5, 2]), (6, [4]), (1, [2, 1, 3])]
ROWS = sum(len(rs) for _, rs in GROUPS)
# ppo_kl is a mean of differences of log-probs (magnitude ~log(vocab) = 5) that nearly cancel, so only an
# absolute tolerance makes sense: float32 rounding of each log-prob is ~5e-7.
KL_ATOL = 1e-6


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, single_process_group):
    return H.save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2")))


def _infer(engine, batch, entropy=False):
    batch = batch.clone()
    tu.assign_non_tensor(batch, calculate_entropy=entropy)
    with engine.eval_mode():
        return engine.infer_batch(batch, loss_function=None)


def _train(engine, loss_fn, batch):
    with engine.train_mode():
        return engine.train_batch(batch.clone(), loss_function=loss_fn)


def _assert_close(what, got, want):
    err = rel_err(got, want)
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL:.0e}"


def _assert_params_match(ours, stock, step):
    got, want = H.full_params(ours), H.full_params(stock)
    assert got.keys() == want.keys()
    for name in want:
        _assert_close(f"step {step} parameter {name}", got[name], want[name])


def _run_steps(
    model_path,
    *,
    loss_agg_mode,
    order,
    entropy_coeff=0.0,
    knobs=None,
    gradient_checkpointing=False,
    model_settings=None,
):
    """STEPS optimizer steps of both engines; ours sees the rows permuted by ``order``. ``model_settings``: verl's
    model config fields (e.g. LoRA's)."""
    common = dict(
        loss_agg_mode=loss_agg_mode,
        entropy_coeff=entropy_coeff,
        gradient_checkpointing=gradient_checkpointing,
        model_settings=model_settings,
    )
    stock, stock_loss = H.build_engine("fsdp2", model_path, **common)
    ours, our_loss = H.build_engine("augtree", model_path, **common, engine_knobs=knobs)
    inverse = sorted(range(ROWS), key=lambda k: order[k])
    for step in range(STEPS):
        batch = H.group_batch(GROUPS, seed=step)
        mine = H.group_batch(GROUPS, seed=step, order=order)
        want = _infer(stock, batch, entropy=True)
        got = _infer(ours, mine, entropy=True)
        for key in ("log_probs", "entropy"):
            w, g = H.response_logps(want, batch, key), H.response_logps(got, mine, key)
            for row in range(ROWS):
                _assert_close(f"step {step} {key} row {row}", g[inverse[row]], w[row])
        current = H.response_logps(want, batch)
        H.set_old_log_probs(batch, current, seed=step)
        mine["old_log_probs"] = torch.nested.as_nested_tensor(
            [batch["old_log_probs"][k] for k in order], layout=torch.jagged
        )
        for b in (batch, mine):
            tu.assign_non_tensor(b, calculate_entropy=entropy_coeff != 0)
        out_stock = _train(stock, stock_loss, batch)
        out_ours = _train(ours, our_loss, mine)
        # Per-micro-batch losses are partial sums of the global loss: their total is order-independent.
        _assert_close(f"step {step} loss", torch.tensor(sum(out_ours["loss"])), torch.tensor(sum(out_stock["loss"])))
        _assert_close(
            f"step {step} grad norm",
            torch.tensor(out_ours["metrics"]["grad_norm"]),
            torch.tensor(out_stock["metrics"]["grad_norm"]),
        )
        assert out_stock["metrics"]["actor/pg_clipfrac"].aggregate() == 0, "old log-probs must not clip"
        _assert_params_match(ours, stock, step)
    return out_ours, out_stock


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_training_matches_stock_engine(model_path, loss_agg_mode):
    out_ours, out_stock = _run_steps(model_path, loss_agg_mode=loss_agg_mode, order=list(range(ROWS)))
    # Same micro-batches, same loss calls: verl's own metrics come out the same.
    _assert_close(
        "actor/pg_loss",
        torch.tensor(out_ours["metrics"]["actor/pg_loss"].aggregate()),
        torch.tensor(out_stock["metrics"]["actor/pg_loss"].aggregate()),
    )
    kl = [out["metrics"]["actor/ppo_kl"].aggregate() for out in (out_ours, out_stock)]
    assert abs(kl[0] - kl[1]) <= KL_ATOL, f"actor/ppo_kl {kl[0]} vs stock {kl[1]}"


@pytest.mark.timeout(300)
def test_shuffled_rows_and_entropy_loss_match_stock_engine(model_path):
    order = list(range(ROWS))
    random.Random(7).shuffle(order)
    _run_steps(model_path, loss_agg_mode="token-mean", order=order, entropy_coeff=0.01, knobs={"micro_batch_tokens": 8})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("offload", [False, True])
def test_gradient_checkpointing_matches_stock_engine(model_path, offload, monkeypatch):
    """Checkpointed layers are recomputed in the unit's backward, after the replay has returned. With
    ``offload_prompt_activations`` every prompt's boundaries wait on the host (the tiny model's are below the
    default threshold, so it is lowered to move all of them)."""
    monkeypatch.setattr(offload_module, "MIN_OFFLOAD_BYTES", 0)
    order = list(range(ROWS))
    random.Random(3).shuffle(order)
    out_ours, _ = _run_steps(
        model_path,
        loss_agg_mode="seq-mean-token-mean",
        order=order,
        entropy_coeff=0.01,
        knobs={"micro_batch_tokens": 8, "offload_prompt_activations": offload},
        gradient_checkpointing=True,
    )
    moved = out_ours["metrics"]["augtree/offload/offloaded_bytes"].aggregate()
    assert (moved > 0) == offload
    if offload:
        assert out_ours["metrics"]["augtree/offload/prefetched_bytes"].aggregate() == moved


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target_modules", ["all-linear", ["q_proj", "v_proj"]])
def test_lora_adapters_match_stock_engine(model_path, target_modules):
    """verl's LoRA (``actor_rollout_ref.model.lora_rank``): the adapters train through the replay as through the
    stock engine, the base weights stay frozen. LoRA's B starts at zero, so A's gradient is zero at the first step
    and is compared from the second on (STEPS = 3)."""
    lora = dict(lora_rank=4, lora_alpha=8, target_modules=target_modules)
    order = list(range(ROWS))
    random.Random(5).shuffle(order)
    out_ours, _ = _run_steps(
        model_path, loss_agg_mode="token-mean", order=order, knobs={"micro_batch_tokens": 8}, model_settings=lora
    )
