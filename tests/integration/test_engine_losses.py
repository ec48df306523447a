"""Every policy loss and aggregation verl 0.9.1 offers, with ``loss_scale_factor`` None and set, at verl's micro-batch
settings: our engine's gradients, losses and metrics against verl's stock engine (world 1, in-process).

One pair of engines serves every setting: each setting is one ``forward_backward_batch`` (no optimizer step) of
both engines on the same batch, whose verl micro-batches mix rows of different groups (so the replay's own
micro-batches, a tree's responses, are not verl's). The settings whose loss couples the rows of one call
(``integration.loss_calls.coupling``: ``seq-mean-token-sum-norm`` without a scale factor, ``kl_cov``,
``clip_cov``, ``geo_mean``, ``bypass_mode``) run scores first; the others per replay micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.utils import tensordict_utils as tu

from augtree_verl.integration import loss_calls
from augtree_verl.testing import harness as H
from tests.parity import RTOL, rel_err

pytestmark = pytest.mark.slow  # builds verl engines

# (prompt length, response lengths): the rows below interleave the groups, so no verl micro-batch is one group.
GROUPS = [(9, [3, 5, 4, 2]), (4, [6, 2, 3, 1, 5, 2]), (6, [4]), (1, [2, 1, 3])]
ORDER = [0, 4, 10, 11, 1, 5, 12, 2, 6, 13, 3, 7, 8, 9]
AGGREGATIONS = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
SCALE_FACTOR = 7  # actor.loss_scale_factor when set: any constant
MICRO_BATCHES = {
    "rows-1": dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=1),
    "rows-2": dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=2),
    "rows-7": dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=7),
    "dynamic": dict(use_dynamic_bsz=True, max_token_len_per_gpu=24),
}
# What each policy loss needs set beyond the defaults, and values that make it bite on a tiny model: clip_cov's
# bounds take every unclipped token as a candidate (the default (1, 5) selects none of a tiny model's
# covariances), its ratio and kl_cov's pick 1-2 tokens per call; bypass_mode normalises its IS weights over the
# call's rows and uses REINFORCE, so the weights reach the gradient.
POLICY_SETTINGS = {
    "dro": dict(dro_beta=0.5),
    "clip_cov": dict(clip_cov_lb=-1e9, clip_cov_ub=1e9, clip_cov_ratio=0.05),
    "kl_cov": dict(kl_cov_ratio=0.05),
    "bypass_mode": dict(
        rollout_correction=dict(rollout_is="token", rollout_is_batch_normalize=True, loss_type="reinforce")
    ),
}
LOSS_MODES = sorted(POLICY_LOSS_REGISTRY)
# Every policy loss x every aggregation x loss_scale_factor None and set, at 2 rows a micro-batch; then verl's
# other micro-batch settings for a row-additive and a coupled setting of each kind.
CASES = [(mode, agg, scale, "rows-2") for mode in LOSS_MODES for agg in AGGREGATIONS for scale in (None, SCALE_FACTOR)]
CASES += [
    (mode, agg, None, micro_batches)
    for mode, agg in [("kl_cov", "token-mean"), ("vanilla", "seq-mean-token-sum-norm"), ("gspo", "seq-mean-token-mean")]
    for micro_batches in ("rows-1", "rows-7", "dynamic")
]
CASES += [("clip_cov", "seq-mean-token-mean", SCALE_FACTOR, "dynamic"), ("geo_mean", "token-sum", None, "rows-7")]
# ppo_kl-like metrics are means of differences of log-probs that nearly cancel: an absolute tolerance (see
# tests/integration/test_engine_parity.py).
METRIC_ATOL = 1e-6


def test_every_verl_policy_loss_is_covered():
    """A verl release that adds a policy loss must be classified (row-additive or coupled) and tested here."""
    known = loss_calls.ROW_ADDITIVE_POLICY_LOSSES | set(loss_calls.COUPLED_POLICY_LOSSES)
    assert set(POLICY_LOSS_REGISTRY) == known


@pytest.fixture(scope="module")
def engines(tmp_path_factory, single_process_group):
    path = H.save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2")))
    (stock, stock_loss), (ours, _) = H.build_engine("fsdp2", path), H.build_engine("augtree", path)
    return stock, ours, stock_loss.keywords["config"]


def _loss(config, mode, agg, scale, entropy_coeff, use_kl):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config.actor import PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    settings = dict(POLICY_SETTINGS.get(mode, {}))
    if "rollout_correction" in settings:
        settings["rollout_correction"] = RolloutCorrectionConfig(**settings["rollout_correction"])
    policy = PolicyLossConfig(loss_mode=mode, **settings)
    actor = dataclasses.replace(
        config,
        policy_loss=policy,
        loss_agg_mode=agg,
        loss_scale_factor=scale,
        entropy_coeff=entropy_coeff,
        use_kl_loss=use_kl,
        kl_loss_coef=0.1,
    )
    return functools.partial(ppo_loss, config=actor)  # as verl's worker binds it


def _rows() -> list:
    rows = H.group_rows(GROUPS, seed=3)
    return [rows[k] for k in ORDER]


@pytest.fixture(scope="module")
def current(engines) -> list[torch.Tensor]:
    """The stock engine's log-probs of the rows (no setting takes an optimizer step, so one inference serves all:
    the old log-probs near them, and the KL reference)."""
    stock = engines[0]
    batch = H.rows_to_batch(_rows())
    tu.assign_non_tensor(batch, **MICRO_BATCHES["rows-2"], calculate_entropy=False)
    with stock.eval_mode():
        return H.response_logps(stock.infer_batch(batch.clone(), loss_function=None), batch)


def _batch(current: list[torch.Tensor], micro_batches: str, *, entropy: bool, use_kl: bool):
    batch = H.rows_to_batch(_rows())
    tu.assign_non_tensor(batch, **MICRO_BATCHES[micro_batches], calculate_entropy=entropy)
    H.set_old_log_probs(batch, current, seed=1)
    if use_kl:
        g = torch.Generator().manual_seed(2)
        batch["ref_log_prob"] = torch.nested.as_nested_tensor(
            [c + 0.05 * torch.randn(c.shape, generator=g) for c in current], layout=torch.jagged
        )
    return batch


def _gradients(engine, loss_fn, batch) -> tuple[dict, list[float], dict]:
    engine.optimizer_zero_grad()
    torch.manual_seed(0)  # clip_cov draws tokens with torch.randperm: both engines start from one state
    with engine.train_mode(zero_grad_on_exit=True):  # the gradients are read inside, before the exit zeroes them
        out = engine.forward_backward_batch(batch.clone(), loss_fn, forward_only=False)
        grads = {
            name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for name, p in engine.module.named_parameters()
            if p.grad is not None
        }
    return grads, out["loss"], out["metrics"]


def _value(metric) -> float:
    return metric.aggregate() if hasattr(metric, "aggregate") else float(metric)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode,agg,scale,micro_batches", CASES, ids=lambda v: str(v))
def test_loss_setting_matches_stock_engine(engines, current, mode, agg, scale, micro_batches):
    stock, ours, config = engines
    entropy, use_kl = mode == "vanilla" and agg == "seq-mean-token-sum-norm", mode == "gspo"
    loss_fn = _loss(config, mode, agg, scale, 0.01 if entropy else 0.0, use_kl)
    batch = _batch(current, micro_batches, entropy=entropy, use_kl=use_kl)
    want, want_losses, want_metrics = _gradients(stock, loss_fn, batch)
    got, got_losses, got_metrics = _gradients(ours, loss_fn, batch)
    assert want.keys() == got.keys() and want
    live = [name for name in want if want[name].abs().max() > 0]
    assert len(live) > len(want) // 2, f"only {len(live)}/{len(want)} stock gradients are non-zero"
    for name in want:
        err = rel_err(got[name], want[name])
        assert err <= RTOL, f"{mode}/{agg}/{scale}/{micro_batches}: grad of {name} relative error {err:.2e}"
    assert len(got_losses) == len(want_losses)
    for m, (a, b) in enumerate(zip(got_losses, want_losses)):
        assert abs(a - b) <= RTOL * max(abs(b), 1e-3), f"micro-batch {m} loss {a} vs stock {b}"
    for key, metric in want_metrics.items():
        if key.startswith("actor/") or key in ("kl_loss",):
            a, b = _value(got_metrics[key]), _value(metric)
            assert abs(a - b) <= max(METRIC_ATOL, RTOL * abs(b)), f"metric {key}: {a} vs stock {b}"
    scores_first = _value(got_metrics["augtree/loss/scores_first_s"]) > 0
    assert scores_first == (loss_calls.coupling(loss_fn, batch) is not None)
