"""Multi-turn agent RL through verl's main_ppo on CPU: ``examples/train_agent.sh`` runs the branching agent loop
(verl's ToolAgentLoop, the key-word task's tool and environment, 2 continuations after turns 1 and 2 of 3) for
one step on verl's stock fsdp2 engine and on ours, one worker process each, 2 prompts x 4 samples (one tree of 4
leaves per prompt) behind one 256-word system prompt; the steps are read from verl's file logger, the samples from
verl's rollout dump (``trainer.rollout_data_dir``: each sample's decoded response under its key
``{uid}_{session}_0``).
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict

import pytest

from tests.e2e.runs import AGENT_SIZES, read_steps
from tests.e2e.test_cpu_loop import ROLLOUT_PROB_ATOL, assert_same_step_one

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BATCH, N, TURNS, TURN_TOKENS = (AGENT_SIZES[key] for key in ("BATCH", "N", "TURNS", "TURN_TOKENS"))
LEAVES = 4  # 2 branches after turn 1 and after turn 2
# a turn's first call of a task word, the rest of the turn, and the tool's answer before the next turn
TOOL_ANSWER = re.compile(
    r"\bcall (?P<word>[a-z]{2})(?: (?!assistant|user|tool)\S+)* tool (?P<answer>key|text) assistant"
)


@pytest.fixture(scope="module")
def step_one(agent_runs) -> dict[str, dict]:
    return {engine: read_steps(agent_runs / f"{engine}.jsonl")[0] for engine in ("fsdp2", "augtree")}


def test_each_prompt_is_a_tree_of_multi_turn_leaves(agent_runs, step_one):
    samples = [json.loads(line) for line in (agent_runs / "rollouts/augtree/1.jsonl").read_text().splitlines()]
    leaves = defaultdict(dict)
    for sample in samples:
        uid, session, index = sample["uid"].rsplit("_", 2)
        leaves[uid][int(session)] = sample["output"].split()
    assert len(leaves) == BATCH and all(sorted(tree) == list(range(N)) for tree in leaves.values())
    for metrics in step_one.values():  # every sample: 3 assistant turns, 2 environment replies, the prompt
        assert metrics["num_turns/min"] == metrics["num_turns/max"] == 2 * TURNS
    for tree in leaves.values():

        def shared(a, b):
            return len(os.path.commonprefix([tree[a], tree[b]]))

        # leaves 0 and 2 branch after turn 1, leaves 0 and 1 after turn 2: each shares its turns up to there
        assert TURN_TOKENS // 2 < shared(0, 2) < shared(0, 1) < len(tree[0])
        assert shared(0, 2) == shared(0, 3) == shared(1, 2) and shared(2, 3) > shared(0, 2)
        assert tree[0].count("user") + tree[0].count("tool") >= TURNS - 1  # the replies are in the response


def test_the_tool_answers_the_calls_and_both_engines_sampled_the_same(agent_runs):
    """The random model's turns hold some ``call <word>``; with these seeds a call of a task word is made in a turn
    that has a next one, and the tool's answer follows the turn (``tool key`` for a key word of the row, ``tool
    text`` for another; the dump drops chat tokens). The match starts at the turn's first call, the one verl runs."""
    outputs = {
        engine: [json.loads(line) for line in (agent_runs / f"rollouts/{engine}/1.jsonl").read_text().splitlines()]
        for engine in ("fsdp2", "augtree")
    }
    assert sorted(s["output"] for s in outputs["fsdp2"]) == sorted(s["output"] for s in outputs["augtree"])
    answers = [
        (match["answer"], "key" if match["word"] in sample["gts"].split() else "text")
        for sample in outputs["augtree"]
        for match in TOOL_ANSWER.finditer(sample["output"])
    ]
    assert answers and all(answer == right for answer, right in answers)


def test_our_engine_replays_the_batch_as_one_deep_trie(step_one):
    """More node prefills than trees (the system prompt and each tree's shared turn are nodes of their own), and
    fewer tokens executed than a depth-1 replay (each prompt once, every response in full) would run. The
    rollout workers' reports (leaves in session order) matched the trainer's samples: every plan came from them."""
    ours = step_one["augtree"]
    assert ours["augtree/planner/plans_from_rollout"] == BATCH and ours["augtree/planner/mismatched"] == 0
    assert ours["actor/augtree/trees"] == BATCH and ours["actor/augtree/trie/nodes"] > BATCH + 1
    depth_one = BATCH * ours["prompt_length/mean"] + BATCH * N * ours["response_length/mean"]
    assert ours["actor/augtree/executed_tokens"] < 0.8 * depth_one
    assert ours["actor/augtree/logical_tokens"] > 2.5 * ours["actor/augtree/executed_tokens"]


def test_step_one_is_the_same_update_with_both_engines(step_one):
    assert_same_step_one(step_one["augtree"], step_one["fsdp2"])
    for metrics in step_one.values():
        assert metrics["training/rollout_probs_diff_max"] <= ROLLOUT_PROB_ATOL
        assert metrics["critic/score/max"] > metrics["critic/score/min"] and metrics["actor/grad_norm"] > 0
