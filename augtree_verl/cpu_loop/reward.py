"""The rule rewards of the generated tasks, for ``reward.custom_reward_function``.

``reward.custom_reward_function.path=pkg://augtree_verl.cpu_loop.reward`` (name ``compute_score``): samples
of the key-word task (``task``) score the fraction of their words that are key words, so a random model's samples
score differently and GRPO advantages are not all zero; samples of the shape task (``vision_task``) score 1 when
their first word is the answer, exactly (case and the punctuation around it aside), else 0; every other data
source goes to verl's built-in ``default_compute_score``, so any verl-format data set keeps its usual reward.
"""

from __future__ import annotations

import string

from verl.utils.reward_score import default_compute_score

DATA_SOURCE = "augtree_cpu_keywords"
SHAPES_DATA_SOURCE = "augtree_cpu_shapes"


def keyword_score(solution_str: str, ground_truth: str) -> float:
    """Key-word task: |response words that are key words| / |response words| (0 for an empty response)."""
    keys = set(ground_truth.split())
    words = solution_str.split()
    return sum(word in keys for word in words) / len(words) if words else 0.0


def shape_score(solution_str: str, ground_truth: str) -> float:
    """Shape task: 1.0 when the response's first word is the answer, else 0.0 (0 for an empty response)."""
    words = solution_str.split()
    return float(bool(words) and words[0].strip(string.punctuation).lower() == ground_truth)


SCORES = {DATA_SOURCE: keyword_score, SHAPES_DATA_SOURCE: shape_score}


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The generated tasks' scores (above); verl's built-in one for every other data source."""
    if data_source not in SCORES:
        return default_compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
    return SCORES[data_source](solution_str, ground_truth)
