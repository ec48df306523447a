"""Update-stage time on CPU: verl's stock fsdp2 engine vs the augtree engine, side by side in one run.

    python benchmarks/engine_step_time.py [--repeats 3] [--model qwen2-small] [--micro-batch-size 2]

Both engines are verl's real engines (``augtree_verl.testing.harness``: our CPU platform, gloo, world
size 1, fp32) on one random-weight built-in model (``augtree_verl.models``). Two GRPO batches, each group's
samples contiguous as the ``augtree_sync`` trainer delivers them:

- prompt-heavy: 2 groups, prompt 1024, 8 responses of 64;
- response-heavy: 2 groups, prompt 64, 8 responses of 1024.

Per batch: ``train_batch`` (verl's update step: zero grads, ``forward_backward_batch``, optimizer step) and
``infer_batch`` (old log-probs, with entropy), the two engines alternating within each repetition; the
median of ``--repeats`` after one warm-up call each. This machine is shared: the ratios are the result, and
torch runs on ``--threads`` threads (default 1: with other jobs on the cores, multi-threaded kernels stall on
their slowest thread and times swing by several x).

On CPU the stock engine runs each packed (remove-padding) micro-batch through SDPA, which has no varlen kernel:
its attention spans the whole packed micro-batch under a mask rather than each sequence, so stock loses more
to attention here than with flash varlen kernels on a GPU (benchmarks/gpu_check.py times replay vs flattened there).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from verl.utils import tensordict_utils as tu

from augtree_verl.models import BUILTIN_MODELS, DEFAULT_MODEL, load_model
from augtree_verl.testing import harness as H

# name: (prompt length, response length, responses per group, groups)
BATCHES = {"prompt-heavy": (1024, 64, 8, 2), "response-heavy": (64, 1024, 8, 2)}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def train_step(engine, loss_fn, batch):
    with engine.train_mode():
        return engine.train_batch(batch.clone(), loss_function=loss_fn)


def infer(engine, batch):
    batch = batch.clone()
    tu.assign_non_tensor(batch, calculate_entropy=True)
    with engine.eval_mode():
        return engine.infer_batch(batch, loss_function=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per engine and pass, after one warm-up")
    parser.add_argument("--model", choices=sorted(BUILTIN_MODELS), default=DEFAULT_MODEL)
    parser.add_argument("--micro-batch-size", type=int, default=2, help="verl's micro_batch_size_per_gpu (rows)")
    parser.add_argument("--batch", choices=sorted(BATCHES), action="append", help="run only these batches")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    for name, (p, r, g, groups) in BATCHES.items():
        if (g * groups) % args.micro_batch_size:
            raise ValueError(f"--micro-batch-size {args.micro_batch_size} must divide the {g * groups} rows of {name}")
    if args.repeats < 1 or args.threads < 1:
        raise ValueError(f"--repeats and --threads must be >= 1, got {args.repeats} and {args.threads}")
    torch.set_num_threads(args.threads)

    H.use_cpu_platform()
    H.init_process_group()
    model_path = tempfile.mkdtemp(prefix="augtree-step-time-")
    load_model(args.model).save_pretrained(model_path)
    engines = {strategy: H.build_engine(strategy, model_path) for strategy in ("fsdp2", "augtree")}
    import augtree_verl.integration.engine as ours
    print(f"model {args.model}, verl micro-batch {args.micro_batch_size} rows, {args.threads} torch thread(s), "
          f"augtree engine from {ours.__file__}")
    print(f"{'batch':16}{'pass':7}{'stock s':>9}{'augtree s':>11}{'stock/augtree':>15}")
    for name, (p, r, g, groups) in BATCHES.items():
        if args.batch and name not in args.batch:
            continue
        batch = H.rows_to_batch(H.group_rows([(p, [r] * g)] * groups), micro_batch_size=args.micro_batch_size)
        H.set_old_log_probs(batch, H.response_logps(infer(engines["fsdp2"][0], batch), batch))
        passes = {"train": lambda e: train_step(e[0], e[1], batch), "infer": lambda e: infer(e[0], batch)}
        for pass_name, run in passes.items():
            times = {strategy: [] for strategy in engines}
            for strategy, engine in engines.items():
                run(engine)  # warm-up
            for _ in range(args.repeats):
                for strategy, engine in engines.items():
                    times[strategy].append(timed(lambda: run(engine)))
            stock, augtree = (statistics.median(times[s]) for s in ("fsdp2", "augtree"))
            print(f"{name:16}{pass_name:7}{stock:>9.3f}{augtree:>11.3f}{stock / augtree:>14.2f}x", flush=True)


if __name__ == "__main__":
    main()
