"""The ``augtree`` console script.

augtree bench [--workload all|longdoc|rag|chat|reasoning|agent|multiturn ...] [--budget B] [--group-size G] [--cp D]
              [--model NAME_OR_PATH] [--device cpu|cuda] [--quick] [--repeats N]
              [--json PATH] [--plot PATH] [--wandb]
"""

from __future__ import annotations

import argparse
import sys

from augtree_verl.bench.config import QUICK, BenchConfig
from augtree_verl.bench.workloads import ALL_WORKLOADS, DEFAULT_GROUPS, WORKLOADS
from augtree_verl.models import BUILTIN_MODELS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="augtree", description="augtree-verl tools")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser(
        "bench",
        help="benchmark the RL update step: MegaN, MegaR and AugTree side by side on real workload shapes",
        description="One full update step (forward + backward of a GRPO loss) per method and repetition, "
        "timed side by side; every method's gradients are checked against the flattened baseline.",
    )
    bench.add_argument(
        "--workload",
        "--workloads",
        nargs="+",
        default=["all"],
        choices=("all",) + ALL_WORKLOADS,
        help=f"workload regimes (default: all = {' '.join(WORKLOADS)}; agent and multiturn, "
        f"which share tokens beyond the group, run when named)",
    )
    bench.add_argument(
        "--budget",
        type=int,
        help=f"logical tokens per group, G*P + sum R_i "
        f"(default {BenchConfig.budget_tokens}; "
        f"--quick {QUICK['budget_tokens']})",
    )
    bench.add_argument(
        "--group-size",
        type=int,
        help=f"responses per prompt G (default {BenchConfig.group_size}; --quick {QUICK['group_size']})",
    )
    bench.add_argument(
        "--groups",
        type=int,
        help=f"groups (trees) per step (default 1; {', '.join(f'{k} {v}' for k, v in DEFAULT_GROUPS.items())})",
    )
    bench.add_argument(
        "--cp",
        type=int,
        help=f"context-parallel degree: spawns that many processes (default "
        f"{BenchConfig.cp}; 1 runs MegaN and AugTree in this process)",
    )
    bench.add_argument(
        "--model",
        help=f"built-in model ({', '.join(BUILTIN_MODELS)}; default {BenchConfig.model}, "
        f"--quick {QUICK['model']}) or a local Hugging Face checkpoint directory",
    )
    bench.add_argument("--device", choices=("cpu", "cuda"), help="cpu (default, gloo) or cuda (NCCL, flash-attn, bf16)")
    bench.add_argument(
        "--repeats",
        type=int,
        help=f"update steps per method, median reported (default {BenchConfig.repeats}; --quick {QUICK['repeats']})",
    )
    bench.add_argument("--seed", type=int, help="seed for weights, token ids and rewards (default 0)")
    bench.add_argument("--quick", action="store_true", help="a smaller run (about 3 minutes on 2 CPU cores)")
    bench.add_argument("--json", metavar="PATH", help="write the results as JSON")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG plot of step time and bytes moved")
    bench.add_argument("--wandb", action="store_true", help="log one W&B run per method (offline unless logged in)")
    return parser


def bench_config(args: argparse.Namespace) -> BenchConfig:
    given = {
        "budget_tokens": args.budget,
        "group_size": args.group_size,
        "num_groups": args.groups,
        "cp": args.cp,
        "model": args.model,
        "device": args.device,
        "repeats": args.repeats,
        "seed": args.seed,
        "workloads": tuple(
            dict.fromkeys(w for name in args.workload for w in (WORKLOADS if name == "all" else (name,)))
        ),
    }
    given = {k: v for k, v in given.items() if v is not None}
    return BenchConfig.quick(**given) if args.quick else BenchConfig(**given)


def bench(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from augtree_verl.bench import distributed, report

    cfg = bench_config(args)
    print(
        f"augtree bench: workloads={','.join(cfg.workloads)} budget={cfg.budget_tokens} G={cfg.group_size} "
        f"groups={cfg.num_groups or 'default'} cp={cfg.cp} model={cfg.model} device={cfg.device} "
        f"repeats={cfg.repeats}",
        flush=True,
    )
    results = distributed.run(cfg)
    print()
    print(report.format_table(results))
    print()
    print(report.format_ideal(results))
    if shared := report.format_shared(results):
        print(shared)
    print(report.format_prediction(results))
    config = asdict(cfg)
    if args.json:
        report.write_json(results, args.json, config)
        print(f"wrote {args.json}")
    if args.plot:
        report.write_plot(
            results,
            args.plot,
            title=f"augtree bench: model {cfg.model}, budget {cfg.budget_tokens}, "
            f"G={cfg.group_size}, cp={cfg.cp}, {cfg.device}",
        )
        print(f"wrote {args.plot}")
    if args.wandb:
        from augtree_verl.bench.wandb_log import log_runs

        print(f"wandb: logged one run per method ({log_runs(results, config)})")
    wrong = [f"{r.workload}/{r.method} ({r.max_grad_rel_err:.1e} > {r.tolerance:.0e})" for r in results if r.wrong]
    if wrong:
        print("WRONG: gradients disagree with the flattened baseline: " + ", ".join(wrong), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "bench":
            return bench(args)
    except ValueError as e:
        print(f"augtree {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
