#!/usr/bin/env bash
# GRPO + AugTree on one 8-GPU node: Qwen2.5-7B-Instruct on long-context MuSiQue RAG prompts (~23k tokens).
#
#   python examples/prepare_musique_longctx.py --input musique_ans_v1.0_train.jsonl   # once: ~/data/musique_longctx
#   bash examples/run_grpo_single_node.sh [hydra overrides...]
#
# Environment: MODEL (HF id or local path), DATA_DIR (train/test parquet), NGPUS, CP_DEGREES (default: from
# NGPUS), RECIPE (grpo_augtree or dapo_augtree). Extra arguments are hydra overrides, applied last, e.g.
# data.train_batch_size=32.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="${MODEL:-Qwen/Qwen2.5-7B-Instruct}"
DATA_DIR="${DATA_DIR:-$HOME/data/musique_longctx}"
NGPUS="${NGPUS:-8}"
# CP degrees: the powers of two up to 8 that divide NGPUS (a CP group stays inside one node).
CP_DEGREES="${CP_DEGREES:-$(d=1; out=1; while (( d * 2 <= 8 && NGPUS % (d * 2) == 0 )); do d=$((d * 2)); out="$out,$d"; done; echo "[$out]")}"
RECIPE="${RECIPE:-grpo_augtree}"

python -m verl.trainer.main_ppo \
    --config-path "$REPO/recipes" --config-name "$RECIPE" \
    actor_rollout_ref.model.path="$MODEL" \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    trainer.nnodes=1 \
    trainer.n_gpus_per_node="$NGPUS" \
    actor_rollout_ref.actor.fsdp_config.cp_degrees="$CP_DEGREES" \
    "$@"
