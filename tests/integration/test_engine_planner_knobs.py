"""The engine's planner knobs. The training engine makes the run's planner profile at start-up
(``integration.run_profile``): the model it trains, its dtype and checkpointing, hardware figures from the
cache or a calibration, or ``planner_profile``. ``fallback_threshold_tokens`` runs short trees on one device."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoConfig
from verl.utils.metric import reduce_metrics

from augtree_verl.plan import Plan
from augtree_verl.plan_field import PLAN_FIELD
from augtree_verl.planner import ClusterProfile
from augtree_verl.planner.startup import published_profile
from augtree_verl.testing import harness as H

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, single_process_group):
    return H.save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="module")
def made(model_path):
    """(engine, its profile, what the process published when it was built): the first engine of this shape in
    the session calibrates or reads the cache. (Engines built later in this process publish theirs.)"""
    engine, _ = H.build_engine("augtree", model_path, engine_knobs={"planner_profile": None})
    return engine, engine.run_profile.profile, published_profile()


def test_the_profile_is_the_trained_models(made, model_path):
    engine, profile, published = made
    config = AutoConfig.from_pretrained(model_path)
    assert (
        profile.num_layers,
        profile.hidden_size,
        profile.intermediate_size,
        profile.vocab_size,
        profile.num_heads,
        profile.num_kv_heads,
    ) == (
        config.num_hidden_layers,
        config.hidden_size,
        config.intermediate_size,
        config.vocab_size,
        config.num_attention_heads,
        config.num_key_value_heads,
    )
    assert profile.dtype_bytes == 4 and not profile.activation_checkpointing  # the harness: fp32, no checkpointing
    assert profile.flops_per_s != ClusterProfile.default().flops_per_s  # measured here, not an H100's
    assert engine.run_profile.source.startswith(("calibrated now", "cache file"))
    # what the trainer reads from the engine's worker process
    assert published == {"profile": profile.to_dict(), "source": engine.run_profile.source}


def test_planner_profile_is_the_users_file(made, model_path, tmp_path):
    _, profile, _ = made
    mine = tmp_path / "profile.json"
    dataclasses.replace(profile, flops_per_s=4.25e11, slot_overhead_s=0.125).save(mine)
    engine, _ = H.build_engine("augtree", model_path, engine_knobs={"planner_profile": str(mine)})
    assert engine.run_profile.profile == ClusterProfile.load(mine)
    assert engine.run_profile.source == f"the user's file {mine}"
    other = tmp_path / "other.json"
    dataclasses.replace(profile, num_layers=profile.num_layers + 1).save(other)
    with pytest.raises(ValueError, match=r"planner_profile=.*other.json.* another model: num_layers"):
        H.build_engine("augtree", model_path, engine_knobs={"planner_profile": str(other)})


def test_a_forward_only_engine_makes_none(made, model_path):
    engine, _ = H.build_engine("augtree", model_path, forward_only=True)  # the reference model's engine
    assert not hasattr(engine, "run_profile")


def _fallbacks(engine, rows, plan: Plan) -> float:
    """The step's counted planner fallbacks when every tree of ``rows`` comes with ``plan``."""
    count = {uid: sum(r["uid"] == uid for r in rows) for uid in {r["uid"] for r in rows}}
    seen: dict[str, int] = {}
    entries = []
    for row in rows:
        index = seen[row["uid"]] = seen.get(row["uid"], -1) + 1
        entries.append(
            {
                **plan.to_dict(),
                "tree_id": f"{row['uid']}|{len(row['prompt'])}",
                "response_index": index,
                "num_responses": count[row["uid"]],
            }
        )
    with engine.eval_mode():
        out = engine.infer_batch(H.rows_to_batch(rows, extra={PLAN_FIELD: entries}))
    return float(reduce_metrics(out["metrics"])["augtree/plan_fallbacks"])


def test_fallback_threshold_tokens_runs_short_trees_on_one_device(made, model_path):
    """A degree-2 plan on an engine without CP subgroups is a counted planner fallback, unless the tree is
    shorter than ``fallback_threshold_tokens``: then it runs on one device by configuration (not counted)."""
    rows = H.group_rows([(4, [6, 2, 3, 5])])  # prompt + longest response: 10 tokens
    cp_plan = Plan(degree=2, est_time_s=0.25, est_single_s=0.4)
    assert _fallbacks(made[0], rows, cp_plan) == 1.0  # the default threshold, 0
    engine, _ = H.build_engine("augtree", model_path, engine_knobs={"fallback_threshold_tokens": 11})
    assert _fallbacks(engine, rows, cp_plan) == 0.0
