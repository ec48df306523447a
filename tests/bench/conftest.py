import pytest

from augtree_verl.bench.config import BenchConfig
from augtree_verl.bench.runner import run_benchmark


@pytest.fixture(scope="session")
def results():
    """A real one-device benchmark run: a tiny model on a prompt-heavy and a chat workload, 2 repetitions."""
    cfg = BenchConfig(workloads=("rag", "chat"), budget_tokens=600, group_size=3, cp=1, model="qwen2-tiny", repeats=2)
    return run_benchmark(cfg)
