"""AugTreeEngineConfig: defaults, validation, and selection through verl's actor config (hydra _target_)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import FSDPEngineConfig

from augtree_verl.integration.config import AugTreeEngineConfig

TARGET = "augtree_verl.integration.config.AugTreeEngineConfig"


def test_defaults_subclass_verl_fsdp_config():
    config = AugTreeEngineConfig()
    assert isinstance(config, FSDPEngineConfig)
    assert config.strategy == "augtree" and config.cp_degrees == [1] and config.use_planner
    assert not config.offload_prompt_activations
    assert (
        config.replay_memory_budget_gib is None
        and AugTreeEngineConfig(replay_memory_budget_gib=2).replay_memory_budget_gib == 2
    )
    assert config.probe_prompt_tokens is None and config.probe_response_tokens is None


def test_planner_timeout_has_one_default():
    from augtree_verl.planner import ClusterProfile
    from augtree_verl.planner.client import DEFAULT_TIMEOUT_S, PlannerClient

    client = PlannerClient(None, degrees=(1,), profile=ClusterProfile.default())
    assert AugTreeEngineConfig().planner_timeout_s == client.timeout_s == DEFAULT_TIMEOUT_S


@pytest.mark.parametrize(
    "knob, bad",
    [
        ("micro_batch_tokens", 0),
        ("micro_batch_tokens", 2.5),
        ("fallback_threshold_tokens", -1),
        ("cp_degrees", []),
        ("cp_degrees", [2, 0]),
        ("cp_degrees", [2, 3]),
        ("force_primitive", "ulysses"),
        ("use_planner", "yes"),
        ("planner_name", ""),
        ("planner_timeout_s", 0),
        ("planner_ttl_s", -1.0),
        ("planner_max_entries", 0),
        ("strategy", "megatron"),
        ("offload_prompt_activations", 1),
        ("replay_memory_budget_gib", 0),
        ("replay_memory_budget_gib", -1.5),
        ("replay_memory_budget_gib", "8"),
        ("replay_memory_budget_gib", True),
        ("probe_prompt_tokens", 0),
        ("probe_response_tokens", 2.5),
        ("probe_response_tokens", "1024"),
    ],
)
def test_bad_knob_raises_value_error_naming_it(knob, bad):
    with pytest.raises(ValueError, match=knob.split("_")[0]) as err:
        AugTreeEngineConfig(**{knob: bad})
    assert repr(bad) in str(err.value) or str(bad) in str(err.value)


def test_cp_degrees_are_sorted_and_deduplicated():
    assert AugTreeEngineConfig(cp_degrees=[4, 1, 4, 2]).cp_degrees == [1, 2, 4]


def test_actor_config_selects_it_with_target_and_strategy():
    actor = OmegaConf.create(
        {
            "_target_": "verl.workers.config.FSDPActorConfig",
            "strategy": "augtree",
            "rollout_n": 4,
            "ppo_micro_batch_size_per_gpu": 2,
            "fsdp_config": {
                "_target_": TARGET,
                "strategy": "fsdp",
                "micro_batch_tokens": 4096,
                "cp_degrees": [1, 2],
                "force_primitive": "move_q",
            },
        }
    )
    config = omega_conf_to_dataclass(actor)
    engine = config.engine
    assert type(engine) is AugTreeEngineConfig
    assert engine.strategy == "augtree"  # copied from the actor by FSDPActorConfig
    assert (engine.micro_batch_tokens, engine.cp_degrees, engine.force_primitive) == (4096, [1, 2], "move_q")
