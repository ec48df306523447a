"""Every recipe composes on verl's own ppo_trainer (pip-installed verl) and sets the keys that matter."""

import dataclasses
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.workers.config import FSDPEngineConfig

from augtree_verl.integration.config import AugTreeEngineConfig

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
PRIMARY = sorted(p.stem for p in RECIPES.glob("*.yaml"))
AUGTREE = ["dapo_augtree", "grpo_augtree"]
VISION = "grpo_vl_augtree"
ENGINE_TARGET = "augtree_verl.integration.config.AugTreeEngineConfig"
STOCK_TARGET = "verl.workers.config.FSDPEngineConfig"
# What base/augtree_engine.yaml sets, the only difference between a recipe and its stock-engine variant.
AUGTREE_KNOBS = {f.name for f in dataclasses.fields(AugTreeEngineConfig)} - {
    f.name for f in dataclasses.fields(FSDPEngineConfig)
}


def compose_recipe(name, overrides=()):
    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def test_the_recipes_are_grpo_and_dapo_each_with_a_stock_engine_variant():
    assert PRIMARY == ["dapo_augtree", "dapo_fsdp2", "grpo_augtree", "grpo_fsdp2", "grpo_vl_augtree", "grpo_vl_fsdp2"]


@pytest.mark.parametrize("name", AUGTREE)
def test_recipe_selects_augtree_everywhere_and_passes_verls_validation(name):
    cfg = compose_recipe(name)
    # composed through the searchpath: verl's own defaults are there
    assert cfg.trainer.use_v1 and cfg.algorithm._target_ == "verl.trainer.config.AlgoConfig"
    actor, ref = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref
    assert actor.strategy == "augtree" and ref.strategy == "augtree"
    assert actor.fsdp_config._target_ == ENGINE_TARGET and ref.fsdp_config._target_ == ENGINE_TARGET
    assert cfg.trainer.v1.trainer_mode == "augtree_sync"
    assert cfg.algorithm.adv_estimator == "grpo"
    assert actor.loss_agg_mode == "token-mean"
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen2.5-7B-Instruct"
    # long context: prompt + response fill Qwen2.5's native 32k window, and the rollout follows the data keys
    assert cfg.data.max_prompt_length >= 16384
    assert cfg.data.max_prompt_length + cfg.data.max_response_length == 32768
    OmegaConf.resolve(cfg)
    assert cfg.actor_rollout_ref.rollout.prompt_length == cfg.data.max_prompt_length
    # the knobs reach the engine config dataclass verl's workers build (actor and the forward-only ref)
    actor_engine = omega_conf_to_dataclass(actor.fsdp_config)
    ref_engine = omega_conf_to_dataclass(ref.fsdp_config)
    assert type(actor_engine) is AugTreeEngineConfig and type(ref_engine) is AugTreeEngineConfig
    assert actor_engine.cp_degrees == ref_engine.cp_degrees == [1, 2, 4, 8]
    assert actor_engine.use_planner and ref_engine.forward_only and not actor_engine.forward_only
    assert actor_engine.offload_prompt_activations  # long prompts: their dormant activations wait on the host
    # the start-up probe replays the run's own longest rows (actor and ref)
    for engine in (actor_engine, ref_engine):
        assert engine.probe_prompt_tokens == cfg.data.max_prompt_length
        assert engine.probe_response_tokens == cfg.data.max_response_length
    assert omega_conf_to_dataclass(actor).engine.strategy == "augtree"
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


def _without_engine_keys(cfg) -> dict:
    """The resolved config minus what base/augtree_engine.yaml sets, under one run name."""
    cfg.trainer.experiment_name = "run"  # interpolated into checkpoint and trace paths
    OmegaConf.resolve(cfg)
    out = OmegaConf.to_container(cfg)
    for role in ("actor", "ref"):
        section = out["actor_rollout_ref"][role]
        section.pop("strategy")
        fsdp = section["fsdp_config"]
        fsdp.pop("_target_")
        for knob in AUGTREE_KNOBS:
            fsdp.pop(knob, None)
    out["actor_rollout_ref"]["actor"].pop("engine", None)
    out["actor_rollout_ref"]["rollout"]["agent"].pop("agent_loop_manager_class", None)  # the planner feed
    out["trainer"]["v1"].pop("trainer_mode")
    return out


@pytest.mark.parametrize("name", [*AUGTREE, VISION])
def test_stock_variant_is_the_same_recipe_on_verls_fsdp2_engine(name):
    stock_name = name.replace("_augtree", "_fsdp2")
    ours, stock = compose_recipe(name), compose_recipe(stock_name)
    actor, ref = stock.actor_rollout_ref.actor, stock.actor_rollout_ref.ref
    assert actor.strategy == "fsdp2" and ref.strategy == "fsdp2"
    assert actor.fsdp_config._target_ == STOCK_TARGET and ref.fsdp_config._target_ == STOCK_TARGET
    assert stock.trainer.v1.trainer_mode == "sync"
    assert stock.trainer.experiment_name == ours.trainer.experiment_name + "-fsdp2"
    actor_engine, ref_engine = omega_conf_to_dataclass(actor.fsdp_config), omega_conf_to_dataclass(ref.fsdp_config)
    assert type(actor_engine) is FSDPEngineConfig and type(ref_engine) is FSDPEngineConfig
    assert ref_engine.forward_only and ref_engine.param_offload and not actor_engine.forward_only
    assert omega_conf_to_dataclass(actor).engine.strategy == "fsdp2"
    validate_config(config=stock, use_reference_policy=need_reference_policy(stock), use_critic=need_critic(stock))
    assert _without_engine_keys(stock) == _without_engine_keys(ours)


