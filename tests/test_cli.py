"""``augtree bench``'s command line: presets and flags (the console script itself runs in
``tests/bench/test_distributed.py``)."""

import pytest

from augtree_verl.bench.config import QUICK
from augtree_verl.bench.workloads import WORKLOADS
from augtree_verl.cli import _parser, bench_config, main


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
