"""A rope whose frequencies depend on the call's length (Phi-3's longrope, ``replay.rope``), float32 CPU.

The oracle runs each row as verl's stock engine does: in a call as long as the longest row of its verl
micro-batch (``Tree.call_lens``; the row right padded to it, which changes none of its positions' results but the
rope's choice), or alone where no micro-batch is given (the flattened baseline). Prompt reuse must match it on
trees whose rows fall on both sides of ``original_max_position_embeddings`` (12 in ``tests.families``), shared
prompts of both regimes included, and count the trees it split.
"""

from __future__ import annotations

import pytest
import torch

from augtree_verl import StepPlan, Tree, per_response, replay
from augtree_verl.plan import Plan
from augtree_verl.replay.baseline import flattened_replay
from augtree_verl.replay.rope import RopeRegimes, in_caller_trees, split_regimes
from augtree_verl.replay.trie import StepTrie
from tests.families import VOCAB, family_model
from tests.parity import RTOL, assert_grads_match, assert_logps_match, grads, rel_err

THRESHOLD = 12  # tests.families' phi3-longrope original_max_position_embeddings


def _ids(g, n):
    return torch.randint(3, VOCAB, (n,), generator=g)


def _loss(t, i, logp):
    return -(logp * (i - 1.5 + 0.3 * t)).mean() + 0.05 * (logp**2).sum()


def _trees(call_lens: bool) -> list[Tree]:
    """Rows on both sides of the threshold under one prompt; two trees of one prompt (a trie would share it);
    with ``call_lens``, the calls of verl micro-batches that pair rows of different lengths."""
    g = torch.Generator().manual_seed(0)
    p0, p1 = _ids(g, 9), _ids(g, 6)
    trees = [
        Tree.of_tokens(p0, [_ids(g, 2), _ids(g, 6), _ids(g, 3), _ids(g, 5)]),  # rows 11, 15, 12, 14
        Tree.of_tokens(p1, [_ids(g, 4), _ids(g, 9)]),  # rows 10, 15
        Tree.of_tokens(p0, [_ids(g, 1), _ids(g, 2)]),  # rows 10, 11: p0 again, one regime
    ]
    if not call_lens:
        return trees
    # micro-batches (rows): (t0 r0, t1 r0) -> 11, (t0 r1, t2 r0) -> 15, (t0 r2, t0 r3) -> 14, (t1 r1, t2 r1) -> 15
    calls = [(11, 15, 14, 14), (11, 15), (15, 15)]
    return [Tree.of_tokens(t.prompt, t.responses, call_lens=c) for t, c in zip(trees, calls)]


def _stock_rows(model, trees: list[Tree], loss) -> list[list[torch.Tensor]]:
    """Each row in a call of its ``row_call_lens`` (right padded): the stock engine's rope choice per row."""
    out = []
    for t, tree in enumerate(trees):
        row = []
        for i, (resp, n) in enumerate(zip(tree.responses, tree.row_call_lens)):
            ids = torch.cat([tree.prompt, resp, torch.zeros(n - tree.prompt_len - len(resp), dtype=torch.long)])
            logits = model(input_ids=ids[None], use_cache=False).logits[0].float()
            scoring = logits[tree.prompt_len - 1 : tree.prompt_len - 1 + len(resp)]  # position k scores token k + 1
            logp = torch.log_softmax(scoring, -1).gather(-1, resp[:, None]).squeeze(-1)
            loss(t, i, logp).backward()
            row.append(logp.detach())
        out.append(row)
    return out


@pytest.mark.parametrize("call_lens", [False, True], ids=["rows-alone", "micro-batches"])
def test_longrope_replays_with_the_stock_engines_frequencies(call_lens):
    model = family_model("phi3-longrope")
    trees = _trees(call_lens)
    step = StepPlan.build(trees, micro_batch_tokens=24, rope=RopeRegimes.of(model.config))
    assert step.rope_splits == 2  # trees 0 and 1 (tree 2's rows are in one regime)
    assert sorted({t.rope_len for t in step.trees}) == [1, THRESHOLD + 1]
    got = replay(model, step, per_response(_loss))
    got_grads = grads(model)
    model.zero_grad(set_to_none=True)
    want = _stock_rows(model, trees, _loss)
    assert_logps_match(got, want)
    assert_grads_match(got_grads, grads(model))
    if not call_lens:  # the oracle is the flattened baseline's
        model.zero_grad(set_to_none=True)
        assert_logps_match(flattened_replay(model, trees, _loss), want)


def test_the_model_tells_the_regimes_apart():
    """The oracle is sensitive: a row scored in a longer call (the long factors) is off the row alone by far more
    than the parity tolerance (a tiny random model's logits are ~0.1, so log-probs move little)."""
    model = family_model("phi3-longrope")
    alone, padded = _trees(False)[2], _trees(True)[2]  # rows of 10 tokens: alone vs in a call of 15
    with torch.no_grad():
        short = _stock_rows(model, [alone], lambda *_: torch.zeros((), requires_grad=True))[0][0]
        long = _stock_rows(model, [padded], lambda *_: torch.zeros((), requires_grad=True))[0][0]
    assert rel_err(long, short) > 10 * RTOL


def test_tries_never_share_across_regimes():
    """Tree 0 and tree 2 share prompt p0: one trie without a rope, one per regime with it."""
    model = family_model("phi3-longrope")
    trees = _trees(False)
    split, _, _, _ = split_regimes(trees, [None] * len(trees), RopeRegimes.of(model.config))
    roots = StepTrie(split, min_shared_tokens=0).roots
    for root in roots:
        assert len({split[t].rope_len for t in root.trees()}) == 1
    assert len(roots) > len(StepTrie(trees, min_shared_tokens=0).roots)


def test_split_regimes_plans_and_origin():
    regimes = RopeRegimes((THRESHOLD,))
    g = torch.Generator().manual_seed(1)
    tree = Tree.of_tokens(_ids(g, 9), [_ids(g, 2), _ids(g, 6), _ids(g, 3)])  # rows 11, 15, 12: regimes 1, 13, 1
    one = Tree.of_tokens(_ids(g, 3), [_ids(g, 2)])
    ring = Plan(degree=2, est_time_s=1.0, est_single_s=1.5)
    move_q = Plan(degree=2, primitive="move_q", rounds=1, lanes=1, placement=((0, 0), (0, 0), (0, 0)), est_single_s=2.0)
    for plan, kept in ((ring, ring), (move_q, Plan(est_time_s=2.0))):
        trees, plans, origin, split = split_regimes([tree, one], [plan, None], regimes)
        assert split == 1 and origin == [(0, (0, 2)), (0, (1,)), (1, (0,))]
        assert [t.rope_len for t in trees] == [1, THRESHOLD + 1, 1]
        assert [t.response_lens for t in trees] == [(2, 3), (6,), (2,)]
        assert plans == [kept, kept, None]
    scores = [[torch.tensor([0.0]), torch.tensor([2.0])], [torch.tensor([1.0])], [torch.tensor([3.0])]]
    assert [[float(x) for x in row] for row in in_caller_trees(scores, origin)] == [[0.0, 1.0, 2.0], [3.0]]
    assert split_regimes([one], [None], regimes)[2:] == (None, 0)  # nothing split: the caller's indices


def test_replay_refuses_a_plan_without_the_models_regimes():
    model = family_model("phi3-longrope")
    with pytest.raises(ValueError, match=r"built for rope regimes None but the model's rope has .*thresholds=\(12,\)"):
        replay(model, StepPlan.build(_trees(False)))
