"""Update-stage time on CPU: verl's stock fsdp2 engine vs the augtree engine, side by side in one run.

    python benchmarks/engine_step_time.py [--repeats 3] [--model qwen2-small] [--setting rows-1 ...]
        [--loss-agg-mode token-mean]

Both engines are verl's real engines (``augtree_verl.testing.harness``: our CPU platform, gloo, world
size 1, fp32) on one random-weight built-in model (``augtree_verl.models``). Two GRPO batches, each group's
samples contiguous as the ``augtree_sync`` trainer delivers them:

- prompt-heavy: 2 groups, prompt 1024, 8 responses of 64;
- response-heavy: 2 groups, prompt 64, 8 responses of 1024.

Per verl micro-batch setting (the same for both engines): ``rows-1`` and ``rows-2`` (``micro_batch_size_per_gpu``
1 and 2) and ``dynamic`` (dynamic batch size with ``max_token_len_per_gpu`` = one sequence's tokens, P + R).
Per batch: ``train_batch`` (verl's update step: zero grads, ``forward_backward_batch``, optimizer step) and
``infer_batch`` (old log-probs, with entropy), the two engines alternating within each repetition; the
median of ``--repeats`` after one warm-up call each. This machine is shared: the ratios are the result, and
torch runs on ``--threads`` threads (default 1: with other jobs on the cores, multi-threaded kernels stall on
their slowest thread and times swing by several x).

On CPU the stock engine runs each packed (remove-padding) micro-batch through SDPA, which has no varlen kernel:
its attention spans the whole packed micro-batch under a mask rather than each sequence, so stock loses more
to attention here than with flash varlen kernels on a GPU (benchmarks/gpu_check.py times replay vs flattened there);
with one row per micro-batch (``rows-1``, ``dynamic``) there is nothing to span, each engine at its best.
The last lines give, per batch, the train ratio at one row per micro-batch over the ratio at two rows, both
against stock at the same setting and against stock at its best setting (its fastest train time over the
settings run): the augtree engine prefills each prompt once per step whatever the micro-batch size, so its own
time, and the second quotient, stay near 1; the first also moves with stock's packed-SDPA penalty at 2 rows.

``--loss-agg-mode``: verl's ``actor.loss_agg_mode`` for both engines; ``seq-mean-token-sum-norm`` (Dr. GRPO, without
``loss_scale_factor``) couples the rows of a loss call, so the augtree engine runs its scores first
(``integration.loss_calls``): the train ratio against ``token-mean``'s is that pass's cost.
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
from augtree_verl.testing import verl_batch

# name: (prompt length, response length, responses per group, groups)
BATCHES = {"prompt-heavy": (1024, 64, 8, 2), "response-heavy": (64, 1024, 8, 2)}
SETTINGS = ("rows-1", "rows-2", "dynamic")


def verl_settings(setting: str, sequence_tokens: int) -> dict:
    """verl's micro-batch knobs for ``setting`` (see the module docstring)."""
    if setting == "dynamic":
        return dict(use_dynamic_bsz=True, max_token_len_per_gpu=sequence_tokens)
    return dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=int(setting.split("-")[1]))


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
    parser.add_argument("--setting", choices=SETTINGS, action="append", help="run only these micro-batch settings")
    parser.add_argument("--batch", choices=sorted(BATCHES), action="append", help="run only these batches")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--loss-agg-mode", default="token-mean", help="verl's actor.loss_agg_mode, both engines")
    args = parser.parse_args()
    if args.repeats < 1 or args.threads < 1:
        raise ValueError(f"--repeats and --threads must be >= 1, got {args.repeats} and {args.threads}")
    torch.set_num_threads(args.threads)

    H.use_cpu_platform()
    H.init_process_group()
    model_path = tempfile.mkdtemp(prefix="augtree-step-time-")
    load_model(args.model).save_pretrained(model_path)
    engines = {
        strategy: H.build_engine(strategy, model_path, loss_agg_mode=args.loss_agg_mode)
        for strategy in ("fsdp2", "augtree")
    }
    import augtree_verl.integration.engine as ours

    print(
        f"model {args.model}, loss_agg_mode {args.loss_agg_mode}, {args.threads} torch thread(s), augtree engine "
        f"from {ours.__file__}"
    )
    print(f"{'batch':16}{'setting':9}{'pass':7}{'stock s':>9}{'augtree s':>11}{'stock/augtree':>15}")
    ratios, train_s = {}, {}
    for name, (p, r, g, groups) in BATCHES.items():
        if args.batch and name not in args.batch:
            continue
        rows = H.group_rows([(p, [r] * g)] * groups)
        for setting in args.setting or SETTINGS:
            batch = verl_batch.rows_to_batch(rows, **verl_settings(setting, p + r))
            H.set_old_log_probs(batch, H.response_logps(infer(engines["fsdp2"][0], batch), batch))
            passes = {"train": lambda e: train_step(e[0], e[1], batch), "infer": lambda e: infer(e[0], batch)}
            for pass_name, run in passes.items():
                times = {strategy: [] for strategy in engines}
                for engine in engines.values():
                    run(engine)  # warm-up
                for _ in range(args.repeats):
                    for strategy, engine in engines.items():
                        times[strategy].append(timed(lambda: run(engine)))
                stock, augtree = (statistics.median(times[s]) for s in ("fsdp2", "augtree"))
                ratios[(name, setting, pass_name)] = stock / augtree
                if pass_name == "train":
                    train_s[(name, setting)] = (stock, augtree)
                print(
                    f"{name:16}{setting:9}{pass_name:7}{stock:>9.3f}{augtree:>11.3f}{stock / augtree:>14.2f}x",
                    flush=True,
                )
        if ("rows-1" in (args.setting or SETTINGS)) and ("rows-2" in (args.setting or SETTINGS)):
            best = min(stock for (batch_name, _), (stock, _) in train_s.items() if batch_name == name)
            at_best = {s: best / train_s[(name, s)][1] for s in ("rows-1", "rows-2")}
            print(
                f"{name}: train ratio at 1 row / at 2 rows = "
                f"{ratios[(name, 'rows-1', 'train')] / ratios[(name, 'rows-2', 'train')]:.2f} (stock at the same "
                f"setting); {at_best['rows-1']:.2f}x / {at_best['rows-2']:.2f}x = "
                f"{at_best['rows-1'] / at_best['rows-2']:.2f} (stock at its best, {best:.3f} s)"
            )


if __name__ == "__main__":
    main()
