"""An agent-loop manager whose workers report each finished group's lengths to the planner service.

Select it with ``+actor_rollout_ref.rollout.agent.agent_loop_manager_class=
augtree_verl.rollout.agent_loop.PlannerFeedAgentLoopManager`` (our recipes set it). It is verl's
TransferQueue manager (``AgentLoopManagerTQ``) with ``PlannerFeedWorker`` as its worker. verl's worker runs
a prompt's n sessions in ``_run_prompt``, each ending in ``_agent_loop_postprocess`` (the samples go into
the TransferQueue), waits for all of them, then marks the uid finished. ``PlannerFeedWorker`` records each
session's (prompt, response) lengths as it is post-processed; when the n-th session is in, it reports the
uid and its ``GroupLengths`` (responses in (session, index) order) to the planner actor, before the group is
marked finished, so the plan is usually ready before the trainer samples the group. Fire and forget
(``planner.feed``): a slow or dead planner never slows the rollout. Not reported: validation prompts, failed
groups (a session raised: verl marks the group failed), groups whose outputs have several prompt lengths
(multi-output agent loops: several trees) or a length no plan takes (an empty response; logged), and
everything without the planner service (the actor's engine is not AugTree's, or ``use_planner=false``).

A session whose agent loop returns ``Leaves`` (``rollout.branching``) stores leaf j as the sample of session
``session_id + j`` (key ``{uid}_{session_id + j}_0``), each scored on its own: verl takes a list of outputs
as one trajectory's steps (one reward, the last output's, and one GRPO sample per session).
"""

from __future__ import annotations

import asyncio
import logging

import ray
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ

from augtree_verl.groups import GroupLengths
from augtree_verl.integration import verl_compat
from augtree_verl.planner.feed import PlannerFeed
from augtree_verl.rollout.planner_config import planner_service_config

logger = logging.getLogger(__name__)


class OpenGroup:
    """The lengths of one group's sessions as they finish, until all ``n`` are in."""

    def __init__(self, n: int):
        self.n = n
        self.sessions: dict[int, list[tuple[int, int]]] = {}

    def add(self, session: int, lengths: list[tuple[int, int]]) -> bool:
        """Record a session's outputs' (prompt_len, response_len), in index order; True once all n are in."""
        self.sessions[int(session)] = list(lengths)
        return len(self.sessions) == self.n

    def report(self) -> GroupLengths | None:
        """The group's lengths, responses in (session, index) order; None unless one prompt length and
        lengths a plan takes (logged: a rollout worker must not see planner errors)."""
        lengths = [pr for s in sorted(self.sessions) for pr in self.sessions[s]]
        prompt_lens = {p for p, _ in lengths}
        if len(prompt_lens) != 1:
            return None
        try:
            return GroupLengths(prompt_lens.pop(), tuple(r for _, r in lengths))
        except ValueError as err:
            logger.warning("planner feed: not reporting a group: %s", err)
            return None


class Leaves(list):
    """A branching agent loop's outputs (``AgentLoopOutput``s): independent samples of one tree, leaf j of
    session s to be stored as session s + j."""


class PlannerFeedWorker(verl_compat.ray_actor_class(AgentLoopWorkerTQ)):  # type: ignore[misc]
    """verl's TransferQueue agent-loop worker, reporting each finished training group to the planner."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        engine_config = planner_service_config(config)
        self.planner_feed = PlannerFeed(engine_config.planner_name) if engine_config is not None else None
        self.open_groups: dict[str, OpenGroup] = {}

    async def _run_prompt(self, prompt: dict, sampling_params: dict, trajectory: dict, trace: bool = False) -> None:
        uid = prompt["uid"]
        if self.planner_feed is not None and not trajectory["validate"]:
            sessions = verl_compat.rollout_sessions(prompt, self.config.actor_rollout_ref.rollout.n)
            self.open_groups[uid] = OpenGroup(sessions)
        try:
            await super()._run_prompt(prompt, sampling_params, trajectory, trace)
        finally:
            self.open_groups.pop(uid, None)

    async def _agent_loop_postprocess(self, output, validate, **kwargs):
        if isinstance(output, Leaves):
            store = super()._agent_loop_postprocess
            session = int(kwargs["session_id"])
            result = await asyncio.gather(
                *(store(leaf, validate, **{**kwargs, "session_id": session + j}) for j, leaf in enumerate(output))
            )
        else:
            result = await super()._agent_loop_postprocess(output, validate, **kwargs)
        group = self.open_groups.get(kwargs["uid"])
        outputs = output if isinstance(output, list) else [output]
        if group is not None and group.add(
            kwargs["session_id"], [(len(o.prompt_ids), len(o.response_ids)) for o in outputs]
        ):
            lengths = group.report()
            if lengths is not None:
                self.planner_feed.report(kwargs["uid"], lengths)
        return result


class PlannerFeedAgentLoopManager(AgentLoopManagerTQ):
    """verl's ``AgentLoopManagerTQ`` running ``PlannerFeedWorker`` actors."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # sets verl's worker class; replace it before the workers start
        self.agent_loop_workers_class = ray.remote(PlannerFeedWorker)
