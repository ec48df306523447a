#!/usr/bin/env bash
# The full RL loop on CPU: verl's main_ppo with one of our recipes, two worker processes, no GPU, no download.
#
#   bash examples/run_cpu.sh                                   # GRPO, AugTree engine, 2 steps
#   STRATEGY=fsdp2 bash examples/run_cpu.sh                    # the same recipe on verl's stock fsdp2 engine
#   RECIPE=dapo_augtree STEPS=5 bash examples/run_cpu.sh trainer.logger=[console,wandb]
#   TASK=vision STRATEGY=fsdp2 bash examples/run_cpu.sh        # GRPO on images: a tiny vision-language model
#
# Environment:
#   TASK        text (default) or vision: a tiny random Qwen2.5-VL and a shape task (an image of drawn shapes, "what
#               colour is the shape?" / "how many shapes are there?", the answer checked exactly), generated in
#               ASSETS_DIR (default ~/.cache/augtree-verl/cpu_loop_vision) by python -m augtree_verl.cpu_loop.vision_task
#               with the Qwen2.5 tokenizer in TOKENIZER (default tests/data/qwen2_5_tokenizer); its images are read by
#               the package's PIL-only dataset (no torchvision on CPU) and the model's processor is remote code
#               (trust_remote_code). Both engines train it (tests/e2e/test_vision.py: the same step 1).
#   RECIPE      grpo_augtree (default) or dapo_augtree
#   STRATEGY    augtree (default) or fsdp2 (the recipe's stock-engine variant, recipes/<name>_fsdp2.yaml)
#   MODEL_PATH  a Hugging Face causal LM directory with its tokenizer (default: a tiny random Llama-architecture model)
#   TRAIN_FILE, VAL_FILE  verl-format parquet: prompt (chat messages), data_source, reward_model.ground_truth
#               (default: a small long-prompt key-word task); the generated defaults live in ASSETS_DIR
#               (default ~/.cache/augtree-verl/cpu_loop), written by python -m augtree_verl.cpu_loop.task
#   STEPS       training steps (default 2); NPROC trainer worker processes (default 2)
#   VERL_FILE_LOGGER_PATH  when set, verl's file logger also writes every step's metrics there (JSONL)
#   LOGGER      trainer.logger (default [console], plus file when VERL_FILE_LOGGER_PATH is set)
# Further arguments are hydra overrides, applied last.
#
# Trainer modes: trainer.v1.trainer_mode=augtree_sync (the recipes' default), augtree_colocate_async or
# augtree_separate_async as an argument. separate_async gets its rollout pool: one rollout worker of its own (a
# logical GPU more), no rollout on the trainer workers (hybrid_engine=false), weights pushed after every
# mini-batch (parameter_sync_step=1) through this package's CPU checkpoint engine "gloo".
#
# The rollout is the CPU backend "hf" of this package (one replica over the NPROC workers, seeded sampling);
# the Ray settings below let everything be placed on a 2-core machine (a logical CPU count, one storage unit,
# one agent-loop and one reward worker; a logical GPU count that satisfies verl's resource check). With
# RAY_ADDRESS set it joins that cluster instead (examples/submit_cpu_job.sh).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RECIPE="${RECIPE:-grpo_augtree}"
STRATEGY="${STRATEGY:-augtree}"
STEPS="${STEPS:-2}"
NPROC="${NPROC:-2}"
TASK="${TASK:-text}"
PYTHON="${PYTHON:-python}"
ROLLOUT_TP="$NPROC"
ROLLOUT_GPUS=0
MODE_ARGS=()
for arg in "$@"; do
    if [[ "$arg" == trainer.v1.trainer_mode=*separate_async ]]; then
        ROLLOUT_TP=1
        ROLLOUT_GPUS=1
        MODE_ARGS=(actor_rollout_ref.hybrid_engine=false
                   actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node="$ROLLOUT_GPUS"
                   trainer.v1.separate_async.parameter_sync_step=1)
    fi
done

case "$RECIPE" in
    grpo_augtree|dapo_augtree) ;;
    *) echo "RECIPE must be grpo_augtree or dapo_augtree, got '$RECIPE'" >&2; exit 2 ;;
esac
case "$STRATEGY" in
    augtree) CONFIG_NAME="$RECIPE"; ENGINE_ARGS=(actor_rollout_ref.actor.fsdp_config.cp_degrees=[1]) ;;
    fsdp2) CONFIG_NAME="${RECIPE%_augtree}_fsdp2"; ENGINE_ARGS=() ;;
    *) echo "STRATEGY must be augtree or fsdp2, got '$STRATEGY'" >&2; exit 2 ;;
