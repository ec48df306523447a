"""Families the replay cannot run are refused by name when verl builds the engine (``check_model`` in
``AugTreeEngine._build_fsdp_module``), before FSDP wraps the model and before the start-up probe's first call:
the message names the model type, the feature, its setting and the stock engine."""

from __future__ import annotations

import pytest

from augtree_verl.testing import harness as H
from tests.families import REFUSED, family_model

pytestmark = pytest.mark.slow  # builds verl engines

# (MPT is not among them: with sdpa, the harness's attention setting, transformers refuses to load it)
BUILD_REFUSED = ["falcon", "llama4-text", "gemma4-kv-sharing", "glm-moe-dsa", "llama-dynamic-rope", "glm4v"]


@pytest.fixture(scope="module")
def one_rank(single_process_group):
    H.use_cpu_platform()


def _save(name: str, directory) -> str:
    family_model(name).save_pretrained(str(directory))
    return str(directory)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", BUILD_REFUSED)
def test_refused_at_build(one_rank, tmp_path, name):
    """The features each refusal names are ``check_model``'s (the probe's refusals name other ones)."""
    with pytest.raises(ValueError, match=REFUSED[name][3] + r".*strategy=fsdp2"):
        H.build_engine("augtree", _save(name, tmp_path / name))


@pytest.mark.timeout(300)
def test_length_dependent_rope_with_bucket_padding_refused_at_build(one_rank, tmp_path):
    """verl's pad_to_length appends a segment whose positions the rows' call lengths do not say."""
    with pytest.raises(
        ValueError, match=r"'phi3'.*length-dependent rope with verl's bucket padding.*pad_to_length=True"
    ):
        H.build_engine("augtree", _save("phi3-longrope", tmp_path / "phi3"), engine_knobs={"pad_to_length": True})
