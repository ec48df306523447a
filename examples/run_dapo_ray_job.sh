#!/usr/bin/env bash
# DAPO + AugTree as a job on a running Ray cluster (default: 2 nodes x 8 GPUs), Qwen2.5-7B-Instruct on
# long-context MuSiQue RAG prompts.
#
# Every node runs the image from docker/Dockerfile (or has `pip install -e ".[gpu]"` of this repo), the head
# node was started with `ray start --head --dashboard-host=0.0.0.0`, the workers with
# `ray start --address=<head>:6379`, and DATA_DIR is on a filesystem every node can read.
#
#   RAY_ADDRESS=http://<head>:8265 bash examples/run_dapo_ray_job.sh [hydra overrides...]
#   DRY_RUN=1 bash examples/run_dapo_ray_job.sh        # print the submit command instead of running it
#
# The repository is uploaded as the job's working_dir, so the entrypoint finds the recipes at ./recipes
# (--config-dir is resolved against the current directory; --config-path would need an absolute path on the
# cluster). Extra arguments are hydra overrides, applied last.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
MODEL="${MODEL:-Qwen/Qwen2.5-7B-Instruct}"
DATA_DIR="${DATA_DIR:-/mnt/shared/data/musique_longctx}"
NNODES="${NNODES:-2}"
NGPUS="${NGPUS:-8}"
# CP degrees: the powers of two up to 8 that divide NGPUS (a CP group stays inside one node).
CP_DEGREES="${CP_DEGREES:-$(d=1; out=1; while (( d * 2 <= 8 && NGPUS % (d * 2) == 0 )); do d=$((d * 2)); out="$out,$d"; done; echo "[$out]")}"
RECIPE="${RECIPE:-dapo_augtree}"

# Forwarded to every Ray worker; WANDB_API_KEY only if set here (it is then visible in the job's metadata,
# so prefer setting it on the nodes).
RUNTIME_ENV=$(python - "$REPO" <<'PY'
import json, os, sys
env_vars = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "VLLM_LOGGING_LEVEL": "WARN"}
if os.environ.get("WANDB_API_KEY"):
    env_vars["WANDB_API_KEY"] = os.environ["WANDB_API_KEY"]
print(json.dumps({"working_dir": sys.argv[1],
                  "excludes": [".git", "*.parquet", "outputs", "wandb", "checkpoints", "**/__pycache__"],
                  "env_vars": env_vars}))
PY
)

cmd=(ray job submit --address "$RAY_ADDRESS" --runtime-env-json "$RUNTIME_ENV" --
     python -m verl.trainer.main_ppo
     --config-dir recipes --config-name "$RECIPE"
     actor_rollout_ref.model.path="$MODEL"
     data.train_files="$DATA_DIR/train.parquet"
     data.val_files="$DATA_DIR/test.parquet"
     trainer.nnodes="$NNODES"
     trainer.n_gpus_per_node="$NGPUS"
     actor_rollout_ref.actor.fsdp_config.cp_degrees="$CP_DEGREES"
     "$@")

if [[ "${DRY_RUN:-0}" == "1" ]]; then
    printf '%q ' "${cmd[@]}"
    echo
else
    "${cmd[@]}"
fi
