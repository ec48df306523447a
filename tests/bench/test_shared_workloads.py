"""The workloads that share tokens beyond a group (agent, multiturn), the depth-1 method and the trie ideal."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from tqdm import tqdm

from augtree_verl.bench import runner, workloads
from augtree_verl.bench.config import BenchConfig
from augtree_verl.bench.methods import DEPTH1, DEPTH1_SHARED_TOKENS, Method, methods_for
from augtree_verl.bench.report import format_shared
from augtree_verl.bench.runner import FLOAT32_GRAD_RTOL, ideal_trie_speedup
from augtree_verl.bench.workloads import (
    TURN_SEPARATOR_TOKENS,
    Workload,
    agent_system_turns,
    build_workload,
    load_table,
    select_groups,
)
from augtree_verl.cli import _parser, bench_config
from augtree_verl.cp.mesh import CPMesh
from augtree_verl.groups import Tree
from augtree_verl.models import load_model
from augtree_verl.planner import ClusterProfile, plan_tree
from augtree_verl.planner.cost import cost_model
from augtree_verl.replay import StepPlan
from augtree_verl.replay.trie import build_trie


def test_agent_groups_share_one_system_turn_of_the_shipped_length():
    system, default = agent_system_turns()
    assert (system, default) == (325, 11)
    w = build_workload("agent", 8192, 4, vocab_size=1000)
    chat = {g.id: g for g in load_table("chat")}
    assert len(w.trees) == workloads.DEFAULT_GROUPS["agent"]
    for grp, tree in zip(w.groups, w.trees):
        assert torch.equal(tree.prompt[:system], w.trees[0].prompt[:system])
        assert tree.prompt_len == grp.prompt_len == system + chat[grp.id].prompt_len - default
        assert tree.response_lens == grp.response_lens
    # Random elsewhere: the user turns differ right after the system turn.
    assert len({int(t.prompt[system]) for t in w.trees}) > 1
    again = build_workload("agent", 8192, 4, vocab_size=1000)
    assert all(torch.equal(a.prompt, b.prompt) for a, b in zip(w.trees, again.trees))


def test_multiturn_turns_quote_the_previous_turn_and_its_first_response():
    default = agent_system_turns()[1]
    w = build_workload("multiturn", 8192, 4, vocab_size=1000, seed=1)
    chat = select_groups("multiturn", 8192, 4)
    assert w.trees[0].prompt_len == chat[0].prompt_len
    for t in range(1, len(w.trees)):
        prev, tree = w.trees[t - 1], w.trees[t]
        quoted = torch.cat([prev.prompt, prev.responses[0]])
        assert torch.equal(tree.prompt[: len(quoted)], quoted)
        assert tree.prompt_len == len(quoted) + TURN_SEPARATOR_TOKENS + chat[t].prompt_len - default
        assert tree.response_lens == chat[t].response_lens
    assert not torch.equal(w.trees[1].prompt, build_workload("multiturn", 8192, 4, vocab_size=1000).trees[1].prompt)


def test_bad_shared_workload_input_names_the_workload(monkeypatch):
    with pytest.raises(ValueError, match="for workload 'agent'"):
        build_workload("agent", 8192, 4, num_groups=10**6)
    monkeypatch.setattr(workloads, "agent_system_turns", lambda: (325, 10**6))
    with pytest.raises(ValueError, match="workload 'multiturn': chat group .* default system turn"):
        load_table.__wrapped__("multiturn")


def test_config_and_flags_take_the_shared_workloads():
    args = _parser().parse_args(["bench", "--quick", "--workloads", "agent", "multiturn"])
    assert bench_config(args).workloads == ("agent", "multiturn") and bench_config(args).num_groups is None
    args = _parser().parse_args(["bench", "--workload", "all", "agent"])
    assert bench_config(args).workloads == workloads.WORKLOADS + ("agent",)
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        BenchConfig.quick(workloads=("agent", "nope"))


# One layer, one head of width 1, no MLP, vocab 1: a token costs 8 dense FLOPs, a visible key 4, a scored token
# 2 (all x3 for forward + backward, which cancels in the ratio).
UNIT = SimpleNamespace(
    hidden_size=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=1,
    intermediate_size=0,
    num_hidden_layers=1,
    vocab_size=1,
)


def _tree(prompt, *responses):
    return Tree.of_tokens(torch.tensor(prompt), [torch.tensor(r) for r in responses])


def test_ideal_trie_ratio_by_hand():
    trees = [_tree([1, 2, 3, 4], [5]), _tree([1, 2, 3, 6], [7])]
    # Flattened, per row: 5 tokens (40), 15 visible keys (60), 1 scored (2) = 102.
    # Trie: [1 2 3] (3 tokens, 6 keys), [4] and [6] (1 token, 4 keys), leaves [5] and [7] (scored, but only
    # targets: no token fed): 5 tokens, 14 keys, 2 scored = 40 + 56 + 4 = 100.
    assert ideal_trie_speedup(UNIT, trees) == pytest.approx(204 / 100)
    # Depth-1: each prompt its own node (4 tokens, 10 keys), as step_flops counts prompt reuse: 2 x 74.
    assert ideal_trie_speedup(UNIT, trees, DEPTH1_SHARED_TOKENS) == pytest.approx(204 / 148)


def _shared_workload(system_len=140):
    """Two tiny groups behind one ``system_len``-token system prompt (worth a trie node at 128)."""
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 100, (n,), generator=gen)
    system = ids(system_len)
    trees = tuple(Tree.of_tokens(torch.cat([system, ids(6)]), [ids(5), ids(7)]) for _ in range(2))
    groups = tuple(workloads.GroupShape(str(t), tree.prompt_len, tree.response_lens) for t, tree in enumerate(trees))
    return Workload("agent", groups, trees)


def test_shared_plans_run_with_a_context_parallel_root_as_in_the_engine():
    """The planner gives both groups CP plans; their trie (one system prompt) runs whole, its root
    context-parallel, as the engine runs it, and the prediction times that slot (``CostModel.cp_trie``)."""
    trees = list(_shared_workload().trees)
    plans = Method("AugTree").plans(trees, 2)
    assert [p.degree for p in plans] == [2, 2]
    profile = ClusterProfile.default()
    [(root, degree)] = StepPlan.build(trees, plans=plans, mesh=CPMesh.for_planning((1, 2), 0)).cp_roots
    assert degree == 2 and root.trees() == [0, 1]
    predicted = Method("AugTree").predicted_s(trees, plans, profile, 2)
    assert predicted == pytest.approx(cost_model(profile).cp_trie(root, 2), rel=1e-12)
    assert predicted < cost_model(profile).trie(root)  # over two ranks, sooner than on one
    assert [p.degree for p in DEPTH1.plans(trees, 2)] == [2, 2]  # each group alone in its depth-1 trie
    assert [p.degree for p in Method("MegaR", fixed="megar").plans(trees, 2)] == [2, 2]


def test_the_prediction_sees_the_shared_system_prompt_once():
    """One rank runs both groups behind their system prompt: one prefill of it, where the planner, planning
    each tree alone, counts it twice. On two ranks the cost model prefers the system prompt context-parallel
    over both (once) to one group per rank (once each), and predicts that slot."""
    trees = list(_shared_workload(system_len=2000).trees)
    profile = dataclasses.replace(ClusterProfile.default(), call_overhead_s=1e-9, slot_overhead_s=1e-9)
    cost, alone = (
        cost_model(profile),
        [plan_tree(t.prompt_len, t.response_lens, degrees=[1], profile=profile) for t in trees],
    )
    shared = Method("AugTree").predicted_s(trees, None, profile)
    [root] = build_trie(trees)
    assert shared == pytest.approx(cost.trie(root), rel=1e-12)
    assert shared < 0.6 * sum(p.est_time_s for p in alone)
    two = Method("AugTree").predicted_s(trees, alone, profile, 2)
    [(root, degree)] = StepPlan.build(trees, plans=alone, mesh=CPMesh.for_planning((1, 2), 0), trie_cost=cost).cp_roots
    assert degree == 2 and two == pytest.approx(cost.cp_trie(root, 2), rel=1e-12)
    assert two < max(p.est_time_s for p in alone)  # sooner than a group per rank


def _run(methods):
    model = load_model("qwen2-tiny")
    return runner._run_workload(
        model, _shared_workload(), methods, 1, 0, 0, 1, None, tqdm(disable=True), FLOAT32_GRAD_RTOL
    )


def test_depth1_is_checked_against_the_flattened_gradients(monkeypatch):
    methods = [m for m in methods_for(1, depth1=True) if not m.verl]
    megan, aug, depth1 = _run(methods)
    assert depth1.method == "AugTree[depth-1]" and not any(r.wrong for r in (megan, aug, depth1))
    # The trie runs the system prompt once, depth-1 once per group.
    assert aug.executed_tokens + 140 == depth1.executed_tokens < megan.executed_tokens
    assert aug.ideal_trie > aug.ideal_depth1 == pytest.approx(aug.ideal_speedup)
    assert format_shared([megan, aug, depth1]).startswith("agent: ideal FLOP ratio over flattened: trie")

    build, run, depth1 = runner.StepPlan.build, runner.replay, []

    def tracked(trees, **options):
        depth1.append(options["min_shared_tokens"] == DEPTH1_SHARED_TOKENS)
        return build(trees, **options)

    def tempered(model, step_plan, loss=None, options=None):  # a wrong depth-1 replay: its log-probs at temperature 2
        options = options if options is not None else runner.ReplayOptions()
        return run(model, step_plan, loss, dataclasses.replace(options, temperature=2.0 if depth1[-1] else 1.0))

    monkeypatch.setattr(runner.StepPlan, "build", tracked)
    monkeypatch.setattr(runner, "replay", tempered)
    assert [r.wrong for r in _run(methods)] == [False, False, True]
