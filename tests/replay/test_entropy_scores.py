"""``entropy_fn`` + ``micro_batch_loss`` on one device: scores [R, 2] (log-prob, entropy), a loss over both
per response micro-batch, against the flattened baseline (log-probs, entropies, every gradient)."""

import pytest
import torch

from augtree_verl import ReplayOptions, StepPlan, replay
from augtree_verl.replay.baseline import flattened_replay
from tests.parity import RTOL, assert_grads_match, assert_logps_match, grads, random_trees, rel_err, tiny_model


def entropy(logits):
    p = torch.log_softmax(logits, dim=-1)
    return -(p.exp() * p).sum(-1)


def loss(t, i, logp, ent):
    """Per-response terms (verl's losses are sums of these under batch-level normalisers)."""
    return -(logp * (1.0 + t - 0.5 * i)).mean() + 0.05 * (logp**2).sum() - 0.01 * ent.mean()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_entropy_scores_and_micro_batch_loss_match_flattened(checkpointing):
    model = tiny_model("qwen2-gqa", seed=11)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trees = random_trees([33, 4], [[6, 1, 9], [12, 5]], seed=11)
    seen = []

    def micro_batch_loss(t, rows, scores):
        seen.append((t, list(rows)))
        return sum(loss(t, i, s[:, 0], s[:, 1]) for i, s in zip(rows, scores))

    model.zero_grad(set_to_none=True)
    step_plan = StepPlan.build(trees, micro_batch_tokens=10)
    got = replay(model, step_plan, micro_batch_loss, ReplayOptions(temperature=0.8, entropy_fn=entropy))
    got_grads = grads(model)
    assert all(
        s.shape == (n, 2) and not s.requires_grad
        for tree, row in zip(trees, got)
        for s, n in zip(row, tree.response_lens)
    )
    assert len(seen) > len(trees)  # several micro-batches per tree
    model.zero_grad(set_to_none=True)
    entropies = {}
    want = flattened_replay(
        model,
        trees,
        keep_graph=True,
        temperature=0.8,
        on_logits=lambda t, i, logits: entropies.__setitem__((t, i), entropy(logits)),
    )
    sum(
        loss(t, i, want[t][i], entropies[(t, i)]) for t in range(len(trees)) for i in range(len(trees[t].responses))
    ).backward()
    assert_logps_match([[s[:, 0] for s in row] for row in got], [[x.detach() for x in row] for row in want])
    for t, row in enumerate(got):
        for i, s in enumerate(row):
            assert rel_err(s[:, 1], entropies[(t, i)].detach()) <= RTOL
    assert_grads_match(got_grads, grads(model))
