"""Context parallelism inside the verl engine on CPU: stock fsdp2 vs augtree without and with CP, one run.

    python benchmarks/engine_cp_step_time.py [--repeats 3] [--model qwen2-small] [--primitive move_q] [--stock]

Two spawned ranks (gloo, 1 torch thread each), verl's real engines (``augtree_verl.testing.harness``),
one random-weight built-in model, fp32. The engines, on the same world and the same GRPO batch:

- ``stock`` (with ``--stock``; slow on CPU, see ``engine_step_time.py``): verl's fsdp2 engine, data-parallel 2;
  rank r gets rows r, r + 2, ... (verl's per-sample split);
- ``augtree dp``: our engine, ``cp_degrees=[1]``: data-parallel 2, each group whole on one rank, the heavier
  group on rank 0 (as the ``augtree_sync`` balance hands them out);
- ``augtree cp``: our engine, ``cp_degrees=[1, 2]``: one CP group of both ranks; each group with a prompt of
  at least ``--cp-min-prompt`` tokens runs context-parallel with the planner's plan for ``--primitive``
  at degree 2, the others on one rank each;
- ``augtree planned``: the same engine with the planner's own plan per group (degree 1 or 2, any
  primitive; its cost model calibrated on these two ranks at start, ``ClusterProfile.calibrate``), which
  the engine's step plan (``replay.step_plan.assign_subgroups``) may run side by side on one rank each instead.

Batches (prompt length, responses of 64 tokens per group):

- skewed: one long group (prompt 8192, 8 responses) and one short (prompt 256, 8 responses): data
  parallelism cannot balance one long group, context parallelism splits it;
- balanced: two groups with prompt 4096 and 8 responses each: data parallelism balances them already.

Per batch and pass (``train_batch``; ``infer_batch`` with entropy), one warm-up, then ``--repeats`` rounds with
the engines alternating; a step's time is the slower rank's. Printed: medians and their ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from augtree_verl.testing import harness as H

WORLD = 2
RESPONSE_LEN, GROUP_SIZE = 64, 8
BATCHES = {"skewed": [8192, 256], "balanced": [4096, 4096]}  # name: prompt length per group


def _batches(name: str, rank: int, primitive: str, min_prompt: int, profile) -> dict:
    """This rank's batch for each run."""
    from verl.utils import tensordict_utils as tu

    from augtree_verl.planner import plan_tree
    from augtree_verl.trainer import PLAN_FIELD, find_trees, plan_entries

    groups = [(p, [RESPONSE_LEN] * GROUP_SIZE) for p in BATCHES[name]]
    rows = H.group_rows(groups, seed=0)
    trees = find_trees([r["uid"] for r in rows], [len(r["prompt"]) for r in rows], [len(r["response"]) for r in rows])
    forced = {
        t.tree_id: plan_tree(t.prompt_len, t.response_lens, degrees=(2,), force_primitive=primitive)
        if t.prompt_len >= min_prompt
        else plan_tree(t.prompt_len, t.response_lens, degrees=(1,))
        for t in trees
    }
    planned = {t.tree_id: plan_tree(t.prompt_len, t.response_lens, degrees=(1, 2), profile=profile) for t in trees}
    mine = rows[rank::WORLD]
    group = [r for r in rows if r["uid"] == f"group-{rank}"]  # group 0 is the heavier one
    out = {
        "stock": H.rows_to_batch(mine, micro_batch_size=len(mine)),
        "augtree dp": H.rows_to_batch(group, micro_batch_size=len(group)),
    }
    for run, plans in (("augtree cp", forced), ("augtree planned", planned)):
        out[run] = H.rows_to_batch(
            rows, micro_batch_size=len(rows), extra={PLAN_FIELD: plan_entries(trees, plans, len(rows))}
        )
    if rank == 0:
        print(
            f"{name}: planner's per-group plans "
            + ", ".join(
                f"prompt {t.prompt_len}: {planned[t.tree_id].primitive} d={planned[t.tree_id].degree}" for t in trees
            ),
            flush=True,
        )
    for batch in out.values():
        tu.assign_non_tensor(batch, global_batch_size=len(rows))
        batch["old_log_probs"] = torch.nested.as_nested_tensor(
            [torch.full((RESPONSE_LEN,), -4.0) for _ in range(len(batch))], layout=torch.jagged
        )
    return out


