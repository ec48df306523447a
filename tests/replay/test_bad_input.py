"""Bad input raises ValueError naming the tree and the response."""

import pytest
import torch

from augtree_verl import Plan, ReplayOptions, StepPlan, Tree, per_response, replay
from tests.parity import VOCAB, random_trees, tiny_model

ok = torch.tensor([1, 2, 3])


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize(
    "tree,message",
    [
        (Tree.of_tokens(torch.tensor([], dtype=torch.long), [ok]), "tree 1 prompt is empty"),
        (Tree.of_tokens(ok, []), "tree 1 has no responses"),
        (Tree.of_tokens(ok, [ok, torch.tensor([], dtype=torch.long)]), "tree 1 response 1 is empty"),
        (Tree.of_tokens(ok[None], [ok]), r"tree 1 prompt must be 1-D"),
        (Tree.of_tokens(ok, [ok, ok, torch.ones(2, 2, dtype=torch.long)]), r"tree 1 response 2 must be 1-D"),
        (Tree.of_tokens(ok, [torch.tensor([1, VOCAB])]), rf"tree 1 response 0 has token id {VOCAB} outside"),
        (Tree.of_tokens(torch.tensor([-1, 2]), [ok]), r"tree 1 prompt has token id -1 outside"),
        (Tree.of_tokens(ok, [ok.float()]), r"tree 1 response 0 must hold integer token ids"),
        (Tree.of_tokens(ok, [ok.to("meta")]), r"tree 1 response 0 is on meta but the model is on cpu"),
    ],
)
@pytest.mark.parametrize("train", [False, True])
def test_bad_tree_is_named(model, tree, message, train):
    trees = [random_trees([4], [[2]])[0], tree]
    with pytest.raises(ValueError, match=message):
        replay(model, StepPlan.build(trees), per_response(lambda t, i, lp: lp.sum()) if train else None)
    assert all(p.grad is None for p in model.parameters()), "nothing may run before validation passes"


def test_bad_temperature_and_budget(model):
    trees = random_trees([4], [[2]])
    with pytest.raises(ValueError, match="temperature"):
        replay(model, StepPlan.build(trees), options=ReplayOptions(temperature=0.0))
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        replay(model, StepPlan.build(trees, micro_batch_tokens=0))


def test_plans_must_match_trees(model):
    trees = random_trees([4, 4], [[2, 3], [2]])
    with pytest.raises(ValueError, match="got 1 plans for 2 trees"):
        replay(model, StepPlan.build(trees, plans=[None]))
    split = Plan(degree=2, primitive="move_q", rounds=1, lanes=1, placement=((0, 0),))
    with pytest.raises(ValueError, match="tree 0 has 1 cells but the tree has 2 responses"):
        replay(model, StepPlan.build(trees, plans=[split, None]))
