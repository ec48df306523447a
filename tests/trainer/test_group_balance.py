"""Group-aware DP balance: groups intact on one rank, work (prompt once) balanced, every sample once."""

import random

import pytest
import torch
from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

from augtree_verl.groups import find_trees, tree_workload
from augtree_verl.trainer.group_balance import WorkModel, balance_groups, split_groups


def grpo_batch(num_groups, n, seed, prompt_range=(512, 32768), response_range=(16, 4096)):
    """Per-sample (uids, prompt_lens, response_lens) of a GRPO batch in a shuffled completion order."""
    rng = random.Random(seed)
    samples = []
    for g in range(num_groups):
        p = rng.randint(*prompt_range)
        samples += [(f"uid-{g}", p, rng.randint(*response_range)) for _ in range(n)]
    rng.shuffle(samples)
    uids, prompt_lens, response_lens = (list(x) for x in zip(*samples))
    return uids, prompt_lens, response_lens


def check_exact_cover(ranks, n, num_ranks):
    assert len(ranks) == num_ranks
    assert all(len(r) == n // num_ranks for r in ranks)
    assert sorted(i for r in ranks for i in r) == list(range(n))


def test_tree_workload_counts_the_prompt_once():
    p, rs = 9000, [300, 1200, 40]
    w = lambda s: int(calculate_workload(torch.tensor(s)))  # noqa: E731
    assert tree_workload(p, rs) == sum(w(p + r) for r in rs) - 2 * w(p)
    assert tree_workload(p, [700]) == w(p + 700)  # a group of one is just its flattened sequence
    # One prompt pass plus each response's own work and its attention to the prompt.
    assert tree_workload(p, rs) == w(p) + sum(w(r) + 2 * p * r for r in rs)


@pytest.mark.parametrize("num_ranks,num_mini_batches", [(4, 1), (4, 2), (8, 4), (2, 1)])
def test_grpo_groups_stay_whole_and_work_is_balanced(num_ranks, num_mini_batches):
    uids, pl, rl = grpo_batch(num_groups=32, n=8, seed=num_ranks * 10 + num_mini_batches)
    ranks = balance_groups(uids, pl, rl, num_ranks, num_mini_batches)
    check_exact_cover(ranks, len(uids), num_ranks)
    assert split_groups(uids, ranks) == 0
    # Each rank cuts its list into num_mini_batches contiguous slots; every group sits inside one slot.
    slot = len(uids) // (num_ranks * num_mini_batches)
    for rank in ranks:
        for k in range(num_mini_batches):
            slot_uids = {uids[i] for i in rank[k * slot : (k + 1) * slot]}
            assert all(sum(uids[i] == u for i in rank) == 8 for u in slot_uids)
            assert sum(sum(uids[i] == u for i in rank[k * slot : (k + 1) * slot]) for u in slot_uids) == slot


def test_group_balance_beats_verls_sample_balance_on_prompt_once_work():
    """verl's stock balance spreads a group's samples over ranks; each rank then replays the prompt again."""
    uids, pl, rl = grpo_batch(num_groups=16, n=8, seed=3)
    work = WorkModel(uids, pl, rl)
    ours = balance_groups(uids, pl, rl, num_ranks=4)
    stock = get_seqlen_balanced_partitions(
        calculate_workload(torch.tensor([p + r for p, r in zip(pl, rl)])).tolist(), k_partitions=4, equal_size=True
    )
    assert split_groups(uids, stock) > 0
    ours_max, stock_max = max(work(r) for r in ours), max(work(r) for r in stock)
    assert ours_max < 0.8 * stock_max, (ours_max, stock_max)
    # And close to the ideal split of the total (the largest group bounds how close it can get).
    total = work(range(len(uids)))
    biggest = max(work([i for i, u in enumerate(uids) if u == g]) for g in set(uids))
    assert ours_max <= max(1.15 * total / 4, biggest)


def test_uneven_groups_fit_without_splitting_when_a_packing_exists():
    # Sizes 5, 3, 4, 4, 6, 2 into three ranks of 8: 6+2 | 5+3 | 4+4 keeps every group whole. (Placing by
    # work alone would put the heavy 2-sample group first and strand the 5-sample one.)
    sizes = [5, 3, 4, 4, 6, 2]
    uids = [f"g{g}" for g, s in enumerate(sizes) for _ in range(s)]
    pl = [1000 * (g + 1) for g, s in enumerate(sizes) for _ in range(s)]
    rl = [100] * len(uids)
    ranks = balance_groups(uids, pl, rl, num_ranks=3)
    check_exact_cover(ranks, len(uids), 3)
    assert split_groups(uids, ranks) == 0


def test_groups_are_split_only_when_they_cannot_fit():
    # Groups of 3, 3 and 2 into two ranks of 4: a and b cannot share a rank, so one of them splits.
    uids = ["a"] * 3 + ["b"] * 3 + ["c"] * 2
    pl, rl = [4000] * 8, [50] * 8
    ranks = balance_groups(uids, pl, rl, num_ranks=2)
    check_exact_cover(ranks, 8, 2)
    assert split_groups(uids, ranks) == 1
    # A split group pays its prompt on both ranks.
    work = WorkModel(uids, pl, rl)
    assert sum(work(r) for r in ranks) > work(range(8))


def test_padding_unit_and_uneven_sizes_cover_exactly():
    uids, pl, rl = grpo_batch(num_groups=13, n=6, seed=7)
    uids += ["pad"] * 2  # verl pads with samples sharing one uid, prompt 127 + response 1
    pl += [127] * 2
    rl += [1] * 2
    ranks = balance_groups(uids, pl, rl, num_ranks=8)
    check_exact_cover(ranks, 80, 8)
    # A rank of 10 holds one group of 6, so at most 8 of the 13 groups stay whole: 5 splits is the minimum.
    assert split_groups(uids, ranks) == 5
    assert len({r for r, rank in enumerate(ranks) for i in rank if uids[i] == "pad"}) == 1


def test_samples_of_one_uid_with_different_prompts_are_separate_trees_on_one_rank():
    uids = ["m"] * 4 + ["s"] * 4
    pl = [300, 300, 900, 900, 500, 500, 500, 500]  # "m": a multi-turn group, two prompts
    rl = [10, 20, 30, 40, 50, 60, 70, 80]
    trees = find_trees(uids, pl, rl)
    assert [(t.tree_id, t.samples) for t in trees] == [("m|300", (0, 1)), ("m|900", (2, 3)), ("s|500", (4, 5, 6, 7))]
    ranks = balance_groups(uids, pl, rl, num_ranks=2)
    assert split_groups(uids, ranks) == 0
    assert WorkModel(uids, pl, rl)([0, 1, 2, 3]) == tree_workload(300, [10, 20]) + tree_workload(900, [30, 40])


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="sample 2 of group 'b'.*response_len=0"):
        find_trees(["a", "a", "b"], [5, 5, 7], [3, 3, 0])
    with pytest.raises(ValueError, match="sample 1 has uid None"):
        find_trees(["a", None], [5, 5], [3, 3])
    with pytest.raises(ValueError, match="one entry per sample"):
        find_trees(["a", "a"], [5], [3, 3])
    with pytest.raises(ValueError, match="6 samples does not split into 1 mini-batches x 4 ranks"):
        balance_groups(["a"] * 6, [5] * 6, [3] * 6, num_ranks=4)
    with pytest.raises(ValueError, match="num_ranks=0"):
        balance_groups(["a"] * 4, [5] * 4, [3] * 4, num_ranks=0)
