"""The benchmark run in-process on one device (real model, real engine), and what it writes."""

import json
import math
import statistics

import pytest
import torch

from augtree_verl.bench.report import JSON_KEYS, format_ideal, format_prediction, format_table, write_json, write_plot
from augtree_verl.bench.runner import FLOAT32_GRAD_RTOL, MethodResult, max_rel_err, paired_ratio


@pytest.mark.slow
def test_every_method_runs_every_workload_and_matches_the_baseline(results):
    assert [(r.workload, r.method) for r in results] == [
        (w, m) for w in ("rag", "chat") for m in ("MegaN", "AugTree", "verl-fsdp2")
    ]
    for r in results:
        assert len(r.step_times_s) == 2 and r.step_time_s > 0
        assert r.max_grad_rel_err <= FLOAT32_GRAD_RTOL and not r.wrong
        assert r.comm_bytes == 0
        assert len(r.peak_bytes) == 1 and r.max_peak_bytes > 0
    megan, aug = results[0], results[1]
    assert megan.plan == "flattened" and aug.plan == "single"
    assert megan.speedup_vs_megan == 1.0
    # rag is prompt-heavy: the grouped replay runs the prompt once (3 branches -> about a third of the tokens).
    assert megan.executed_tokens == megan.logical_tokens
    assert aug.executed_tokens < 0.5 * aug.logical_tokens
    assert results[0].ideal_speedup > 2.5


@pytest.mark.slow
def test_json_has_the_documented_keys(results, tmp_path):
    path = tmp_path / "r.json"
    write_json(results, path, config={"model": "qwen2-tiny"})
    data = json.loads(path.read_text())
    assert data["config"] == {"model": "qwen2-tiny"}
    assert len(data["results"]) == 6
    for row, r in zip(data["results"], results):
        assert list(row)[: len(JSON_KEYS)] == list(JSON_KEYS)
        assert (row["workload"], row["method"], row["plan"]) == (r.workload, r.method, r.plan)
        assert row["step_time_s"] == r.step_time_s and row["status"] == "ok"