esac
case "$TASK" in
    text)
        ASSETS_DIR="${ASSETS_DIR:-$HOME/.cache/augtree-verl/cpu_loop}"
        TASK_MODULE=(augtree_verl.cpu_loop.task)
        # long prompts of a few hundred words
        TASK_ARGS=(data.max_prompt_length=1024) BATCH=2 ;;
    vision)
        ASSETS_DIR="${ASSETS_DIR:-$HOME/.cache/augtree-verl/cpu_loop_vision}"
        TASK_MODULE=(augtree_verl.cpu_loop.vision_task --tokenizer "${TOKENIZER:-$REPO/tests/data/qwen2_5_tokenizer}")
        # a prompt is about 50 tokens: the chat tokens, 16 image tokens and the question
        # verl packs vision-language rows (remove padding) with flash-attn only: padded rows on CPU
        TASK_ARGS=(data.max_prompt_length=128 data.image_key=images actor_rollout_ref.model.trust_remote_code=true
                   actor_rollout_ref.model.use_remove_padding=false
                   data.custom_cls.path=pkg://augtree_verl.cpu_loop.image_dataset data.custom_cls.name=ImageRLHFDataset)
        # 4 prompts: an untrained model answers about one sample in eight right, so most batches of 4 x 4 samples
        # have a group whose scores differ (a GRPO gradient) at step 1
        BATCH=4 ;;
    *) echo "TASK must be text or vision, got '$TASK'" >&2; exit 2 ;;
esac
if [[ -z "${MODEL_PATH:-}" || -z "${TRAIN_FILE:-}" || -z "${VAL_FILE:-}" ]] && [[ ! -f "$ASSETS_DIR/data/test.parquet" ]]; then
    "$PYTHON" -m "${TASK_MODULE[@]}" --out "$ASSETS_DIR"
fi
MODEL_PATH="${MODEL_PATH:-$ASSETS_DIR/model}"
TRAIN_FILE="${TRAIN_FILE:-$ASSETS_DIR/data/train.parquet}"
VAL_FILE="${VAL_FILE:-$ASSETS_DIR/data/test.parquet}"
LOGGER="${LOGGER:-[console${VERL_FILE_LOGGER_PATH:+,file}]}"
# DAPO's overlong buffer must fit in the short CPU responses.
RECIPE_ARGS=()
[[ "$RECIPE" == dapo_augtree ]] && RECIPE_ARGS=(reward.reward_kwargs.overlong_buffer_cfg.len=4)
FP32="{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
# A new local Ray instance (ray.init would otherwise join the newest one on this host) sized for the trainer,
# unless RAY_ADDRESS names a cluster (a `ray job submit` entrypoint has it): then the cluster's resources
# count, and VERL_PLATFORM=cpu must come with the job's runtime environment (Ray refuses the same variable
# in both).
RAY_ARGS=()
if [[ -z "${RAY_ADDRESS:-}" ]]; then
    RAY_ARGS=(+ray_kwargs.ray_init.address=local ray_kwargs.ray_init.num_cpus=16
              +ray_kwargs.ray_init.num_gpus="$((NPROC + ROLLOUT_GPUS))" +ray_kwargs.ray_init.include_dashboard=false
              +ray_kwargs.ray_init.runtime_env.env_vars.VERL_PLATFORM=cpu)
fi

export VERL_PLATFORM=cpu
exec "$PYTHON" -m verl.trainer.main_ppo \
    --config-path "$REPO/recipes" --config-name "$CONFIG_NAME" \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
    actor_rollout_ref.model.enable_gradient_checkpointing=false \
    data.train_files="$TRAIN_FILE" data.val_files="$VAL_FILE" \
    "${TASK_ARGS[@]}" data.max_response_length=16 \
    data.train_batch_size="$BATCH" data.dataloader_num_workers=0 \
    actor_rollout_ref.actor.ppo_mini_batch_size="$BATCH" \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192 \
    actor_rollout_ref.actor.use_torch_compile=false \
    actor_rollout_ref.actor.fsdp_config.use_torch_compile=false \
    actor_rollout_ref.ref.fsdp_config.use_torch_compile=false \
    +actor_rollout_ref.actor.fsdp_config.mixed_precision="$FP32" \
    +actor_rollout_ref.ref.fsdp_config.mixed_precision="$FP32" \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP" \
    actor_rollout_ref.rollout.checkpoint_engine.backend=gloo \
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=augtree_verl.rollout.checkpoint_engine \
    actor_rollout_ref.rollout.agent.num_workers=1 \
    reward.num_workers=1 \
    reward.custom_reward_function.path=pkg://augtree_verl.cpu_loop.reward \
    transfer_queue.backend.SimpleStorage.num_data_storage_units=1 \
    trainer.n_gpus_per_node="$NPROC" trainer.nnodes=1 \
    trainer.total_training_steps="$STEPS" \
    trainer.logger="$LOGGER" \
    trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1 trainer.resume_mode=disable \
    "${ENGINE_ARGS[@]}" "${RECIPE_ARGS[@]}" "${RAY_ARGS[@]}" "${MODE_ARGS[@]}" \
    "$@"
