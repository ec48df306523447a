"""FLOP counts of one training step (forward + backward = 3x forward) for the two schedules.

Per token and layer the dense part costs 2 x (parameters touched); attention costs 2 H_q (D_k + D_v) per visible
key (QK^T and PV); both from ``model_shape.ModelShape``. The LM head runs on the R scored positions in both
schedules.
"""

from __future__ import annotations

from augtree_verl.model_shape import ModelShape


def _causal_keys(n: int, offset: int = 0) -> int:
    """Visible keys summed over n causal queries that also see ``offset`` earlier keys."""
    return n * offset + n * (n + 1) // 2


def step_flops(cfg, prompt_len: int, response_lens: list[int], reuse: bool) -> float:
    """Training FLOPs of one tree: flattened (``reuse=False``) or prefill-once replay (``reuse=True``)."""
    shape = ModelShape.of(cfg)
    dense, per_key = shape.linear_flops, shape.attention_pair_flops
    head = shape.head_flops * sum(response_lens)
    if reuse:
        tokens = prompt_len + sum(r - 1 for r in response_lens)
        keys = _causal_keys(prompt_len) + sum(_causal_keys(r - 1, prompt_len) for r in response_lens)
    else:
        tokens = sum(prompt_len + r for r in response_lens)
        keys = sum(_causal_keys(prompt_len + r) for r in response_lens)
    return 3 * (dense * tokens + per_key * keys + head)


def ideal_speedup(cfg, prompt_len: int, response_lens: list[int]) -> float:
    return step_flops(cfg, prompt_len, response_lens, False) / step_flops(cfg, prompt_len, response_lens, True)


def trie_flops(cfg, roots) -> float:
    """Training FLOPs of running every node of the tries ``roots`` (``replay.trie``) once: a node's tokens see
    its ancestors' keys and their own causally, a leaf's last token is only a target (its first is scored from
    the parent's last hidden state, as in ``step_flops``' reuse), the LM head runs once on each scored token."""
    shape = ModelShape.of(cfg)
    dense, per_key = shape.linear_flops, shape.attention_pair_flops
    tokens = keys = scored = 0
    stack = list(roots)
    while stack:
        node = stack.pop()
        stack += node.children
        fed = node.length - (not node.children)
        tokens += fed
        keys += _causal_keys(fed, node.start)
        scored += node.end - node.score_from if node.score_from is not None else 0
    return 3 * (dense * tokens + per_key * keys + shape.head_flops * scored)
