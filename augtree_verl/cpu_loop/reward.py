"""The rule reward of the generated key-word task, for ``reward.custom_reward_function``.

``reward.custom_reward_function.path=pkg://augtree_verl.cpu_loop.reward`` (name ``compute_score``): samples
of the key-word task score the fraction of their words that are key words, so a random model's samples
score differently and GRPO advantages are not all zero; every other data source goes to verl's built-in
``default_compute_score``, so any verl-format data set keeps its usual reward.
"""

from __future__ import annotations

from verl.utils.reward_score import default_compute_score

DATA_SOURCE = "augtree_cpu_keywords"


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Key-word task: |response words that are key words| / |response words| (0 for an empty response)."""
    if data_source != DATA_SOURCE:
        return default_compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
    keys = set(ground_truth.split())
    words = solution_str.split()
    return sum(word in keys for word in words) / len(words) if words else 0.0