@pytest.mark.slow
def test_plot_is_a_png(results, tmp_path):
    path = tmp_path / "r.png"
    write_plot(results, path, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


@pytest.mark.slow
def test_table_and_ideal_lines(results):
    table = format_table(results)
    assert table.count("\n") == 7 and "flattened" in table and "WRONG" not in table
    assert format_ideal(results).splitlines()[0].startswith("rag: ideal FLOP-count speedup")


def test_max_rel_err_is_relative_per_parameter_and_keeps_nan():
    ref = {"a": torch.tensor([10.0, -20.0]), "b": torch.tensor([0.001, 0.0])}
    assert max_rel_err({"a": torch.tensor([10.0, -20.2]), "b": torch.tensor([0.001, 0.0])}, ref) == pytest.approx(
        0.01, rel=1e-4
    )
    # A small tensor is judged against its own scale, not the largest parameter's.
    assert max_rel_err({"a": ref["a"], "b": torch.tensor([0.002, 0.0])}, ref) == pytest.approx(1.0)
    assert math.isnan(max_rel_err({"a": torch.tensor([float("nan"), 0.0]), "b": ref["b"]}, ref))


def test_a_method_beyond_tolerance_is_wrong():
    def result(err):
        return MethodResult(
            workload="rag",
            method="AugTree",
            step_times_s=[1.0],
            executed_tokens=1,
            logical_tokens=1,
            comm_bytes=0,
            max_grad_rel_err=err,
            plan="single",
            ideal_speedup=1.0,
            tolerance=FLOAT32_GRAD_RTOL,
            speedup_vs_megan=1.0,
        )

    assert not result(FLOAT32_GRAD_RTOL).wrong
    assert result(2 * FLOAT32_GRAD_RTOL).wrong and result(float("nan")).wrong
    assert "WRONG" in format_table([result(1.0)])


def test_cp_plans_of_the_fixed_methods():
    from augtree_verl.bench.methods import methods_for
    from augtree_verl.groups import Tree

    trees = [Tree.of_tokens(torch.arange(5), [torch.arange(3), torch.arange(2)])]
    by = {m.name: m for m in methods_for(4)}
    assert list(by) == [
        "MegaN",
        "MegaR",
        "AugTree",
        "AugTree[one device]",
        "AugTree[tree_move_kv]",
        "AugTree[move_q]",
        "verl-fsdp2",
    ]
    assert by["verl-fsdp2"].plans(trees, 4) is None and not by["verl-fsdp2"].planned
    assert "verl-fsdp2" not in [m.name for m in methods_for(4, device="cuda")]
    (ring,), (megar,) = by["MegaN"].plans(trees, 4), by["MegaR"].plans(trees, 4)
    assert (ring.primitive, ring.degree) == ("ring", 4)
    assert (megar.primitive, megar.lanes, megar.rounds, megar.placement) == ("tree_move_kv", 1, 2, ((0, 0), (1, 0)))
    (forced,) = by["AugTree[move_q]"].plans(trees, 4)
    assert forced.primitive == "move_q" and forced.degree == 4
    (one,) = by["AugTree[one device]"].plans(trees, 4)
    assert one.degree == 1 and by["AugTree[one device]"].planned
    assert [m.name for m in methods_for(1)] == ["MegaN", "AugTree", "verl-fsdp2"]
    assert by["MegaN"].plans(trees, 1) is None


def _timed(method, times, plan="p"):
    return MethodResult(
        workload="w",
        method=method,
        step_times_s=times,
        executed_tokens=1,
        logical_tokens=1,
        comm_bytes=0,
        max_grad_rel_err=0.0,
        plan=plan,
        ideal_speedup=2.0,
        tolerance=1e-5,
    )


def test_ratios_are_paired_per_round():
    """A round slowed down for every method (shared machine) must not move the ratios."""
    megan, aug = _timed("MegaN", [10.0, 40.0, 10.0]), _timed("AugTree", [5.0, 20.0, 5.0])
    assert paired_ratio(megan, aug) == 2.0
    assert statistics.median(megan.step_times_s) / statistics.median(aug.step_times_s) == 2.0
    megan, aug = _timed("MegaN", [10.0, 40.0, 12.0]), _timed("AugTree", [5.0, 5.0, 30.0])
    assert paired_ratio(megan, aug) == 2.0  # rounds: 2.0, 8.0, 0.4


def test_planner_choice_is_compared_with_the_best_forced_primitive():
    rows = [
        _timed("MegaN", [4.0, 4.0, 4.0]),
        _timed("AugTree", [1.1, 1.1, 1.1], plan="move_q"),
        _timed("AugTree[tree_move_kv]", [2.0, 2.0, 2.0], plan="tree"),
        _timed("AugTree[move_q]", [1.0, 1.0, 1.0], plan="move_q"),
    ]
    for r in rows:
        r.speedup_vs_megan = paired_ratio(rows[0], r)
    line = format_ideal(rows)
    assert "1.10x the time of the best forced primitive, AugTree[move_q] (the same plan)" in line


def test_augtree_rows_carry_the_planners_prediction(results, tmp_path):
    """Only AugTree methods are planned: their rows carry predicted_s and its error against the clock."""
    for r in results:
        if r.method in ("MegaN", "verl-fsdp2"):
            assert r.predicted_s is None and r.prediction_error is None
        else:
            assert r.predicted_s > 0
            assert r.prediction_error == pytest.approx(abs(r.predicted_s - r.step_time_s) / r.step_time_s)
    path = tmp_path / "r.json"
    write_json(results, path, config={})
    rows = json.loads(path.read_text())["results"]
    assert [row["predicted_s"] for row in rows] == [r.predicted_s for r in results]
    lines = format_prediction(results).splitlines()
    assert [line.split(":")[0] for line in lines] == ["rag", "chat"] and "median over 1 AugTree method" in lines[0]


def test_verl_fsdp2_runs_verls_engine_checked_on_gradients_and_log_probs(results):
    """verl's real engine ran (one sequence per micro-batch) and matched the flattened baseline."""
    for r in (r for r in results if r.method == "verl-fsdp2"):
        assert r.plan == "fsdp2(dp=1,mb=1)" and not r.comm_counted and r.step_time_s > 0
        assert r.executed_tokens == r.logical_tokens
        assert 0 <= r.max_logp_rel_err <= FLOAT32_GRAD_RTOL and r.max_grad_rel_err <= FLOAT32_GRAD_RTOL
        assert not r.wrong and "(logp " in format_table([r])


def test_a_wrong_log_prob_is_wrong():
    r = MethodResult(
        workload="rag",
        method="verl-fsdp2",
        step_times_s=[1.0],
        executed_tokens=1,
        logical_tokens=1,
        comm_bytes=0,
        max_grad_rel_err=0.0,
        plan="fsdp2(dp=1,mb=1)",
        ideal_speedup=1.0,
        tolerance=FLOAT32_GRAD_RTOL,
        speedup_vs_megan=1.0,
        max_logp_rel_err=2 * FLOAT32_GRAD_RTOL,
    )
    assert r.wrong and "WRONG" in format_table([r])
