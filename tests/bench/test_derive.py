"""The shipped length tables are exactly what ``derive.py`` makes from the shared data (when it is here)."""

import json
from pathlib import Path

import pytest

from augtree_verl.bench.derive import main as derive
from augtree_verl.bench.workloads import TABLES_DIR, WORKLOADS

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"


@pytest.mark.slow
@pytest.mark.skipif(not (DATA / "qwen2_5_tokenizer").is_dir(), reason="the shared data folder is not here")
@pytest.mark.timeout(300)
def test_tables_regenerate_identically(tmp_path):
    derive(["--data-dir", str(DATA), "--out-dir", str(tmp_path)])
    for name in WORKLOADS + ("agent",):
        assert json.loads((tmp_path / f"{name}.json").read_text()) == json.loads(
            (TABLES_DIR / f"{name}.json").read_text()
        ), name
