"""Lock-step for tries (``replay.lockstep``: trie slots with nested shapes, one all-gather) on real gloo ranks.

World 2, each rank a data-parallel rank with its own batch: rank 0 a depth-4 trie with every kind of sharing
(``tests.replay.test_trie.sharing_batch``) and a depth-1 one; rank 1 three depth-1 groups and a trie whose
responses branch (depth 2), so the ranks' trie shapes differ in depth, in the number of slots, of nodes and of
calls per node, and in which nodes score tokens. On every rank, in training and forward only: the same
sequence of model calls and backwards (decoder "D", LM head "H", backward "B"), and each rank's log-probs and
gradients equal the flattened baseline of its own batch.
"""

import pytest
import torch
import torch.distributed as dist

from augtree_verl import StepPlan, Tree, per_response, replay
from augtree_verl.replay.baseline import flattened_replay
from tests.cp.distributed import run_distributed
from tests.cp.test_lockstep import _record, _same_on_every_rank
from tests.parity import assert_grads_match, assert_logps_match, grads, random_trees, tiny_model
from tests.replay.test_trie import MIN_SHARED, SHORT, sharing_batch

pytestmark = pytest.mark.slow  # spawns process groups


def _branching(seed: int) -> list[Tree]:
    """Three groups, and a group whose responses share 20 tokens, then branch."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, 128, (n,), generator=g)
    shared = ids(20)
    return random_trees([6, 11, 4], [[3, 5], [2], [7, 1, 4]], seed=seed) + [
        Tree.of_tokens(
            ids(8),
            [torch.cat([shared, torch.tensor([1]), ids(3)]), torch.cat([shared, torch.tensor([2]), ids(5)]), ids(2)],
        )
    ]


def _ranks_differ(rank, world):
    model = tiny_model("qwen2-gqa", seed=3)
    events = _record(model)
    trees = sharing_batch(**SHORT) if rank == 0 else _branching(5)
    g = torch.Generator().manual_seed(rank)
    adv = [torch.randn(len(t.responses), generator=g).tolist() for t in trees]
    loss_fn = lambda t, i, logp: -(logp * adv[t][i]).mean() + 0.05 * (logp**2).sum()
    options = dict(lockstep_group=dist.group.WORLD, micro_batch_tokens=12, min_shared_tokens=MIN_SHARED)
    forward = replay(model, StepPlan.build(trees, **options))
    _same_on_every_rank(events, "forward only")
    got = replay(model, StepPlan.build(trees, **options), per_response(loss_fn))
    _same_on_every_rank(events, "training")
    got_grads = grads(model)
    model.zero_grad(set_to_none=True)
    want = flattened_replay(model, trees, loss_fn)
    assert_logps_match(got, want)
    assert_logps_match(forward, want)
    assert_grads_match(got_grads, grads(model))


@pytest.mark.timeout(300)
def test_different_tries_issue_the_same_calls_on_every_rank_and_match_flattened():
    run_distributed(_ranks_differ, 2)
