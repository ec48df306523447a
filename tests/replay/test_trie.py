"""Prefix tries found from the tokens (``replay.trie``) and their exact replay on one device, float32 CPU.

One batch holds every kind of sharing: a batch-wide system prompt under three uids, a branch inside two
responses, the same prompt under two uids, a multi-turn row whose prompt ends inside another row's response,
a row that ends inside a shared node, identical rows, and an unrelated group (a depth-1 trie). Log-probs,
entropies and every gradient match the flattened baseline over optimizer steps, with checkpointing and
offload on and off, on an attention model and a hybrid (Gated DeltaNet) one.
"""

from __future__ import annotations

import pytest
import torch

from augtree_verl import Plan, ReplayOptions, ReplayStats, StepPlan, Tree, per_response, replay
from augtree_verl.replay import Offload
from augtree_verl.replay.baseline import flattened_replay
from augtree_verl.replay.cp_trie_schedule import cp_trie_refusal
from augtree_verl.replay.step_plan import shared_root_plans
from augtree_verl.replay.trie import MIN_SHARED_TOKENS, StepTrie, TrieNode, build_trie
from tests.families import family_model
from tests.parity import assert_grads_match, assert_logps_match, grads, plan_and_options, random_trees, tiny_model

VOCAB = 128  # the smaller of tests.parity's and tests.families' vocabularies
SYSTEM, SHARED = 130, 140  # a system prompt and a shared response stretch, each worth a node (>= MIN_SHARED_TOKENS)
# The parity tests' batch: shorter, with a threshold that keeps the same nodes (the test time is the model's)
SHORT = dict(system=24, shared=30)
MIN_SHARED = 16


def _ids(g, n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=g)


def sharing_batch(seed: int = 0, system: int = SYSTEM, shared: int = SHARED) -> list[Tree]:
    """Tree by tree (S: system prompt, X: a stretch two responses share):
    0 "a": prompt S q1, responses X u, X v (a branch inside the responses), w
    1 "b": prompt S q2, responses 2, twice the same 3 tokens (identical rows), their first 2 (a row ending
           inside a node not worth a call)
    2 "c": prompt S q2 (b's prompt under another uid), one response
    3 "d": prompt S q1 X[:|X|/3] (the next turn of a's conversation), response X[|X|/3:] z
    4 "e": prompt S q1, response X (ends where a's responses branch)
    5 "f": an unrelated prompt, responses 4 and 6 (a depth-1 trie)
    """
    g = torch.Generator().manual_seed(seed)
    turn = shared // 3
    system, shared = _ids(g, system), _ids(g, shared)
    p1, p2 = torch.cat([system, torch.tensor([1]), _ids(g, 9)]), torch.cat([system, torch.tensor([2]), _ids(g, 6)])
    twice = _ids(g, 3)
    return [
        Tree.of_tokens(
            p1,
            [
                torch.cat([shared, torch.tensor([1]), _ids(g, 4)]),
                torch.cat([shared, torch.tensor([2]), _ids(g, 8)]),
                _ids(g, 6),
            ],
            uid="a",
        ),
        Tree.of_tokens(p2, [_ids(g, 2), twice, twice.clone(), twice[:2].clone()], uid="b"),
        Tree.of_tokens(p2, [_ids(g, 5)], uid="c"),
        Tree.of_tokens(
            torch.cat([p1, shared[:turn]]), [torch.cat([shared[turn:], torch.tensor([0]), _ids(g, 2)])], uid="d"
        ),
        Tree.of_tokens(p1, [shared.clone()], uid="e"),
        Tree.of_tokens(_ids(g, 9), [_ids(g, 4), _ids(g, 6)], uid="f"),
    ]


def _shape(node: TrieNode):
    """(start, end, rows, ends, score_from, children) of a subtree."""
    return (node.start, node.end, node.rows, node.ends, node.score_from, [_shape(c) for c in node.children])


def _leaf(start, end, *rows):
    return (start, end, list(rows), list(rows), start, [])


def test_a_group_is_todays_depth_1_tree():
    trees = random_trees([7, 12], [[3, 9, 1], [5, 5]], seed=3)
    roots = build_trie(trees)
    assert [_shape(r) for r in roots] == [
        (0, 7, [(0, 0), (0, 1), (0, 2)], [], None, [_leaf(7, 10, (0, 0)), _leaf(7, 16, (0, 1)), _leaf(7, 8, (0, 2))]),
        (0, 12, [(1, 0), (1, 1)], [], None, [_leaf(12, 17, (1, 0)), _leaf(12, 17, (1, 1))]),
    ]
    assert all(r.depth() == 1 for r in roots)


