"""The key-word task's tool for verl's ``ToolAgentLoop`` (and so the branching agent loop), and the tool-call
syntax of its word-level tokenizer, which cannot write verl's JSON tool calls.

- ``KeyCheckTool``, the function ``check(word)``: ``key`` if ``word`` is one of the row's key words, ``text``
  if it is another word of the task (``WORDS``); any other word (a task or chat word) it refuses by raising,
  and verl's ``ToolAgentLoop._call_tool`` replies ``Error executing tool 'check': ...`` instead. The keys reach
  it through the row's ``extra_info.tools_kwargs`` (``task_rows`` writes ``{"check": {"create_kwargs":
  {"keys": ...}}}``), as verl passes them to ``create``.
- ``WordToolParser``, verl's ``multi_turn.format=augtree_words``: every ``call`` in a turn that is followed by
  a word other than a special token (``<|im_end|>``, ...) is a call of ``check`` with that word (``call call
  ba`` calls with ``call``, then ``ba``); a ``call`` that ends the turn is no call. verl runs the first
  ``multi_turn.max_parallel_calls`` of them. The turn's text stays its content, as Hermes' parser keeps a turn
  without calls.

Both are deterministic, so the leaves of a tree share their tool turns token for token. verl loads the tool
from ``multi_turn.tool_config_path`` (``examples/keyword_tools.yaml``); importing this module there registers
the parser before the agent loop asks for it.
"""

from __future__ import annotations

import json
from typing import Any

from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from augtree_verl.cpu_loop.task import CALL, TOOL, WORDS

FORMAT = "augtree_words"
SCHEMA = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": TOOL,
            "description": "Whether a word is one of the key words: answers key or text.",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string", "description": "a word of the task"}},
                "required": ["word"],
            },
        },
    }
)


class KeyCheckTool(BaseTool):
    """``check(word)`` against the row's key words (see the module docstring). verl loads one per worker and
    wraps each call in ``create``/``release``, so the keys are held per instance id."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema or SCHEMA)
        self.keys: dict[str, frozenset[str]] = {}

    async def create(self, instance_id: str | None = None, create_kwargs: dict | None = None, **kwargs):
        """A trajectory's instance, holding its row's keys (``create_kwargs["keys"]``, space-separated)."""
        keys = (create_kwargs or {}).get("keys")
        if keys is None:
            raise ValueError(f"{TOOL} needs the row's key words: extra_info.tools_kwargs.{TOOL}.create_kwargs.keys")
        instance_id, response = await super().create(instance_id)
        self.keys[instance_id] = frozenset(keys.split())
        return instance_id, response

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        """``key`` or ``text`` for a word of the task; raises for any other (verl replies with the error)."""
        word = parameters["word"]
        if word not in WORDS:
            raise ValueError(f"{word!r} is not a word of the task")
        return ToolResponse(text="key" if word in self.keys[instance_id] else "text"), 0.0, {}

    async def release(self, instance_id: str, **kwargs) -> None:
        del self.keys[instance_id]


@ToolParser.register(FORMAT)
class WordToolParser(ToolParser):
    """``call <word>`` as a call of ``check`` (see the module docstring)."""

    async def extract_tool_calls(self, responses_ids: list[int], tools=None) -> tuple[str, list[FunctionCall]]:
        text = self.tokenizer.decode(responses_ids)
        words, special = text.split(), set(self.tokenizer.all_special_tokens)
        calls = [
            FunctionCall(name=TOOL, arguments=json.dumps({"word": arg}))
            for word, arg in zip(words, words[1:])
            if word == CALL and arg not in special
        ]
        return text, calls
