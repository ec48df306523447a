import pytest

from augtree_verl.bench.wandb_log import log_runs


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_one_offline_run_per_method(results, wandb_offline):
    assert log_runs(results, {"model": "qwen2-tiny"}) == "offline"
    runs = sorted(wandb_offline.glob("offline-run-*"))
    assert len(runs) == len({r.method for r in results}) == 3
    for run in runs:
        assert any(run.rglob("*.wandb"))
