"""The planner's Ray actor imports the planning side of the package only: not transformers, whose modeling imports
(the replay's attention hook, its decoder output class, its rope check) took 4 to 5 s of each actor's start on 2
cores before they moved to first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("transformers", "verl")


@pytest.mark.timeout(120)
def test_the_planner_service_imports_neither_transformers_nor_verl():
    code = f"import sys, augtree_verl.planner.service; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110, check=True)
    assert out.stdout.strip() == "[]", out.stdout
