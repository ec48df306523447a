"""The whole family list (``tests.family_sweep``): every causal-LM and image-text-to-text class the installed
transformers registers replays exactly or is refused by name at build (``check_model``, the start-up probe), and
docs/models.md is this sweep's table. About 25 s on one CPU thread (222 classes of transformers 5.10.4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.family_sweep import COMMAND, SKIPPED, classes, document, sweep

pytestmark = pytest.mark.slow  # every registered class: a few hundred tiny models

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    yield
    torch.set_num_threads(before)


@pytest.mark.timeout(170)
def test_every_registered_family_is_exact_or_refused_by_name(one_thread):
    registered = {name for name, _, _ in classes()}
    assert set(SKIPPED) <= registered, f"skip entries of no registered class: {set(SKIPPED) - registered}"
    outcomes = sweep()
    broken = [o for o in outcomes if o.status == "broken"]
    assert not broken, "neither exact nor refused by name:\n" + "\n".join(
        f"{o.cls} ({o.model_type}): {o.detail[:400]}" for o in broken
    )
    assert sum(o.status == "exact" for o in outcomes) >= 50  # the dense, MoE and hybrid families
    assert DOC.read_text() == document(outcomes), f"docs/models.md is not this sweep's table: run {COMMAND}"