def test_the_trie_of_a_batch_is_found_from_its_tokens():
    roots = build_trie(sharing_batch())
    p1, p2, x = SYSTEM + 10, SYSTEM + 7, SYSTEM + 10 + SHARED
    turn = p1 + SHARED // 3  # d's prompt ends inside a's shared response stretch
    first_turn = (
        p1,
        turn,
        [(0, 0), (0, 1), (3, 0), (4, 0)],
        [],
        p1,
        [
            (
                turn,
                x,
                [(0, 0), (0, 1), (3, 0), (4, 0)],
                [(4, 0)],
                turn,
                [  # e ends here; every row scores it
                    _leaf(x, x + 5, (0, 0)),
                    _leaf(x, x + 9, (0, 1)),
                    _leaf(x, x + 3, (3, 0)),
                ],
            )
        ],
    )
    assert [_shape(r) for r in roots] == [
        (
            0,
            SYSTEM,
            [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (3, 0), (4, 0)],
            [],
            None,
            [
                (
                    SYSTEM,
                    p1,
                    [(0, 0), (0, 1), (0, 2), (3, 0), (4, 0)],
                    [],
                    None,
                    [first_turn, _leaf(p1, p1 + 6, (0, 2))],
                ),
                (
                    SYSTEM,
                    p2,
                    [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0)],
                    [],
                    None,
                    [  # b and c: one prompt node
                        _leaf(p2, p2 + 2, (1, 0)),
                        _leaf(p2, p2 + 3, (1, 1), (1, 2)),
                        _leaf(p2, p2 + 2, (1, 3)),
                        _leaf(p2, p2 + 5, (2, 0)),
                    ],
                ),
            ],
        ),
        (0, 9, [(5, 0), (5, 1)], [], None, [_leaf(9, 13, (5, 0)), _leaf(9, 15, (5, 1))]),
    ]
    assert [r.depth() for r in roots] == [4, 1]


def test_a_node_not_worth_its_call_is_dissolved_into_its_children():
    """Two prompts share a first token (a BOS) or a stretch just short of MIN_SHARED_TOKENS: no node; at
    MIN_SHARED_TOKENS, one."""
    g = torch.Generator().manual_seed(1)
    for shared, nodes in [(1, 2), (MIN_SHARED_TOKENS - 1, 2), (MIN_SHARED_TOKENS, 1)]:
        head = _ids(g, shared)
        trees = [
            Tree.of_tokens(torch.cat([head, torch.tensor([1]), _ids(g, 4)]), [_ids(g, 3)]),
            Tree.of_tokens(torch.cat([head, torch.tensor([2]), _ids(g, 5)]), [_ids(g, 2)]),
        ]
        roots = build_trie(trees)
        assert len(roots) == nodes, shared
        assert sorted(n.end for r in roots for n in ([r] + r.children if nodes == 1 else [r])) == (
            [shared + 5, shared + 6] if nodes == 2 else [shared, shared + 5, shared + 6]
        )


STEPS = 2


def run_both(model, trees, loss_fn, **kw):
    """(replay's scores, its gradients, the flattened baseline's, its gradients) on the same weights."""
    model.zero_grad(set_to_none=True)
    build, options = plan_and_options(kw)
    got = replay(model, StepPlan.build(trees, min_shared_tokens=MIN_SHARED, **build), per_response(loss_fn), options)
    got_grads = grads(model)
    model.zero_grad(set_to_none=True)
    want = flattened_replay(model, trees, loss_fn)
    return got, got_grads, want, grads(model)


def _loss(trees, seed):
    g = torch.Generator().manual_seed(seed)
    adv = [torch.randn(len(t.responses), generator=g).tolist() for t in trees]
    return lambda t, i, logp: -(logp * adv[t][i]).mean() + 0.05 * (logp**2).sum()


