"""BranchingAgentLoop: verl's ToolAgentLoop with the key-word task's environment and branching, on the CPU
loop's word-level tokenizer, against a stand-in server that samples random words (counting its requests)."""

import asyncio
import random
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

from augtree_verl.cpu_loop.task import WORDS, build_tokenizer
from augtree_verl.rollout.agent_loop import Leaves
from augtree_verl.rollout.branching import Branching, BranchingAgentLoop

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = build_tokenizer()
KEYS = "ba be bi bo bu da de di"
ROW = {
    "raw_prompt": [{"role": "system", "content": "ka ke ki " * 20}, {"role": "user", "content": "key ba answer"}],
    "reward_model": {"ground_truth": KEYS},
}
TURN_TOKENS = 4


class WordServer:
    """Answers each request with ``max_tokens`` random words (a new draw per request)."""

    def __init__(self):
        self.requests = 0

    async def generate(self, *, prompt_ids, sampling_params, **kwargs):
        rng = random.Random(self.requests)
        self.requests += 1
        ids = TOKENIZER.convert_tokens_to_ids(rng.choices(WORDS, k=sampling_params["max_tokens"]))
        return TokenOutput(token_ids=ids, log_probs=None, extra_fields={})


async def stop_after_first_turn(messages, row):
    """An environment that ends every trajectory at its first reply (async, as one calling a service would be)."""
    return None


def make_loop(server, n=4, turns=3, recipe="grpo_augtree", **knobs):
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
        config = compose(
            config_name=recipe,
            overrides=[
                "actor_rollout_ref.model.path=unused",
                f"actor_rollout_ref.rollout.n={n}",
                f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={turns}",
                "actor_rollout_ref.rollout.prompt_length=256",
                "actor_rollout_ref.rollout.response_length=128",
            ],
        )
    knobs = {
        "branches": 2,
        "branch_turns": [1, 2],
        "max_tokens_per_turn": TURN_TOKENS,
        "environment": "augtree_verl.cpu_loop.environment.keyword_feedback",
        **knobs,
    }
    return BranchingAgentLoop(
        DictConfigWrap(config),
        server,
        TOKENIZER,
        None,
        RLHFDataset,
        DictConfigWrap(config.data),
        hf_model_type="llama",
        tools=ToolListWrap([]),
        **knobs,
    )


def run(server, sessions=(0,), **loop_args) -> list[Leaves]:
    """The outputs of ``sessions`` of one prompt (verl builds the loop inside the worker's event loop)."""

    async def sessions_run():
        loop = make_loop(server, **loop_args)
        return [await loop.run({"temperature": 1.0}, session_id=session, **ROW) for session in sessions]

    return asyncio.run(sessions_run())


def test_a_tree_is_multi_turn_and_its_leaves_share_turns_until_they_branch():
    server = WordServer()
    (leaves,) = run(server)
    assert isinstance(leaves, Leaves) and len(leaves) == 4
    assert server.requests == 1 + 2 + 4  # turn 1 once, turn 2 per branch, turn 3 per leaf
    assert len({tuple(leaf.prompt_ids) for leaf in leaves}) == 1
    for leaf in leaves:
        mask = leaf.response_mask
        assert len(mask) == len(leaf.response_ids) and sum(mask) == 3 * TURN_TOKENS
        assert mask[:TURN_TOKENS] == [1] * TURN_TOKENS and 0 in mask[TURN_TOKENS:]
        assert leaf.num_turns == 1 + 3 + 2  # prompt, 3 assistant turns, 2 environment replies
        replies = TOKENIZER.decode([t for t, m in zip(leaf.response_ids, mask) if not m]).split()
        assert set(replies) <= {"key", "text", "user", "assistant", "<|im_start|>", "<|im_end|>"}

    def shared(a, b):
        return next(i for i, (x, y) in enumerate(zip(a.response_ids, b.response_ids)) if x != y)

    turn_two = leaves[0].response_mask.index(1, TURN_TOKENS + 1)  # where the 2nd assistant turn starts
    turn_three = [i for i, m in enumerate(leaves[0].response_mask) if m][2 * TURN_TOKENS]
    assert shared(leaves[0], leaves[2]) == turn_two  # first choice differs: from turn 2 on
    assert shared(leaves[0], leaves[1]) == turn_three  # second choice differs: from turn 3 on
    assert shared(leaves[2], leaves[3]) == turn_three


def test_sessions_between_trees_return_no_samples():
    assert [len(leaves) for leaves in run(WordServer(), range(8), n=8)] == [4, 0, 0, 0, 4, 0, 0, 0]


def test_leaves_that_would_repeat_a_sibling_are_dropped():
    server = WordServer()
    (leaves,) = run(server, environment="tests.rollout.test_branching.stop_after_first_turn")
    assert len(leaves) == 1 and server.requests == 1 and leaves[0].response_mask == [1] * TURN_TOKENS
    assert [len(leaves) for leaves in run(WordServer(), n=2, turns=2, branch_turns=[1])] == [2]


def test_branching_knobs_are_validated():
    assert Branching(3, (1, 4)).paths()[:4] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert Branching(2, ()).leaves == 1
    with pytest.raises(ValueError, match="branches must be at least 1, got 0"):
        Branching(0, (1,))
    with pytest.raises(ValueError, match=r"increasing turns >= 1, got \[2, 1\]"):
        Branching(2, (2, 1))
    with pytest.raises(ValueError, match="rollout.n=6 must be a multiple of the 4 leaves"):
        run(WordServer(), n=6)
    with pytest.raises(ValueError, match=r"branch_turns \[1, 3\] must be below multi_turn.max_assistant_turns=3"):
        run(WordServer(), branch_turns=[1, 3])
    with pytest.raises(ValueError, match="max_tokens_per_turn must be at least 1, got 0"):
        run(WordServer(), max_tokens_per_turn=0)
    with pytest.raises(ValueError, match="needs rollout.agent.agent_loop_manager_class=.*got None"):
        run(WordServer(), recipe="grpo_fsdp2")  # verl's own worker would merge the leaves
