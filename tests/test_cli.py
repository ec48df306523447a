"""``augtree bench`` as users run it: the console script in a subprocess."""

import json
import shutil
import subprocess
import sys

import pytest

from augtree_verl.bench.config import QUICK
from augtree_verl.bench.methods import methods_for
from augtree_verl.bench.workloads import WORKLOADS
from augtree_verl.cli import _parser, bench_config, main


def _augtree() -> list[str]:
    exe = shutil.which("augtree")
    return [exe] if exe else [sys.executable, "-m", "augtree_verl.cli"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_smoke_run_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    # --quick with a tiny budget so the test stays short; the default --quick covers all workloads.
    proc = subprocess.run(
        _augtree()
        + [
            "bench",
            "--quick",
            "--workload",
            "chat",
            "--budget",
            "512",
            "--group-size",
            "2",
            "--repeats",
            "1",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MegaN" in proc.stdout and "AugTree" in proc.stdout and "ideal FLOP-count speedup" in proc.stdout
    assert "augtree bench" in proc.stderr  # the progress bar
    rows = json.loads(out.read_text())["results"]
    # The default CP degree is 2: every method runs, on two gloo ranks.
    assert [r["method"] for r in rows] == [m.name for m in methods_for(2)]  # the list tests/bench pins
    assert rows[3]["plan"] == "single" and all(len(r["peak_bytes"]) == 2 for r in rows)
    assert rows[-1]["plan"] == "fsdp2(dp=2,mb=1)" and rows[-1]["max_logp_rel_err"] <= 1e-5
    assert all(r["status"] == "ok" and r["max_grad_rel_err"] <= 1e-5 for r in rows)
    assert rows[0]["plan"] == "ring(d=2)" and rows[0]["comm_bytes"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_quick_presets_yield_to_explicit_flags():
    cfg = bench_config(_parser().parse_args(["bench", "--quick", "--budget", "999", "--workload", "rag"]))
    assert cfg.budget_tokens == 999 and cfg.workloads == ("rag",)
    assert (cfg.group_size, cfg.model, cfg.repeats) == (QUICK["group_size"], QUICK["model"], QUICK["repeats"])
    assert bench_config(_parser().parse_args(["bench"])).workloads == WORKLOADS


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budget", "3"], "budget_tokens must be an int of at least"),
        (["--group-size", "0"], "group_size must be a positive int, got 0"),
        (["--cp", "0"], "cp must be a positive int, got 0"),
        (["--model", "no-such-model"], "'no-such-model' is neither a built-in model"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(argv, message, capsys):
    assert main(["bench", "--workload", "chat", "--repeats", "1", "--model", "qwen2-tiny"] + argv) == 2
    assert message in capsys.readouterr().err