@pytest.mark.slow  # several optimizer steps, three models (the quick lane has the one-step tests below)
@pytest.mark.parametrize(
    "name,checkpointing,micro_batch_tokens",
    [
        ("qwen2-gqa", False, 16),
        ("qwen2-gqa", True, 1),  # one row per call; prompt activations offloaded
        ("qwen3.5", True, 16),  # hybrid: nodes continue their parent's linear-attention state
    ],
)
def test_tries_match_flattened_over_optimizer_steps(name, checkpointing, micro_batch_tokens):
    model = family_model(name) if name in ("qwen3.5",) else tiny_model(name, seed=1)
    if checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trees = sharing_batch(**SHORT)
    for step in range(STEPS):
        stats = ReplayStats()
        offload = Offload(stats, min_bytes=0) if checkpointing else None
        got, gg, want, gw = run_both(
            model, trees, _loss(trees, step), micro_batch_tokens=micro_batch_tokens, offload=offload, stats=stats
        )
        assert_logps_match(got, want)
        assert_grads_match(gg, gw)
        assert stats.nodes == 6 and stats.trees == len(trees)
        assert stats.executed_tokens < stats.logical_tokens // 3
        if checkpointing:
            assert stats.offloaded_bytes > 0
        for p, g in zip(model.parameters(), gg.values()):
            p.grad = g
        optimizer.step()


def test_entropies_and_forward_only():
    """Scores with entropies ([R, 2]) through shared scored nodes, training and forward only."""
    model = tiny_model("llama-mha", seed=4)
    trees = sharing_batch(seed=2, **SHORT)
    entropy = lambda logits: torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
    pg = _loss(trees, 7)
    loss_fn = lambda t, i, s: pg(t, i, s[:, 0]) + 0.1 * s[:, 1].sum()
    options = ReplayOptions(entropy_fn=entropy, temperature=0.8)
    build = StepPlan.build(trees, micro_batch_tokens=24, min_shared_tokens=MIN_SHARED)
    got = replay(model, build, per_response(loss_fn), options)
    got_grads = grads(model)
    forward = replay(model, StepPlan.build(trees, min_shared_tokens=MIN_SHARED), None, options)
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
        loss_fn(t, i, torch.stack([want[t][i], entropies[(t, i)]], dim=-1))
        for t in range(len(trees))
        for i in range(len(trees[t].responses))
    ).backward()
    want_entropy = [[entropies[(t, i)] for i in range(len(tree.responses))] for t, tree in enumerate(trees)]
    for scores in (got, forward):
        assert_logps_match([[s[:, 0] for s in row] for row in scores], [[w.detach() for w in row] for row in want])
        assert_logps_match(
            [[s[:, 1] for s in row] for row in scores], [[w.detach() for w in row] for row in want_entropy]
        )
    assert_grads_match(got_grads, grads(model))


def test_a_trie_with_a_cp_plan_runs_whole_with_a_context_parallel_root_or_on_one_device():
    """Of ``sharing_batch``'s trees, only f is exactly one depth-1 trie: it keeps its CP plan as a CP tree. The
    other five share the system prompt: their trie runs whole with its root context-parallel at the largest
    planned degree; where the root cannot (it scores tokens), their CP plans are demoted to the one-device
    plan with their one-rank estimate, and counted."""
    trees = sharing_batch()
    cp = Plan(degree=2, primitive="ring", est_time_s=1.0, est_single_s=1.5)
    plans = [cp, None, cp, cp, cp, cp]
    trie = StepTrie(trees)
    got, cp_roots, demoted = shared_root_plans(trees, plans, trie=trie)
    assert got == plans and demoted == 0
    assert [(root.trees(), d) for root, d in cp_roots] == [([0, 1, 2, 3, 4], 2)]
    assert cp_roots[0][0] is trie.roots[0] and cp_trie_refusal(trie.roots[0]) is None
    trie.roots[0].score_from = trie.roots[0].end - 1  # as if a row's prompt ended inside the root
    assert cp_trie_refusal(trie.roots[0]) == "rows score or end inside its root"
    got, cp_roots, demoted = shared_root_plans(trees, plans, trie=trie)
    one = Plan(est_time_s=1.5)
    assert (got, cp_roots, demoted) == ([one, None, one, one, one, cp], [], 4)
    alone_but_branching = random_trees([9], [[4]])[0]
    shared = _ids(torch.Generator().manual_seed(0), MIN_SHARED_TOKENS)
    alone_but_branching = Tree.of_tokens(
        alone_but_branching.prompt, [torch.cat([shared, torch.tensor([1])]), torch.cat([shared, torch.tensor([2])])]
    )
    got, cp_roots, demoted = shared_root_plans([alone_but_branching], [cp])
    assert got == [cp] and demoted == 0 and [(root.trees(), d) for root, d in cp_roots] == [([0], 2)]


