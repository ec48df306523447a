"""A multi-turn agent loop that branches at turn boundaries: verl's ``ToolAgentLoop`` plus an environment and
k continuations per branch point, so one prompt's samples form a deep tree of shared turns.

It is configured in an agent-loop file (``actor_rollout_ref.rollout.agent.agent_loop_config_path``) and
selected by the name given there, per dataset row (``agent_name``) or for all rows
(``actor_rollout_ref.rollout.agent.default_agent_loop``)::

    - name: augtree_branching_agent
      _target_: augtree_verl.rollout.branching.BranchingAgentLoop
      branches: 2                 # continuations at each branch point
      branch_turns: [1, 2]        # branch after the 1st and the 2nd assistant turn's reply
      max_tokens_per_turn: 32     # one assistant turn's new tokens (None: up to the response budget)
      environment: augtree_verl.cpu_loop.environment.keyword_feedback

Turns are verl's: the model generates, tool calls go through verl's tools
(``rollout.multi_turn.tool_config_path``, calls parsed by the ``ToolParser`` named in ``multi_turn.format``; the
CPU task's tool and parser: ``cpu_loop.tools``), and when a turn makes no tool call the ``environment`` (a
function ``(messages, row) -> str | None``, sync or async; ``row`` is the dataset row's fields) answers as
the user, until it returns None or verl's limits end the trajectory (``multi_turn.max_assistant_turns``,
``max_user_turns``, the response budget). Tool and environment tokens carry ``response_mask`` 0, the
model's 1, as in verl. (verl 0.9.1 has no ``Interaction``; the environment takes its place.)

Branching: a prompt's ``rollout.n`` samples are n / L trees of L = branches ** len(branch_turns) leaves.
Sessions ``s`` with ``s % L == 0`` run a tree, the others return no output. Each leaf runs verl's state
machine on its own; its t-th generation is shared (one request, awaited by all) with every leaf that made
the same choices at the branch points before turn t and sends the same prompt ids, so the leaves of a tree
hold token-equal prefixes up to where they branch. A leaf that ended before a branch point where it chose
another continuation than the first duplicates its sibling and is dropped. The leaves go back as
``Leaves``: ``PlannerFeedWorker`` stores leaf j of session s as sample ``{uid}_{s + j}_0``, each scored and
grouped by uid as its own GRPO sample (verl's own worker would take a list as one step-wise trajectory).
Tools and the environment run once per leaf (they must be deterministic for the leaves to share turns).
Validation runs ``val_kwargs.n`` sessions the same way: whole trees, so a prompt gets L samples per tree (only
``rollout.n`` is checked to be a multiple of L).

Not registered with verl's ``register`` decorator: it writes ``{"_target_": class}`` under its name when
this module is imported, which in a worker happens at the first instantiation, after verl has read the
agent-loop file; an entry of the same name there would lose its knobs for every later trajectory.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import itertools
from dataclasses import dataclass

from hydra.utils import get_class, get_method
from verl.experimental.agent_loop.tool_agent_loop import AgentState, ToolAgentLoop

from augtree_verl.integration import verl_compat
from augtree_verl.rollout.agent_loop import Leaves, PlannerFeedAgentLoopManager


@dataclass(frozen=True)
class Branching:
    """Where a trajectory branches: ``branches`` continuations after each assistant turn in ``turns``
    (1-based, increasing: turn t's boundary is after the t-th assistant turn and its reply)."""

    branches: int
    turns: tuple[int, ...]

    def __post_init__(self):
        if self.branches < 1:
            raise ValueError(f"branches must be at least 1, got {self.branches}")
        if any(t < 1 for t in self.turns) or list(self.turns) != sorted(set(self.turns)):
            raise ValueError(f"branch_turns must be increasing turns >= 1, got {list(self.turns)}")

    @property
    def leaves(self) -> int:
        """Leaves of one tree: branches ** len(turns)."""
        return self.branches ** len(self.turns)

    def paths(self) -> list[tuple[int, ...]]:
        """Each leaf's choice at each branch point, in leaf order."""
        return list(itertools.product(range(self.branches), repeat=len(self.turns)))

    def key(self, path: tuple[int, ...], turn: int) -> tuple[int, ...]:
        """The choices that decide the generation of 0-based assistant turn ``turn`` of the leaf ``path``."""
        return tuple(c for c, t in zip(path, self.turns) if t <= turn)

    def distinct(self, path: tuple[int, ...], turns_made: int) -> bool:
        """False if the leaf, which made ``turns_made`` assistant turns, duplicates a sibling: it chose a
        continuation other than the first at a branch point it never reached."""
        return all(c == 0 for c, t in zip(path, self.turns) if t >= turns_made)


class BranchClient:
    """The server client one leaf sees: its generations shared with the leaves that chose alike (see
    ``Branching.key``) and send the same prompt ids; ``turns`` counts its generate calls."""

    def __init__(self, client, branching: Branching, path: tuple[int, ...], shared: dict):
        self.client, self.branching, self.path, self.shared = client, branching, path, shared
        self.turns = 0

    async def generate(self, *, prompt_ids: list[int], **kwargs):
        key = (self.branching.key(self.path, self.turns), tuple(prompt_ids))
        self.turns += 1
        if key not in self.shared:
            self.shared[key] = asyncio.ensure_future(self.client.generate(prompt_ids=prompt_ids, **kwargs))
        return await self.shared[key]

    def __getattr__(self, name):
        return getattr(self.client, name)


class BranchingAgentLoop(ToolAgentLoop):
    """verl's ``ToolAgentLoop`` with an environment and branching (see the module docstring)."""

    def __init__(
        self,
        *args,
        branches: int = 2,
        branch_turns=(1,),
        max_tokens_per_turn: int | None = None,
        environment: str | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.branching = Branching(int(branches), tuple(int(t) for t in branch_turns))
        if self.max_assistant_turns and self.branching.turns and self.branching.turns[-1] >= self.max_assistant_turns:
            raise ValueError(
                f"branch_turns {list(self.branching.turns)} must be below "
                f"multi_turn.max_assistant_turns={self.max_assistant_turns}"
            )
        n = self.rollout_config.n
        if n % self.branching.leaves:
            raise ValueError(
                f"rollout.n={n} must be a multiple of the {self.branching.leaves} leaves of a tree "
                f"(branches={branches}, branch_turns={list(branch_turns)})"
            )
        if max_tokens_per_turn is not None and max_tokens_per_turn < 1:
            raise ValueError(f"max_tokens_per_turn must be at least 1, got {max_tokens_per_turn}")
        self.max_tokens_per_turn = max_tokens_per_turn
        self.environment = get_method(environment) if environment else None
        manager = self.rollout_config.agent.get("agent_loop_manager_class")
        if not manager or not issubclass(get_class(manager), PlannerFeedAgentLoopManager):
            raise ValueError(
                f"BranchingAgentLoop needs rollout.agent.agent_loop_manager_class="
                f"augtree_verl.rollout.agent_loop.PlannerFeedAgentLoopManager (its worker stores each "
                f"leaf as a sample), got {manager}"
            )
        self.row: dict = {}

    async def run(self, sampling_params: dict, **kwargs) -> Leaves:
        """The leaves of session ``kwargs["session_id"]``'s tree (none unless it is a multiple of the leaves)."""
        if int(kwargs["session_id"]) % self.branching.leaves:
            return Leaves()
        if self.max_tokens_per_turn is not None:
            sampling_params = {**sampling_params, "max_tokens": self.max_tokens_per_turn}
        shared: dict = {}

        async def leaf(path):
            loop = copy.copy(self)
            loop.server_manager = BranchClient(self.server_manager, self.branching, path, shared)
            loop.row = kwargs
            output = await ToolAgentLoop.run(loop, sampling_params, **kwargs)
            return output if self.branching.distinct(path, loop.server_manager.turns) else None

        outputs = await asyncio.gather(*(leaf(path) for path in self.branching.paths()))
        return Leaves(output for output in outputs if output is not None)

    async def _handle_generating_state(self, agent_data, sampling_params, ignore_termination: bool = False):
        """verl's turn; where it ends the trajectory after a turn without tool calls (the assistant message
        was appended: no limit was hit), the environment replies instead."""
        state = await super()._handle_generating_state(agent_data, sampling_params, ignore_termination)
        replies = self.environment is not None and agent_data.messages[-1]["role"] == "assistant"
        if state is not AgentState.TERMINATED or not replies:
            return state
        reply = self.environment(agent_data.messages, self.row)
        reply = await reply if inspect.isawaitable(reply) else reply
        if reply is None:
            return state
        previous = list(agent_data.messages)
        agent_data.messages.append({"role": "user", "content": reply})
        merged, mask, logprobs = await self.ct_merge_context_msg(
            previous,
            agent_data.messages,
            agent_data.prompt_ids,
            agent_data.response_mask,
            agent_data.response_logprobs or None,
            tools=verl_compat.active_tool_schemas(agent_data),
        )
        if len(mask) >= self.response_length:
            return AgentState.TERMINATED
        agent_data.prompt_ids, agent_data.response_mask = merged.token_ids, mask
        if agent_data.response_logprobs:
            agent_data.response_logprobs = logprobs or []
        agent_data.user_turns += 1
        return AgentState.GENERATING
