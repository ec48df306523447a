"""The family matrix on the replay (float32 CPU): every ``tests.families.PARITY`` family's log-probs and
gradients equal the flattened baseline's, which runs the family's own ``forward`` (so a logit transform the
replay skipped, e.g. Granite's ``logits_scaling``, fails here)."""

from __future__ import annotations

import pytest
import torch

from augtree_verl import StepPlan, Tree, per_response, replay
from augtree_verl.replay.baseline import flattened_replay
from augtree_verl.replay.rope import RopeRegimes
from tests.families import PARITY, VOCAB, family_model
from tests.parity import assert_grads_match, assert_logps_match, grads


def _trees():
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, VOCAB, (n,), generator=g)
    return [Tree.of_tokens(ids(9), [ids(4), ids(6), ids(2)]), Tree.of_tokens(ids(3), [ids(5)])]


def _loss(t, i, logp):
    return -(logp * (i - 1.5)).mean() + 0.05 * (logp**2).sum()


@pytest.mark.parametrize("name", sorted(PARITY))
def test_family_replays_exactly(name):
    model = family_model(name)
    trees = _trees()
    got = replay(
        model, StepPlan.build(trees, micro_batch_tokens=8, rope=RopeRegimes.of(model.config)), per_response(_loss)
    )
    got_grads = grads(model)
    model.zero_grad(set_to_none=True)
    want = flattened_replay(model, trees, _loss)
    assert_logps_match(got, want)
    assert_grads_match(got_grads, grads(model))
