"""What ``augtree bench`` shows: the results table, the JSON file, the PNG plot."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from augtree_verl.bench.methods import DEPTH1, SPLIT_PRIMITIVES, VERL_FSDP2
from augtree_verl.bench.runner import MethodResult, paired_ratio

JSON_KEYS = (
    "workload",
    "method",
    "step_time_s",
    "predicted_s",
    "executed_tokens",
    "logical_tokens",
    "comm_bytes",
    "peak_bytes",
    "max_grad_rel_err",
    "plan",
)


def format_table(results: Sequence[MethodResult]) -> str:
    """One row per workload and method; "peak/rank" is the largest rank's peak bytes held (``peak_bytes``)."""
    header = (
        "workload",
        "method",
        "step s",
        "vs MegaN",
        "executed/logical tok",
        "bytes moved",
        "peak/rank",
        "plan",
        "max grad err",
        "",
    )
    rows = [header]
    for r in results:
        rows.append(
            (
                r.workload,
                r.method,
                f"{r.step_time_s:.3f}",
                f"{r.speedup_vs_megan:.2f}x",
                f"{r.executed_tokens:,}/{r.logical_tokens:,}",
                _bytes(r.comm_bytes) if r.comm_counted else "not counted",
                _bytes(r.max_peak_bytes),
                r.plan,
                _errors(r),
                "WRONG" if r.wrong else "ok",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
    return "\n".join(lines)


def _errors(r: MethodResult) -> str:
    """The gradient error, and for verl-fsdp2 its log-prob error too (both against the flattened baseline)."""
    text = f"{r.max_grad_rel_err:.1e}"
    return text if r.max_logp_rel_err is None else f"{text} (logp {r.max_logp_rel_err:.1e})"


def format_ideal(results: Sequence[MethodResult]) -> str:
    """Per workload: the ideal FLOP-count speedup of prompt reuse and what AugTree reached of it, and how the
    planner's choice compares with the best forced primitive (paired per round; 1.00x = as fast). The shared
    workloads' ideals are ``format_shared``'s."""
    lines = []
    for workload in dict.fromkeys(r.workload for r in results if r.ideal_trie is None):
        rows = {r.method: r for r in results if r.workload == workload}
        aug = rows.get("AugTree")
        ideal = next(iter(rows.values())).ideal_speedup
        reached = f", AugTree reached {aug.speedup_vs_megan / ideal:.0%} of it" if aug else ""
        forced = [r for name, r in rows.items() if name in [f"AugTree[{p}]" for p in SPLIT_PRIMITIVES]]
        if aug and forced:
            best = max(forced, key=lambda f: paired_ratio(aug, f))
            same = " (the same plan)" if best.plan == aug.plan else ""
            reached += (
                f"; planner's choice takes {paired_ratio(aug, best):.2f}x the time of the best forced "
                f"primitive, {best.method}{same}"
            )
        lines.append(f"{workload}: ideal FLOP-count speedup of prompt reuse over flattened {ideal:.2f}x{reached}")
    return "\n".join(lines)


def format_shared(results: Sequence[MethodResult]) -> str:
    """Per shared workload (sharing beyond the group): the ideal FLOP ratios over flattened of the trie, of
    depth-1 reuse and of each group's prompt run once per group, and AugTree's and AugTree[depth-1]'s
    speedups over verl-fsdp2 and over depth-1 reuse (paired per round)."""
    lines = []
    for workload in dict.fromkeys(r.workload for r in results if r.ideal_trie is not None):
        rows = {r.method: r for r in results if r.workload == workload}
        first = next(iter(rows.values()))
        parts = []
        for name in ("AugTree", DEPTH1.name):
            if name in rows:
                over = [
                    f"{paired_ratio(rows[base], rows[name]):.2f}x over {base}"
                    for base in (VERL_FSDP2.name, DEPTH1.name)
                    if base in rows and base != name
                ]
                parts.append(f"{name} " + ", ".join(over))
        lines.append(
            f"{workload}: ideal FLOP ratio over flattened: trie {first.ideal_trie:.2f}x, depth-1 "
            f"{first.ideal_depth1:.2f}x, prompt once per group {first.ideal_speedup:.2f}x; measured: "
            + "; ".join(parts)
        )
    return "\n".join(lines)


def format_prediction(results: Sequence[MethodResult]) -> str:
    """Per workload: the median over AugTree methods of |predicted - measured| / measured step time."""
    lines = []
    for workload in dict.fromkeys(r.workload for r in results):
        errors = [r.prediction_error for r in results if r.workload == workload and r.prediction_error is not None]
        if errors:
            lines.append(
                f"{workload}: planner's predicted step time off by {statistics.median(errors):.0%} "
                f"(median over {len(errors)} AugTree method(s) of |predicted - measured| / measured)"
            )
    return "\n".join(lines)


def write_json(results: Sequence[MethodResult], path: str | Path, config: dict) -> None:
    rows = []
    for r in results:
        full = r.to_dict()
        rows.append({**{k: full[k] for k in JSON_KEYS}, **{k: v for k, v in full.items() if k not in JSON_KEYS}})
    Path(path).write_text(json.dumps({"config": config, "results": rows}, indent=1) + "\n")


def write_plot(results: Sequence[MethodResult], path: str | Path, title: str) -> None:
    """One column per workload: step time per method (top, with speedup vs MegaN), bytes moved (middle) and the
    largest rank's peak bytes held (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    methods = list(dict.fromkeys(r.method for r in results))
    colors = {m: f"C{k}" for k, m in enumerate(methods)}
    fig, axes = plt.subplots(3, len(workloads), figsize=(2.2 + 2.6 * len(workloads), 9.0), squeeze=False)
    for col, workload in enumerate(workloads):
        rows = [r for r in results if r.workload == workload]
        xs = range(len(rows))
        ax_t, ax_b, ax_m = axes[0][col], axes[1][col], axes[2][col]
        bars = ax_t.bar(xs, [r.step_time_s for r in rows], color=[colors[r.method] for r in rows])
        for bar, r in zip(bars, rows):
            label = "WRONG" if r.wrong else f"{r.speedup_vs_megan:.2f}x"
            ax_t.annotate(
                label,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
                color="red" if r.wrong else "black",
            )
        ax_t.set_title(f"{workload} (ideal {rows[0].ideal_speedup:.2f}x)", fontsize=9)
        ax_b.bar(xs, [r.comm_bytes / 2**20 for r in rows], color=[colors[r.method] for r in rows])
        if not any(r.comm_bytes for r in rows):
            ax_b.text(0.5, 0.5, "no communication", ha="center", va="center", transform=ax_b.transAxes, fontsize=8)
            ax_b.set_yticks([])
        ax_m.bar(xs, [r.max_peak_bytes / 2**20 for r in rows], color=[colors[r.method] for r in rows])
        for ax in (ax_t, ax_b, ax_m):
            ax.set_xticks(list(xs), [r.method for r in rows], rotation=35, ha="right", fontsize=7)
            ax.tick_params(axis="y", labelsize=7)
            ax.margins(y=0.15)
    axes[0][0].set_ylabel("update step time (s, median)")
    axes[1][0].set_ylabel("bytes moved (MiB, all ranks)")
    axes[2][0].set_ylabel("peak held (MiB, largest rank)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
