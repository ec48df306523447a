#!/usr/bin/env bash
# examples/run_cpu.sh as a job on a running Ray cluster (`ray job submit`): the CPU loop, submitted.
#
#   ray start --head --node-ip-address=127.0.0.1 --num-cpus=16 --num-gpus=2    # once; logical CPUs/GPUs
#   RAY_ADDRESS=http://127.0.0.1:8265 bash examples/submit_cpu_job.sh [hydra overrides...]
#   DRY_RUN=1 bash examples/submit_cpu_job.sh                                   # print the submit command
#
# The head needs a logical CPU count that fits the trainer's actors (16 here) and NPROC logical GPUs, NPROC + 1
# for trainer.v1.trainer_mode=augtree_separate_async (its rollout worker; verl's resource check counts GPUs;
# on the CPU platform its workers ask for CPUs). The repository is uploaded as
# the job's working_dir; RECIPE, STRATEGY, STEPS, NPROC, MODEL_PATH, TRAIN_FILE, VAL_FILE, ASSETS_DIR,
# VERL_FILE_LOGGER_PATH, LOGGER and PYTHON are forwarded to the job when set (paths must exist where the
# job runs). Extra arguments are hydra overrides.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"

RUNTIME_ENV=$("${PYTHON:-python}" - "$REPO" <<'PY'
import json, os, sys
forward = ["RECIPE", "STRATEGY", "STEPS", "NPROC", "MODEL_PATH", "TRAIN_FILE", "VAL_FILE", "ASSETS_DIR",
           "VERL_FILE_LOGGER_PATH", "LOGGER", "PYTHON", "PYTHONPATH"]
env_vars = {"VERL_PLATFORM": "cpu", **{k: os.environ[k] for k in forward if os.environ.get(k)}}
print(json.dumps({"working_dir": sys.argv[1],
                  "excludes": [".git", "*.parquet", "outputs", "wandb", "checkpoints", "**/__pycache__"],
                  "env_vars": env_vars}))
PY
)

cmd=(ray job submit --address "$RAY_ADDRESS" --runtime-env-json "$RUNTIME_ENV" -- bash examples/run_cpu.sh "$@")
if [[ "${DRY_RUN:-0}" == "1" ]]; then
    printf '%q ' "${cmd[@]}"
    echo
else
    "${cmd[@]}"
fi
