"""An agent loop that answers without an LLM: response lengths given per session in the prompt's fields.

``test_prompt_len``: the prompt's length; ``test_response_lens[session]``: the length of that session's
response (0 makes the session raise, i.e. a failed sample); ``test_outputs``: outputs per session (2 gives a
multi-output loop whose second output has a longer prompt, as a multi-turn loop would); ``test_leaves``: L > 0
makes it a branching loop (``Leaves``): sessions s % L == 0 return L leaves, leaf j one token longer than leaf
j - 1, the others none.
"""

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput

from augtree_verl.rollout.agent_loop import Leaves


class FixedAgentLoop(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        prompt_len, session = int(kwargs["test_prompt_len"]), int(kwargs["session_id"])
        response_len = int(list(kwargs["test_response_lens"])[session])
        if response_len == 0:
            raise RuntimeError(f"session {session} failed")
        leaves = int(kwargs.get("test_leaves", 0))
        if leaves:
            return Leaves(
                AgentLoopOutput(
                    prompt_ids=[1] * prompt_len,
                    response_ids=[2] * (response_len + j),
                    response_mask=[1] * (response_len + j),
                    metrics=AgentLoopMetrics(),
                )
                for j in range(leaves if session % leaves == 0 else 0)
            )
        outputs = [
            AgentLoopOutput(
                prompt_ids=[1] * (prompt_len + 5 * k),
                response_ids=[2] * response_len,
                response_mask=[1] * response_len,
                metrics=AgentLoopMetrics(),
            )
            for k in range(int(kwargs.get("test_outputs", 1)))
        ]
        return outputs if len(outputs) > 1 else outputs[0]
