"""The training engine makes the run's planner profile at start-up (``integration.run_profile``): the model it
trains, its dtype and checkpointing, hardware figures from the cache or a calibration, or ``planner_profile``."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoConfig

from augtree_verl.integration import run_profile
from augtree_verl.planner import ClusterProfile
from augtree_verl.testing import harness as H

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, single_process_group):
    return H.save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="module")
def made(model_path):
    """(engine, its profile): the first engine of this shape in the session calibrates or reads the cache."""
    engine, _ = H.build_engine("augtree", model_path, engine_knobs={"use_planner": False})
    return engine, engine.run_profile.profile


def test_the_profile_is_the_trained_models(made, model_path):
    engine, profile = made
    config = AutoConfig.from_pretrained(model_path)
    assert (profile.num_layers, profile.hidden_size, profile.intermediate_size, profile.vocab_size,
            profile.num_heads, profile.num_kv_heads) == (
        config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size,
        config.num_attention_heads, config.num_key_value_heads)
    assert profile.dtype_bytes == 4 and not profile.activation_checkpointing   # the harness: fp32, no checkpointing
    assert profile.flops_per_s != ClusterProfile.default().flops_per_s          # measured here, not an H100's
    assert engine.run_profile.source.startswith(("calibrated now", "cache file"))
    # what the trainer reads from the engine's worker process
    assert run_profile.published_profile() == {"profile": profile.to_dict(), "source": engine.run_profile.source}


def test_planner_profile_is_the_users_file(made, model_path, tmp_path):
    _, profile = made
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
    engine, _ = H.build_engine("augtree", model_path, forward_only=True)   # the reference model's engine
    assert not hasattr(engine, "run_profile")
