import itertools

import numpy as np
import pytest

from augtree_verl.planner.partition import (
    SUBSET_DP_MAX_UNITS,
    balanced_lanes,
    lane_makespan,
    lpt_lanes,
    subset_dp_lanes,
)

RTOL = 1e-12  # makespans are sums of the same float64 weights; only summation order may differ


def brute_force_makespan(weights, lanes):
    """Smallest makespan over every assignment of units to lanes that leaves no lane empty."""
    best = np.inf
    for labels in itertools.product(range(lanes), repeat=len(weights)):
        if len(set(labels)) == lanes:
            best = min(best, lane_makespan(weights, np.array(labels), lanes))
    return best


def lpt_bound(lanes):
    return 4 / 3 - 1 / (3 * lanes)  # Graham (1969)


@pytest.mark.parametrize("seed", range(12))
def test_subset_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    units = int(rng.integers(2, 8))
    lanes = int(rng.integers(2, units + 1))
    weights = rng.choice([rng.uniform(0.1, 10.0, units), rng.integers(1, 6, units).astype(float)])
    labels = subset_dp_lanes(weights, lanes)
    assert set(labels.tolist()) == set(range(lanes))
    assert lane_makespan(weights, labels, lanes) == pytest.approx(brute_force_makespan(weights, lanes), rel=RTOL)


@pytest.mark.parametrize("seed", range(20))
def test_lpt_within_graham_bound_of_optimum(seed):
    rng = np.random.default_rng(100 + seed)
    units = int(rng.integers(3, SUBSET_DP_MAX_UNITS + 1))
    lanes = int(rng.integers(2, min(units, 5) + 1))
    weights = rng.uniform(1.0, 10.0, units)
    optimum = lane_makespan(weights, subset_dp_lanes(weights, lanes), lanes)
    greedy = lpt_lanes(weights, lanes)
    assert set(greedy.tolist()) == set(range(lanes))
    assert optimum <= lane_makespan(weights, greedy, lanes) <= lpt_bound(lanes) * optimum * (1 + RTOL)


def test_lpt_bound_is_tight_on_grahams_example():
    weights = np.array([3.0, 3.0, 2.0, 2.0, 2.0])  # LPT: {3,2,2}=7, {3,2}=5; optimum {3,3}, {2,2,2} = 6
    assert lane_makespan(weights, lpt_lanes(weights, 2), 2) == 7
    assert lane_makespan(weights, subset_dp_lanes(weights, 2), 2) == 6
    assert 7 / 6 == pytest.approx(lpt_bound(2))


def test_balanced_lanes_switches_to_greedy_beyond_the_cap():
    weights = np.arange(1, SUBSET_DP_MAX_UNITS + 3, dtype=float)
    labels = balanced_lanes(weights, 3)
    assert np.array_equal(labels, lpt_lanes(weights, 3))
    assert set(labels.tolist()) == {0, 1, 2}


def test_balanced_lanes_rejects_more_lanes_than_units():
    with pytest.raises(ValueError, match="lanes must be in \\[1, 3\\]"):
        balanced_lanes(np.ones(3), 4)
