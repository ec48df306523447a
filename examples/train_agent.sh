#!/usr/bin/env bash
# Multi-turn agent RL on CPU: verl's main_ppo with the branching agent loop (augtree_branching_agent), on verl's
# stock fsdp2 engine and on AugTree, no GPU, no download.
#
#   bash examples/train_agent.sh                          # both engines, 2 steps each; OUT_DIR=./train_agent
#   ENGINES=augtree STEPS=5 bash examples/train_agent.sh  # our engine only
#   BRANCHES=4 BRANCH_TURNS=[1] N=8 bash examples/train_agent.sh
#
# Every row of the generated task starts with the same system prompt (SYSTEM_WORDS words), then a short key-word
# question. Each trajectory has TURNS assistant turns of at most TURN_TOKENS tokens; after each turn the task's tool
# answers if the turn called it (examples/keyword_tools.yaml, multi_turn.format=augtree_words: "call <word>" asks
# check(word), which answers key or text; augtree_verl.cpu_loop.tools), else the task's environment
# (augtree_verl.cpu_loop.environment.keyword_feedback) replies as the user, and after the turns in
# BRANCH_TURNS the trajectory continues BRANCHES ways. A prompt's N samples are N / BRANCHES^len(BRANCH_TURNS) such
# trees, so each worker's share of the batch is one deep trie: the system prompt, each prompt, each tree's shared
# turns. The agent-loop file is written to OUT_DIR/agent_loops.yaml; each engine's metrics to
# OUT_DIR/<engine>.jsonl; then the step times (python -m augtree_verl.cpu_loop.compare, OUT_DIR/compare.png when
# both engines ran) and the sharing the engine found per step (trees, trie nodes, executed against logical tokens)
# are printed. Both engines run our agent-loop manager, whose workers store each leaf as a sample of its own (the
# stock engine's recipe does not set it; without the AugTree engine it feeds no planner).
#
# Environment: ENGINES (default "fsdp2 augtree"), STEPS (2), BATCH prompts per step (4: two per worker, so each
# worker's share of the batch has the system prompt in common), N samples per prompt (8), BRANCHES (2),
# BRANCH_TURNS ([1,2]), TURNS (3), TURN_TOKENS (32), SYSTEM_WORDS (512), ASSETS_DIR_AGENT (default
# ~/.cache/augtree-verl/cpu_loop_agent), OUT_DIR; the rest as examples/run_cpu.sh (NPROC, PYTHON, ...).
# Further arguments are hydra overrides.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="$(mkdir -p "${OUT_DIR:-train_agent}" && cd "${OUT_DIR:-train_agent}" && pwd)"
PYTHON="${PYTHON:-python}"
ENGINES="${ENGINES:-fsdp2 augtree}"
BATCH="${BATCH:-4}" N="${N:-8}" BRANCHES="${BRANCHES:-2}" BRANCH_TURNS="${BRANCH_TURNS:-[1,2]}"
TURNS="${TURNS:-3}" TURN_TOKENS="${TURN_TOKENS:-32}" SYSTEM_WORDS="${SYSTEM_WORDS:-512}"
export ASSETS_DIR="${ASSETS_DIR_AGENT:-$HOME/.cache/augtree-verl/cpu_loop_agent}/tool-system-$SYSTEM_WORDS"
[[ -f "$ASSETS_DIR/data/test.parquet" ]] || "$PYTHON" -m augtree_verl.cpu_loop.task --out "$ASSETS_DIR" \
    --system-words "$SYSTEM_WORDS" --min-words 16 --max-words 48 --max-positions $((SYSTEM_WORDS + 1536))

cat > "$OUT_DIR/agent_loops.yaml" <<EOF
- name: augtree_branching_agent
  _target_: augtree_verl.rollout.branching.BranchingAgentLoop
  branches: $BRANCHES
  branch_turns: $BRANCH_TURNS
  max_tokens_per_turn: $TURN_TOKENS
  environment: augtree_verl.cpu_loop.environment.keyword_feedback
EOF
# each turn: the model's tokens, then the reply (the environment's, a word per word, is the longest) and its chat tokens
RESPONSE=$((TURNS * (2 * TURN_TOKENS + 8)))
RUNS=()
for STRATEGY in $ENGINES; do
    rm -f "$OUT_DIR/$STRATEGY.jsonl"
    STRATEGY="$STRATEGY" VERL_FILE_LOGGER_PATH="$OUT_DIR/$STRATEGY.jsonl" bash "$REPO/examples/run_cpu.sh" \
        actor_rollout_ref.rollout.agent.agent_loop_config_path="$OUT_DIR/agent_loops.yaml" \
        actor_rollout_ref.rollout.agent.default_agent_loop=augtree_branching_agent \
        ++actor_rollout_ref.rollout.agent.agent_loop_manager_class=augtree_verl.rollout.agent_loop.PlannerFeedAgentLoopManager \
        actor_rollout_ref.rollout.multi_turn.max_assistant_turns="$TURNS" \
        actor_rollout_ref.rollout.multi_turn.tool_config_path="$REPO/examples/keyword_tools.yaml" \
        actor_rollout_ref.rollout.multi_turn.format=augtree_words \
        actor_rollout_ref.rollout.n="$N" data.train_batch_size="$BATCH" \
        actor_rollout_ref.actor.ppo_mini_batch_size="$BATCH" \
        data.max_prompt_length=$((SYSTEM_WORDS + 128)) data.max_response_length="$RESPONSE" "$@"
    RUNS+=("$STRATEGY=$OUT_DIR/$STRATEGY.jsonl")
done
"$PYTHON" -m augtree_verl.cpu_loop.compare --out "$OUT_DIR/compare.png" "${RUNS[@]}" \
    --show actor/augtree/trees actor/augtree/trie/nodes actor/augtree/executed_tokens actor/augtree/logical_tokens \
    actor/grad_norm response_length/mean