def prompt_inside_a_node(seed: int = 0) -> list[Tree]:
    """Tree 1's prompt is tree 0's and one token t more; tree 0's first response and both of tree 1's share
    t Y (Y: 20 tokens) and then branch; tree 0's second response starts elsewhere. The node [t] ends tree 1's
    prompt but is one token long (below ``MIN_CALL_TOKENS``): dissolved, so tree 1's prompt ends inside the
    node t Y, which scores from t for tree 0 and from Y for tree 1, and inside the leaf of its third response
    (t then elsewhere), which tree 1 reads from its second token. Tree 2's prompt is tree 0's and u; its
    two responses share Z and branch: the node u Z scores from Z (no row scores u)."""
    g = torch.Generator().manual_seed(seed)
    prompt = _ids(g, 8)
    shared, other = torch.cat([torch.tensor([1]), _ids(g, 20)]), torch.cat([torch.tensor([5]), _ids(g, 20)])
    branch = lambda head, token, n: torch.cat([head, torch.tensor([token]), _ids(g, n)])
    return [
        Tree.of_tokens(prompt, [branch(shared, 1, 3), branch(torch.tensor([2]), 2, 3)]),
        Tree.of_tokens(
            torch.cat([prompt, shared[:1]]),
            [branch(shared[1:], 2, 2), branch(shared[1:], 3, 5), branch(torch.tensor([4]), 1, 2)],
        ),
        Tree.of_tokens(torch.cat([prompt, other[:1]]), [branch(other[1:], 1, 1), branch(other[1:], 2, 3)]),
    ]


def test_a_prompt_ending_inside_a_node_scores_from_there():
    roots = build_trie(prompt_inside_a_node(), min_shared_tokens=MIN_SHARED)
    assert [_shape(r) for r in roots] == [
        (
            0,
            8,
            [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)],
            [],
            None,
            [
                (
                    8,
                    29,
                    [(0, 0), (1, 0), (1, 1)],
                    [],
                    8,
                    [_leaf(29, 33, (0, 0)), _leaf(29, 32, (1, 0)), _leaf(29, 35, (1, 1))],
                ),
                _leaf(8, 13, (0, 1)),
                _leaf(8, 13, (1, 2)),
                (8, 29, [(2, 0), (2, 1)], [], 9, [_leaf(29, 31, (2, 0)), _leaf(29, 33, (2, 1))]),
            ],
        )
    ]
    model = tiny_model("qwen2-gqa", seed=6)
    trees = prompt_inside_a_node()
    got, gg, want, gw = run_both(model, trees, _loss(trees, 0), micro_batch_tokens=8)
    assert_logps_match(got, want)
    assert_grads_match(gg, gw)


def _renamed(node: TrieNode, trees: list[int]):
    """``_shape`` with each node's tokens, rows (tree positions in ``trees``) named by tree index."""
    rows = lambda rs: [(trees[t], i) for t, i in rs]
    return (
        node.start,
        node.end,
        node.tokens.tolist(),
        rows(node.rows),
        rows(node.ends),
        node.score_from,
        [_renamed(c, trees) for c in node.children],
    )


@pytest.mark.parametrize("batch", [sharing_batch, prompt_inside_a_node])
def test_the_tries_of_any_subset_of_a_steps_trees_are_found_from_its_trie(batch):
    """``StepTrie.of``: for every subset of the trees (the lock-step's: those a rank runs on one device, a trie
    cut into chunks among them), exactly ``build_trie``'s tries of that subset; a union of whole tries is
    the step's own roots."""
    trees = batch()
    trie = StepTrie(trees, min_shared_tokens=MIN_SHARED)
    identity = list(range(len(trees)))
    for mask in range(2 ** len(trees)):
        subset = [t for t in identity if mask >> t & 1]
        want = build_trie([trees[t] for t in subset], min_shared_tokens=MIN_SHARED)
        assert [_renamed(r, identity) for r in trie.of(subset)] == [_renamed(r, subset) for r in want], subset
    for k in range(len(trie.roots) + 1):
        whole = sorted(t for trees_of in trie.tries()[:k] for t in trees_of)
        assert all(a is b for a, b in zip(trie.of(whole), trie.roots[:k], strict=True))
