"""A length-dependent rope against verl's stock engine: Phi-3's longrope (``tests.families``' ``phi3-longrope``,
original_max_position_embeddings 12) trains three steps with both engines on one rank, at verl micro-batch settings
whose calls put a group's rows on both sides of 12 (``test_engine_streaming.GROUPS``: group 0's rows of 12, 14, 13
and 11 tokens). verl's stock engine chooses the factors per micro-batch (its longest row); the replay splits such a
group into one tree per regime and pins each tree's calls to it. Log-probs, entropies, losses, grad norms and
weights must agree after every step (``test_engine_streaming._steps``), and the split must have happened."""

from __future__ import annotations

import pytest

from augtree_verl.testing import harness as H
from tests.families import family_model
from tests.integration.test_engine_streaming import GROUPS, _steps

pytestmark = pytest.mark.slow  # builds verl engines


@pytest.fixture(scope="module")
def one_rank(single_process_group):
    H.use_cpu_platform()


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("phi3-longrope"))
    family_model("phi3-longrope").save_pretrained(path)
    return path


@pytest.mark.timeout(600)
@pytest.mark.parametrize("setting", ["rows-1", "dynamic"])
def test_longrope_matches_stock_engine(one_rank, phi3_longrope, setting):
    common = dict(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01)
    stock, stock_loss = H.build_engine("fsdp2", phi3_longrope, **common)
    ours, our_loss = H.build_engine("augtree", phi3_longrope, **common)
    rows = list(range(sum(len(rs) for _, rs in GROUPS)))
    metrics = _steps(
        stock,
        stock_loss,
        ours,
        our_loss,
        rows,
        rows,
        setting,
        setting,
        lambda step: H.group_rows(GROUPS, seed=step),
        0.01,
    )
    assert metrics["augtree/rope/split_trees"].aggregate() >= 1  # group 0: rows of 11-12 and of 13-14 tokens
