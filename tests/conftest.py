import pytest


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """wandb in offline mode writing under ``tmp_path/wandb``.

    wandb keeps process-wide settings (its run directory among them) from its first setup; tearing it
    down before and after lets each test's WANDB_DIR take effect, whatever ran before.
    """
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()
    yield tmp_path / "wandb"
    wandb.teardown()
