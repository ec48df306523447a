"""BranchingAgentLoop: verl's ToolAgentLoop with the key-word task's environment, its tool (loaded by verl from
examples/keyword_tools.yaml, calls parsed by the registered ``augtree_words`` parser) and branching, on the CPU
loop's word-level tokenizer, against a stand-in server that samples random words (keeping its requests)."""

import asyncio
import random
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
from verl.tools.tool_registry import initialize_tools_from_config
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

from augtree_verl.cpu_loop.task import TOOL, WORDS, build_tokenizer
from augtree_verl.cpu_loop.tools import FORMAT, KeyCheckTool
from augtree_verl.rollout.agent_loop import Leaves
from augtree_verl.rollout.branching import Branching, BranchingAgentLoop

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = build_tokenizer()
KEYS = "ba be bi bo bu da de di"
ROW = {
    "raw_prompt": [{"role": "system", "content": "ka ke ki " * 20}, {"role": "user", "content": "key ba answer"}],
    "reward_model": {"ground_truth": KEYS},
    "tools_kwargs": {TOOL: {"create_kwargs": {"keys": KEYS}}},  # RLHFDataset's, from extra_info as task_rows writes
}
TOOLS = initialize_tools_from_config(REPO / "examples/keyword_tools.yaml")  # as verl's worker loads them
TURN_TOKENS = 4


class WordServer:
    """Answers each request with ``max_tokens`` random words (a new draw per request), the first with the tokens
    ``first`` if given; keeps the prompts it got."""

    def __init__(self, first: str = ""):
        self.first = first.split()
        self.prompts: list[list[int]] = []

    @property
    def requests(self) -> int:
        return len(self.prompts)

    async def generate(self, *, prompt_ids, sampling_params, **kwargs):
        words = random.Random(self.requests).choices(WORDS, k=sampling_params["max_tokens"])
        self.prompts.append(list(prompt_ids))
        ids = TOKENIZER.convert_tokens_to_ids(self.first if self.first and self.requests == 1 else words)
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
                f"actor_rollout_ref.rollout.multi_turn.format={FORMAT}",
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
        tools=ToolListWrap(TOOLS),
        **knobs,
    )


def run(server, sessions=(0,), **loop_args) -> list[Leaves]:
    """The outputs of ``sessions`` of one prompt (verl builds the loop inside the worker's event loop)."""

    async def sessions_run():
        loop = make_loop(server, **loop_args)
        return [await loop.run({"temperature": 1.0}, session_id=session, **ROW) for session in sessions]

    return asyncio.run(sessions_run())


def shared(a, b) -> int:
    """How many response tokens two leaves share."""
    return next(i for i, (x, y) in enumerate(zip(a.response_ids, b.response_ids)) if x != y)


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

    turn_two = leaves[0].response_mask.index(1, TURN_TOKENS + 1)  # where the 2nd assistant turn starts
    turn_three = [i for i, m in enumerate(leaves[0].response_mask) if m][2 * TURN_TOKENS]
    assert shared(leaves[0], leaves[2]) == turn_two  # first choice differs: from turn 2 on
    assert shared(leaves[0], leaves[1]) == turn_three  # second choice differs: from turn 3 on
    assert shared(leaves[2], leaves[3]) == turn_three


@pytest.fixture
def tool_runs(monkeypatch) -> list[str]:
    """The words the task's tool is run with, in order (it still runs)."""
    words, execute = [], KeyCheckTool.execute

    async def counted(self, instance_id, parameters, **kwargs):
        words.append(parameters["word"])
        return await execute(self, instance_id, parameters, **kwargs)

    monkeypatch.setattr(KeyCheckTool, "execute", counted)
    return words


def first_reply(leaf) -> str:
    """The tokens after the leaf's first assistant turn, up to its second, decoded."""
    start = leaf.response_mask.index(0)
    return TOKENIZER.decode(leaf.response_ids[start : leaf.response_mask.index(1, start)])


@pytest.mark.parametrize("word, answer", [("ba", "key"), ("zu", "text")])  # a key, another word
def test_a_tool_call_runs_the_tool_once_per_leaf_and_the_next_turn_sees_its_answer(tool_runs, word, answer):
    server = WordServer(first=f"da call {word} ko")
    (leaves,) = run(server)
    assert tool_runs == [word] * 4 and server.requests == 1 + 2 + 4  # the leaves' tool turns are token-equal
    tool_turn = f"<|im_start|> tool {answer} <|im_end|> <|im_start|> assistant"
    reply = TOKENIZER.encode(tool_turn)
    assert server.prompts[1][-len(reply) :] == reply  # turn 2 is generated after the tool's answer
    for leaf in leaves:
        assert leaf.response_mask[: TURN_TOKENS + len(reply)] == [1] * TURN_TOKENS + [0] * len(reply)
        assert leaf.response_ids[TURN_TOKENS : TURN_TOKENS + len(reply)] == reply and first_reply(leaf) == tool_turn
        assert leaf.num_turns == 1 + 3 + 2  # the tool's turn counts as a reply, as verl counts it
    assert shared(leaves[0], leaves[2]) == TURN_TOKENS + len(reply)  # they branch after the tool's turn


def test_a_refused_word_gets_verls_error_reply_and_the_trajectory_goes_on(tool_runs):
    """The tool raises for a word outside the task's; verl's _call_tool catches it and answers its error text."""
    server = WordServer(first="da call user ko")
    (leaves,) = run(server)
    assert tool_runs == ["user"] * 4 and server.requests == 7
    error = TOKENIZER.decode(TOKENIZER.encode("Error executing tool 'check': 'user' is not a word of the task"))
    assert {first_reply(leaf) for leaf in leaves} == {f"<|im_start|> tool {error} <|im_end|> <|im_start|> assistant"}
    assert all(leaf.num_turns == 6 for leaf in leaves)


@pytest.mark.parametrize("turn", ["ko ko ko call", "ko ko call <|im_end|>"])
def test_a_call_without_a_word_is_no_call_and_the_environment_replies(tool_runs, turn):
    (leaves,) = run(WordServer(first=turn))
    assert tool_runs == [] and first_reply(leaves[0]).startswith("<|im_start|> user text text text text <|im_end|>")


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
