import json
import math

import pytest
import torch

from augtree_verl.bench.workloads import (
    TABLES_DIR,
    WORKLOADS,
    GroupShape,
    build_workload,
    fit_group_size,
    load_table,
    rank_groups,
    select_groups,
)


def shape(i, p, lens):
    return GroupShape(id=str(i), prompt_len=p, response_lens=tuple(lens))


def test_rank_uses_log_ratio_not_absolute_distance():
    # B = 1000, G = 1: 1900 tokens is 0.64 away in log ratio (900 tokens), 400 is 0.92 away (600 tokens).
    groups = [shape(0, 300, [100]), shape(1, 1400, [500])]
    assert [g.id for g in rank_groups(groups, 1000, 1)] == ["1", "0"]


def test_rank_ties_keep_corpus_order():
    # 500 and 2000 logical tokens are both |log 2| from B = 1000.
    groups = [shape(0, 1000, [1000]), shape(1, 250, [250]), shape(2, 1000, [1000])]
    assert [g.id for g in rank_groups(groups, 1000, 1)] == ["0", "1", "2"]
    assert [g.id for g in rank_groups(groups[::-1], 1000, 1)] == ["2", "1", "0"]


def test_rank_counts_g_branches_of_prompt_plus_mean_response():
    # G = 4: group a has 4·(100 + 150) = 1000 logical tokens, group b 4·(10 + 40) = 200.
    a, b = shape("a", 100, [100, 200, 100, 200]), shape("b", 10, [40, 40, 40, 40])
    assert rank_groups([b, a], 1000, 4)[0].id == "a"
    assert rank_groups([a, b], 200, 4)[0].id == "b"
    assert a.logical_tokens == 1000 and a.reuse_tokens == 700


def test_fit_group_size_truncates_then_cycles():
    g = shape(0, 7, [1, 2, 3])
    assert fit_group_size(g, 2).response_lens == (1, 2)
    assert fit_group_size(g, 7).response_lens == (1, 2, 3, 1, 2, 3, 1)


def test_rank_sizes_groups_before_ranking():
    # With G = 1 group x keeps only its first (short) response; with G = 2 its long one counts too.
    x, y = shape("x", 10, [10, 1000]), shape("y", 10, [290])
    assert rank_groups([x, y], 300, 1)[0].id == "y"
    assert rank_groups([x, y], 1040, 2)[0].id == "x"


def test_select_groups_matches_brute_force_on_shipped_table():
    budget, g = 40_000, 8
    table = load_table("reasoning")
    chosen = select_groups("reasoning", budget, g, num_groups=3)
    by_distance = sorted(
        range(len(table)),
        key=lambda k: abs(
            math.log(budget / (g * table[k].prompt_len + sum(fit_group_size(table[k], g).response_lens)))
        ),
    )
    assert [c.id for c in chosen] == [table[k].id for k in by_distance[:3]]
    assert all(len(c.response_lens) == g for c in chosen)


@pytest.mark.parametrize("name", WORKLOADS)
def test_shipped_tables_are_well_formed(name):
    raw = json.loads((TABLES_DIR / f"{name}.json").read_text())
    assert raw["workload"] == name and raw["groups"]
    for grp in load_table(name):
        assert grp.prompt_len > 0 and grp.response_lens and min(grp.response_lens) > 0


def test_regimes_have_their_shape():
    # longdoc and rag are prompt-heavy, reasoning response-heavy (median over groups).
    def median_ratio(name):
        r = sorted(g.prompt_len / (sum(g.response_lens) / len(g.response_lens)) for g in load_table(name))
        return r[len(r) // 2]

    assert median_ratio("longdoc") > 10 and median_ratio("rag") > 10
    assert median_ratio("reasoning") < 0.2
    assert max(len(g.response_lens) for g in load_table("chat")) == 18


def test_build_workload_trees_follow_the_selected_lengths_and_seed():
    w = build_workload("chat", 4096, 4, num_groups=2, vocab_size=100, seed=3)
    assert len(w.trees) == 2
    for grp, tree in zip(w.groups, w.trees):
        assert tree.prompt_len == grp.prompt_len and tuple(tree.response_lens) == grp.response_lens
        assert int(tree.prompt.max()) < 100 and tree.prompt.dtype == torch.long
    again = build_workload("chat", 4096, 4, num_groups=2, vocab_size=100, seed=3)
    assert torch.equal(w.trees[0].prompt, again.trees[0].prompt)
    other = build_workload("chat", 4096, 4, num_groups=2, vocab_size=100, seed=4)
    assert not torch.equal(w.trees[0].prompt, other.trees[0].prompt)
    assert w.logical_tokens == sum(g.logical_tokens for g in w.groups)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="nope", budget_tokens=1000, group_size=4), "unknown workload 'nope'"),
        (dict(name="chat", budget_tokens=0, group_size=4), "budget_tokens .* got 0"),
        (dict(name="chat", budget_tokens=7, group_size=4), "at least 2 \\* group_size = 8"),
        (dict(name="chat", budget_tokens=1000.0, group_size=4), "budget_tokens .* got 1000.0"),
        (dict(name="chat", budget_tokens=1000, group_size=0), "group_size must be a positive int, got 0"),
        (dict(name="chat", budget_tokens=1000, group_size=2.5), "group_size .* got 2.5"),
        (dict(name="longdoc", budget_tokens=1000, group_size=4, num_groups=2), "num_groups .* \\[1, 1\\]"),
        (dict(name="chat", budget_tokens=1000, group_size=4, num_groups=0), "num_groups .* got 0"),
        (dict(name="chat", budget_tokens=1000, group_size=4, vocab_size=0), "vocab_size .* got 0"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_workload(**kwargs)
