#!/usr/bin/env bash
# Step times users compare on wandb: the same recipe on verl's stock fsdp2 engine and on AugTree, on CPU.
#
#   bash examples/compare_engines.sh                      # GRPO, 5 steps each, long prompts; OUT_DIR=./compare_engines
#   RECIPE=dapo_augtree STEPS=10 bash examples/compare_engines.sh [hydra overrides...]
#   PROMPTS=short bash examples/compare_engines.sh        # the short-prompt task of examples/run_cpu.sh
#
# Runs examples/run_cpu.sh with STRATEGY=fsdp2, then augtree (same seed, data and model), logs both to wandb
# (offline unless WANDB_API_KEY is set or WANDB_MODE says otherwise; runs grouped by engine through
# WANDB_RUN_GROUP, project augtree-verl) and to OUT_DIR/<engine>.jsonl, then writes OUT_DIR/compare.png
# (timing_s/update_actor, timing_s/old_log_prob, timing_s/step, reward, loss per step) and prints each
# timing's median over steps 2+ with the fsdp2/augtree ratio. PROMPTS=long (the default: the regime the engine is
# for) generates (once) the key-word task with prompts of LONG_WORDS words (default 2000-4000, about 2-4k tokens) in
# ASSETS_DIR_LONG (default ~/.cache/augtree-verl/cpu_loop_long) and runs on it; PROMPTS=short runs run_cpu.sh's own
# task (ASSETS_DIR, prompts of a few hundred tokens). Other environment: as examples/run_cpu.sh.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="$(mkdir -p "${OUT_DIR:-compare_engines}" && cd "${OUT_DIR:-compare_engines}" && pwd)"
PYTHON="${PYTHON:-python}"
export STEPS="${STEPS:-5}"
[[ -z "${WANDB_API_KEY:-}" ]] && export WANDB_MODE="${WANDB_MODE:-offline}"
export WANDB_DIR="${WANDB_DIR:-$OUT_DIR}"

TASK_ARGS=()
case "${PROMPTS:-long}" in
    short) ;;
    long)
        LONG_WORDS="${LONG_WORDS:-2000-4000}"
        MIN_WORDS="${LONG_WORDS%-*}" MAX_WORDS="${LONG_WORDS#*-}"
        export ASSETS_DIR="${ASSETS_DIR_LONG:-$HOME/.cache/augtree-verl/cpu_loop_long}/$LONG_WORDS"
        # a prompt is its words, the key words and a few chat tokens; 16-token responses (run_cpu.sh)
        MAX_PROMPT=$((MAX_WORDS + 64))
        [[ -f "$ASSETS_DIR/data/test.parquet" ]] || "$PYTHON" -m augtree_verl.cpu_loop.task --out "$ASSETS_DIR" \
            --min-words "$MIN_WORDS" --max-words "$MAX_WORDS" --max-positions $((MAX_PROMPT + 64))
        TASK_ARGS=(data.max_prompt_length="$MAX_PROMPT") ;;
    *) echo "PROMPTS must be long or short, got '$PROMPTS'" >&2; exit 2 ;;
esac

for STRATEGY in fsdp2 augtree; do
    rm -f "$OUT_DIR/$STRATEGY.jsonl"
    # The wandb settings reach wandb.init in verl's task runner through the Ray runtime environment.
    WANDB_ENV=(+ray_kwargs.ray_init.runtime_env.env_vars.WANDB_RUN_GROUP="$STRATEGY"
               +ray_kwargs.ray_init.runtime_env.env_vars.WANDB_DIR="$WANDB_DIR")
    [[ -n "${WANDB_MODE:-}" ]] && WANDB_ENV+=(+ray_kwargs.ray_init.runtime_env.env_vars.WANDB_MODE="$WANDB_MODE")
    STRATEGY="$STRATEGY" VERL_FILE_LOGGER_PATH="$OUT_DIR/$STRATEGY.jsonl" LOGGER="[console,file,wandb]" \
        bash "$REPO/examples/run_cpu.sh" "${WANDB_ENV[@]}" "${TASK_ARGS[@]}" "$@"
done
"$PYTHON" -m augtree_verl.cpu_loop.compare --out "$OUT_DIR/compare.png" \
    fsdp2="$OUT_DIR/fsdp2.jsonl" augtree="$OUT_DIR/augtree.jsonl"
