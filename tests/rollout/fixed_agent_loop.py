"""An agent loop that answers without an LLM: response lengths given per session in the prompt's fields.

``test_prompt_len``: the prompt's length; ``test_response_lens[session]``: the length of that session's
response (0 makes the session raise, i.e. a failed sample); ``test_outputs``: outputs per session (2 gives a
multi-output loop whose second output has a longer prompt, as a multi-turn loop would).
"""

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput


class FixedAgentLoop(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        prompt_len, session = int(kwargs["test_prompt_len"]), int(kwargs["session_id"])
        response_len = int(list(kwargs["test_response_lens"])[session])
        if response_len == 0:
            raise RuntimeError(f"session {session} failed")
        outputs = [AgentLoopOutput(prompt_ids=[1] * (prompt_len + 5 * k), response_ids=[2] * response_len,
                                   response_mask=[1] * response_len, metrics=AgentLoopMetrics())
                   for k in range(int(kwargs.get("test_outputs", 1)))]
        return outputs if len(outputs) > 1 else outputs[0]
