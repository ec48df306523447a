"""augtree_verl.cpu_loop.compare on verl file-logger output: medians after the first step, ratios, the PNG."""

import json

import pytest

from augtree_verl.cpu_loop.compare import TIMINGS, main, medians, read_steps, summary


def _write(path, steps):
    lines = [json.dumps({"step": i + 1, "data": d}) + "\n" for i, d in enumerate(steps)]
    path.write_text("".join(reversed(lines)))  # out of order: read_steps sorts by step
    return path


def _step(scale, reward=0.1):
    return {
        **{key: scale * (i + 1) for i, key in enumerate(TIMINGS)},
        "critic/score/mean": reward,
        "actor/pg_loss": 0.0,
    }


def test_medians_skip_the_first_step_and_ratios_are_to_the_first_run(tmp_path, capsys):
    stock = _write(tmp_path / "fsdp2.jsonl", [_step(100.0), _step(3.0), _step(5.0), _step(4.0)])
    ours = _write(tmp_path / "augtree.jsonl", [_step(100.0), _step(1.0), _step(2.0), _step(1.0)])
    assert medians(read_steps(stock)) == {key: 4.0 * (i + 1) for i, key in enumerate(TIMINGS)}
    text = summary({"fsdp2": read_steps(stock), "augtree": read_steps(ours)})
    assert "4.00x" in text and text.count("4.00x") == len(TIMINGS)
    main(["--out", str(tmp_path / "c.png"), f"fsdp2={stock}", f"augtree={ours}"])
    assert (tmp_path / "c.png").stat().st_size > 10_000 and "fsdp2/augtree" in capsys.readouterr().out


def test_shown_metrics_per_step_and_run(tmp_path, capsys):
    stock = _write(tmp_path / "fsdp2.jsonl", [_step(1.0)])
    ours = _write(tmp_path / "augtree.jsonl", [{**_step(1.0), "actor/augtree/trie/nodes": 6.0}])
    main(
        [
            "--out",
            str(tmp_path / "c.png"),
            f"fsdp2={stock}",
            f"augtree={ours}",
            "--show",
            "actor/augtree/trie/nodes",
            "critic/score/mean",
        ]
    )
    rows = capsys.readouterr().out.splitlines()
    header = next(i for i, row in enumerate(rows) if row.startswith("step"))
    assert rows[header + 1 : header + 3] == [
        f"{1:<6}{'fsdp2':<10}{'-':>18}{0.1:>18.6g}",
        f"{1:<6}{'augtree':<10}{6.0:>18.6g}{0.1:>18.6g}",
    ]


def test_read_steps_orders_by_step(tmp_path):
    steps = read_steps(_write(tmp_path / "a.jsonl", [_step(1.0, reward=r) for r in (0.1, 0.2, 0.3)]))
    assert [s["critic/score/mean"] for s in steps] == [0.1, 0.2, 0.3]


def test_bad_input_is_named(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl: no steps logged"):
        read_steps(tmp_path / "empty.jsonl")
    with pytest.raises(SystemExit, match="expected NAME=metrics.jsonl"):
        main(["--out", str(tmp_path / "x.png"), "nothing"])