def test_grpo_recipe():
    cfg = compose_recipe("grpo_augtree")
    actor = cfg.actor_rollout_ref.actor
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert actor.clip_ratio_low == actor.clip_ratio_high == 0.2
    assert actor.use_kl_loss and actor.kl_loss_type == "low_var_kl" and need_reference_policy(cfg)
    assert not cfg.algorithm.filter_groups.enable


def test_dapo_recipe_is_verls_dapo():
    cfg = compose_recipe("dapo_augtree")
    actor = cfg.actor_rollout_ref.actor
    assert cfg.actor_rollout_ref.rollout.n == 16
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.28)  # clip-higher
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.metric == "reward"  # dynamic sampling
    assert not actor.use_kl_loss and not cfg.algorithm.use_kl_in_reward and not need_reference_policy(cfg)
    assert cfg.reward.reward_manager.name == "dapo"
    overlong = cfg.reward.reward_kwargs.overlong_buffer_cfg  # overlong reward shaping
    assert overlong.enable and overlong.len == 2048 and overlong.penalty_factor == 1.0
    OmegaConf.resolve(cfg)
    assert cfg.reward.reward_kwargs.max_resp_len == cfg.data.max_response_length == 8192


def test_vision_recipe_is_verls_qwen2_5_vl_geo3k_run_on_our_engine():
    """verl's examples/grpo_trainer/run_qwen2_5_vl-7b.sh on Geo3K as verl's geo3k.py prepares it."""
    cfg = compose_recipe(VISION)
    actor, ref = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref
    assert actor.strategy == ref.strategy == "augtree" and cfg.trainer.v1.trainer_mode == "augtree_sync"
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert cfg.data.image_key == "images" and cfg.data.train_files == "~/data/geo3k/train.parquet"
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length, cfg.data.train_batch_size) == (1024, 2048, 512)
    assert cfg.actor_rollout_ref.rollout.n == 5 and actor.ppo_mini_batch_size == 128
    assert actor.use_kl_loss and actor.kl_loss_coef == 0.01 and actor.kl_loss_type == "low_var_kl"
    OmegaConf.resolve(cfg)
    actor_engine = omega_conf_to_dataclass(actor.fsdp_config)
    assert type(actor_engine) is AugTreeEngineConfig and actor_engine.probe_prompt_tokens == 1024
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


def test_overrides_work_as_on_any_verl_config():
    cfg = compose_recipe(
        "grpo_augtree",
        [
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.fsdp_config.cp_degrees=[1,2]",
            "actor_rollout_ref.actor.fsdp_config.use_planner=false",
            "actor_rollout_ref.actor.fsdp_config.fallback_threshold_tokens=4096",
        ],
    )
    OmegaConf.resolve(cfg)
    assert cfg.actor_rollout_ref.rollout.n == 4
    ref = cfg.actor_rollout_ref.ref.fsdp_config  # the ref follows the actor's knobs
    assert ref.cp_degrees == [1, 2] and ref.fallback_threshold_tokens == 4096
    # the planner knobs are the actor's (the trainer plans for both): the ref's copy would be read by nothing
    assert cfg.actor_rollout_ref.actor.fsdp_config.use_planner is False
    assert not {"use_planner", "planner_name", "planner_timeout_s", "force_primitive"} & set(ref)


def main_ppo_cfg_job(args, cwd):
    """verl's real CLI entry point, asked to print the composed job config instead of training."""
    out = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *args, "--cfg", "job"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=cwd,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return yaml.safe_load(out.stdout)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_single_node_script_composes_through_main_ppo(tmp_path):
    """examples/run_grpo_single_node.sh, extra arguments passed through to hydra: here --cfg job."""
    env = dict(os.environ, MODEL="/models/qwen2.5-7b-instruct", DATA_DIR=str(tmp_path), NGPUS="4")
    out = subprocess.run(
        ["bash", str(REPO / "examples/run_grpo_single_node.sh"), "--cfg", "job"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = yaml.safe_load(out.stdout)
    assert cfg["actor_rollout_ref"]["actor"]["strategy"] == "augtree"
    assert cfg["actor_rollout_ref"]["model"]["path"] == "/models/qwen2.5-7b-instruct"
    assert cfg["data"]["train_files"] == f"{tmp_path}/train.parquet"
    assert cfg["trainer"]["n_gpus_per_node"] == 4 and cfg["trainer"]["v1"]["trainer_mode"] == "augtree_sync"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_job_script_submits_a_command_that_composes_on_the_cluster_side(tmp_path):
    """DRY_RUN=1 prints the ``ray job submit`` command; its entrypoint runs from the uploaded working_dir."""
    env = dict(os.environ, DRY_RUN="1", RAY_ADDRESS="http://head:8265", NNODES="2", DATA_DIR="/shared/musique")
    out = subprocess.run(
        ["bash", str(REPO / "examples/run_dapo_ray_job.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout.strip().splitlines()[-1])
    assert argv[:3] == ["ray", "job", "submit"] and argv[argv.index("--address") + 1] == "http://head:8265"
    runtime_env = yaml.safe_load(argv[argv.index("--runtime-env-json") + 1])  # JSON is YAML
    assert Path(runtime_env["working_dir"]) == REPO
    entrypoint = argv[argv.index("--") + 1 :]
    assert entrypoint[:3] == ["python", "-m", "verl.trainer.main_ppo"]
    # Ray runs the entrypoint with the uploaded working_dir as the current directory.
    cfg = main_ppo_cfg_job(entrypoint[3:], cwd=runtime_env["working_dir"])
    assert cfg["trainer"]["nnodes"] == 2 and cfg["trainer"]["v1"]["trainer_mode"] == "augtree_sync"
    assert cfg["actor_rollout_ref"]["actor"]["clip_ratio_high"] == 0.28
    assert cfg["data"]["train_files"] == "/shared/musique/train.parquet"
