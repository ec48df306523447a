"""Step times, reward and loss of verl runs side by side, from verl's file logger (one JSONL per run).

``python -m augtree_verl.cpu_loop.compare --out compare.png fsdp2=fsdp2.jsonl augtree=augtree.jsonl`` plots
``timing_s/update_actor``, ``timing_s/old_log_prob``, ``timing_s/step``, the mean reward and the policy
loss per step for each run, and prints each timing's median over the steps after the first (which includes
start-up costs) with the ratio to the first run; ``--show KEY ...`` also prints those metrics per step and run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

TIMINGS = ("timing_s/update_actor", "timing_s/old_log_prob", "timing_s/step")
CURVES = ("critic/score/mean", "actor/pg_loss")


def read_steps(path: Path) -> list[dict]:
    """Per-step metrics of one run, in step order (verl's file logger: ``{"step": k, "data": {...}}`` lines)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no steps logged")
    return [row["data"] for row in sorted(rows, key=lambda row: row["step"])]


def medians(steps: list[dict], keys=TIMINGS) -> dict[str, float]:
    """Median of each key over the steps after the first (all steps if there is only one)."""
    measured = steps[1:] or steps
    return {key: statistics.median(step[key] for step in measured) for key in keys}


def summary(runs: dict[str, list[dict]]) -> str:
    """A text table: each timing's median per run and its ratio to the first run's."""
    names = list(runs)
    table = {name: medians(steps) for name, steps in runs.items()}
    lines = [
        f"{'median s (steps 2+)':<24}"
        + "".join(f"{name:>12}" for name in names)
        + "".join(f"{names[0] + '/' + name:>18}" for name in names[1:])
    ]
    for key in TIMINGS:
        lines.append(
            f"{key:<24}"
            + "".join(f"{table[name][key]:>12.3f}" for name in names)
            + "".join(f"{table[names[0]][key] / table[name][key]:>17.2f}x" for name in names[1:])
        )
    return "\n".join(lines)


def shown(runs: dict[str, list[dict]], keys: list[str]) -> str:
    """A text table: each key's value per step for each run ("-" where a run did not log it)."""
    lines = [f"{'step':<6}{'run':<10}" + "".join(f"{key.rsplit('/', 1)[-1]:>18}" for key in keys)]
    for name, steps in runs.items():
        for step, metrics in enumerate(steps, 1):
            lines.append(
                f"{step:<6}{name:<10}"
                + "".join(f"{metrics[key]:>18.6g}" if key in metrics else f"{'-':>18}" for key in keys)
            )
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], out: Path) -> Path:
    """One panel per timing and curve, one line per run; written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = TIMINGS + CURVES
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for ax, key in zip(axes, keys):
        for name, steps in runs.items():
            ax.plot(range(1, len(steps) + 1), [step[key] for step in steps], marker="o", label=name)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="NAME=metrics.jsonl, the first is the baseline of the ratios")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--show", nargs="+", default=[], metavar="KEY", help="metrics to print per step and run")
    args = parser.parse_args(argv)
    runs = {}
    for spec in args.runs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"expected NAME=metrics.jsonl, got {spec!r}")
        runs[name] = read_steps(Path(path))
    print(summary(runs))
    if args.show:
        print(shown(runs, args.show))
    print(f"plot: {plot(runs, args.out)}")


if __name__ == "__main__":
    main()
