"""The key-word task's environment for the branching agent loop (``rollout.branching``): after every
assistant turn it answers, as the user, with one word per word of that turn: ``key`` for a key word of the
row (``reward_model.ground_truth``), ``text`` for any other. Deterministic, so the leaves of a tree share
their turns token for token; the trajectory ends at ``multi_turn.max_assistant_turns``.
"""

from __future__ import annotations


def keyword_feedback(messages: list[dict], row: dict) -> str:
    """The reply to the last (assistant) message of ``messages``; ``row``: the dataset row's fields."""
    keys = set(row["reward_model"]["ground_truth"].split())
    words = messages[-1]["content"].split()
    return " ".join("key" if word in keys else "text" for word in words) or "text"
