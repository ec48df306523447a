"""``keep_graph``: one backward of a batch-coupled loss over every log-prob (and entropy) of every tree."""

import pytest
import torch

from augtree_verl import replay
from augtree_verl.replay.baseline import flattened_replay
from tests.parity import assert_grads_match, assert_logps_match, grads, random_trees, rel_err, tiny_model, RTOL


def coupled_loss(logps, entropies):
    """Token-mean over all responses of all trees plus a squared batch mean: no per-response split."""
    flat = torch.cat([lp for row in logps for lp in row])
    ent = torch.cat([e for row in entropies for e in row])
    return -flat.mean() + 3.0 * flat.mean() ** 2 - 0.01 * ent.mean()


def run(fn, model, trees):
    entropies = {}

    def on_logits(t, i, logits):
        p = torch.log_softmax(logits, dim=-1)
        entropies[t, i] = -(p.exp() * p).sum(-1)

    model.zero_grad(set_to_none=True)
    logps = fn(model, trees, temperature=0.8, keep_graph=True, on_logits=on_logits)
    ent = [[entropies[t, i] for i in range(len(row))] for t, row in enumerate(logps)]
    coupled_loss(logps, ent).backward()
    return logps, ent, grads(model)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_keep_graph_matches_flattened(checkpointing):
    model = tiny_model("qwen2-gqa", seed=11)
    if checkpointing:
        model.gradient_checkpointing_enable()
    trees = random_trees([33, 4], [[6, 1, 9], [12, 5]], seed=11)
    got, got_ent, got_grads = run(lambda *a, **k: replay(*a, micro_batch_tokens=10, **k), model, trees)
    want, want_ent, want_grads = run(flattened_replay, model, trees)
    assert_logps_match([[x.detach() for x in r] for r in got], [[x.detach() for x in r] for r in want])
    for rg, rw in zip(got_ent, want_ent):
        for a, b in zip(rg, rw):
            assert rel_err(a.detach(), b.detach()) <= RTOL
    assert_grads_match(got_grads, want_grads)


def test_keep_graph_and_loss_fn_are_exclusive():
    model = tiny_model()
    with pytest.raises(ValueError, match="not more than one"):
        replay(model, random_trees([3], [[2]]), lambda t, i, lp: lp.sum(), keep_graph=True)