def _rank_main(rank: int, port: int, model_path: str, args) -> None:
    torch.set_num_threads(1)
    H.use_cpu_platform()
    from verl.utils import tensordict_utils as tu

    from augtree_verl.models import load_model
    from augtree_verl.planner import ClusterProfile
    from augtree_verl.planner.calibrate import calibrate

    H.init_process_group(rank=rank, world_size=WORLD, port=port)
    model = load_model(args.model)
    profile = calibrate(
        dataclasses.replace(
            ClusterProfile.default().with_model(model.config), activation_checkpointing=False, dtype_bytes=4
        ),
        device="cpu",
        model=model,
    )
    del model
    engines = {"stock": H.build_engine("fsdp2", model_path)} if args.stock else {}
    engines["augtree dp"] = H.build_engine("augtree", model_path, engine_knobs={"cp_degrees": [1]})
    engines["augtree cp"] = engines["augtree planned"] = H.build_engine(
        "augtree", model_path, engine_knobs={"cp_degrees": [1, 2]}
    )
    names = list(engines)
    ratios = [(a, b) for a in names for b in names if names.index(a) < names.index(b)]

    def train(engine, batch):
        with engine[0].train_mode():
            return engine[0].train_batch(batch.clone(), loss_function=engine[1])

    def infer(engine, batch):
        batch = batch.clone()
        tu.assign_non_tensor(batch, calculate_entropy=True)
        with engine[0].eval_mode():
            return engine[0].infer_batch(batch, loss_function=None)

    if rank == 0:
        print(
            f"model {args.model}, {WORLD} ranks x 1 thread, CP plans: {args.primitive} at degree 2 for prompts "
            f">= {args.cp_min_prompt}"
        )
        print(
            f"{'batch':10}{'pass':7}"
            + "".join(f"{e + ' s':>19}" for e in names)
            + "".join(f"{a.split()[-1] + '/' + b.split()[-1]:>12}" for a, b in ratios),
            flush=True,
        )
    for name in BATCHES:
        if args.batch and name not in args.batch:
            continue
        batches = _batches(name, rank, args.primitive, args.cp_min_prompt, profile)
        for pass_name, run in (("train", train), ("infer", infer)):
            times, last = {e: [] for e in names}, {}
            for repeat in range(args.repeats + 1):
                for e in names:
                    dist.barrier()
                    start = time.perf_counter()
                    last[e] = run(engines[e], batches[e])
                    elapsed = torch.tensor(time.perf_counter() - start)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    if repeat:  # the first round warms up
                        times[e].append(elapsed.item())
            med = {e: statistics.median(times[e]) for e in names}
            if rank == 0 and pass_name == "train":
                degree = last["augtree planned"]["metrics"]["augtree/cp_degree_max"].aggregate()
                print(
                    f"{name}: the engine's schedule ran the planned batch at CP degree up to {degree:.0f}", flush=True
                )
            if rank == 0:
                print(
                    f"{name:10}{pass_name:7}"
                    + "".join(f"{med[e]:>19.3f}" for e in names)
                    + "".join(f"{med[a] / med[b]:>11.2f}x" for a, b in ratios),
                    flush=True,
                )
    dist.destroy_process_group()


def main() -> None:
    from augtree_verl.models import BUILTIN_MODELS, DEFAULT_MODEL, load_model
    from augtree_verl.plan import PRIMITIVES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up round")
    parser.add_argument("--model", choices=sorted(BUILTIN_MODELS), default=DEFAULT_MODEL)
    parser.add_argument("--primitive", choices=PRIMITIVES, default="move_q", help="CP primitive of the long groups")
    parser.add_argument("--cp-min-prompt", type=int, default=1024, help="groups with shorter prompts run without CP")
    parser.add_argument("--batch", choices=sorted(BATCHES), action="append", help="run only these batches")
    parser.add_argument("--stock", action="store_true", help="also run verl's stock fsdp2 engine (slow on CPU)")
    args = parser.parse_args()
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    model_path = tempfile.mkdtemp(prefix="augtree-cp-step-time-")
    load_model(args.model).save_pretrained(model_path)
    mp.start_processes(
        _rank_main, args=(H.free_port(), model_path, args), nprocs=WORLD, join=True, start_method="spawn"
    )


if __name__ == "__main__":
    main()
