"""``import verl`` makes ``rollout.name=hf`` resolvable on both sides: the replica and the worker's adapter."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter importing verl

REPO = Path(__file__).resolve().parents[2]


def test_hf_rollout_is_registered_by_the_plugin():
    # A fresh process: only ``import verl`` registers it (the augtree_trainer plugin entry point, which calls
    # augtree_verl.rollout.registration; the engine's plugin, augtree_verl.integration, sits below rollout/).
    code = textwrap.dedent("""
        import verl
        from verl.workers.rollout.base import get_rollout_class
        from verl.workers.rollout.replica import get_rollout_replica_class
        print(get_rollout_class("hf", "async").__name__, get_rollout_replica_class("hf").__name__)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["HFServerAdapter", "HFReplica"]
