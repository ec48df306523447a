"""Bytes moved and time per CP primitive at d = 4 on gloo (CPU), for a prompt-heavy and a response-heavy group.

    python benchmarks/cp_comm.py [--degree 4] [--quick] [--out cp_comm.json]

Runs the real ``replay`` engine with CP plans (forward + loss + backward + delayed prompt backward) on ``--degree``
spawned gloo processes, one GRPO group per run, for RingCP and TreeMoveKV / MoveQ at several lane counts
(placement: response i -> (round i // s, lane i % s)). The model is a Qwen2-shaped one-layer model with
realistic attention heads (8 query / 2 K/V heads of 64, GQA 4:1 like Llama-3-8B) and a small MLP, so that
full-length groups (P=16384) run on 2 shared CPU cores: the numbers are per layer. For each run it prints the
bytes every rank sent (summed over ranks and the busiest rank, forward / backward, float32 K/V; the
log-prob exchange is listed apart), checks them against the analytic count (``augtree_verl.cp.bytes``), and
the wall time of the call (slowest rank). It then prints the analytic bytes for a Qwen2.5-7B-shaped model
(28 layers, 28 query / 4 K/V heads of 128, bf16) under the same plans. Times on this shared CPU machine are
indicative only; bytes are exact.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from augtree_verl import Plan, ReplayOptions, ReplayStats, StepPlan, Tree, per_response, replay
from augtree_verl.cp.bytes import AttentionShape, analytic_bytes
from augtree_verl.replay.cp_tree import SCORE_EXCHANGE

CONFIG = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=512,
    num_hidden_layers=1,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
    attn_implementation="sdpa",
)
QWEN25_7B = AttentionShape(layers=28, heads=28, kv_heads=4, head_dim=128, element_size=2)
GROUPS = {"prompt-heavy": (16384, 256, 8), "response-heavy": (512, 4096, 8)}


def plans_for(d: int, g: int) -> dict[str, Plan]:
    plans = {"ring": Plan(degree=d, primitive="ring")}
    for primitive in ("tree_move_kv", "move_q"):
        for s in sorted({2, d}):
            if s <= d and (primitive != "tree_move_kv" or d % s == 0):
                placement = tuple((i // s, i % s) for i in range(g))
                plans[f"{primitive} s={s}"] = Plan(
                    degree=d, primitive=primitive, rounds=-(-g // s), lanes=s, placement=placement
                )
    return plans


def _rank_main(rank, world, port, groups, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).float().train()
    shape = AttentionShape.of(model.config, 4)
    loss_fn = lambda t, i, logp: -logp.mean()
    for name, (p, r, g) in groups.items():
        gen = torch.Generator().manual_seed(1)
        ids = lambda n: torch.randint(0, CONFIG["vocab_size"], (n,), generator=gen)
        tree = Tree.of_tokens(ids(p), [ids(r) for _ in range(g)])
        for label, plan in plans_for(world, g).items():
            stats = ReplayStats()
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            replay(model, StepPlan.build([tree], plans=[plan]), per_response(loss_fn), ReplayOptions(stats=stats))
            elapsed = time.perf_counter() - start
            want = analytic_bytes(plan, p, tree.response_lens, rank, shape)
            got = {k: stats.comm_bytes.get(f"{plan.primitive}/{k}", 0) for k in ("fwd", "bwd")}
            assert got == want, f"rank {rank} {name} {label}: measured {got} != analytic {want}"
            row = dict(
                group=name,
                plan=label,
                rank=rank,
                seconds=elapsed,
                fwd=got["fwd"],
                bwd=got["bwd"],
                logp=stats.comm_bytes.get(f"{SCORE_EXCHANGE}/fwd", 0),
                executed_tokens=stats.executed_tokens,
            )
            rows = [None] * world
            dist.all_gather_object(rows, row)
            if rank == 0:
                queue.put(rows)
    dist.destroy_process_group()


def summarise(rows: list[dict]) -> dict:
    return dict(
        group=rows[0]["group"],
        plan=rows[0]["plan"],
        seconds=max(r["seconds"] for r in rows),
        fwd_total=sum(r["fwd"] for r in rows),
        bwd_total=sum(r["bwd"] for r in rows),
        max_rank=max(r["fwd"] + r["bwd"] for r in rows),
        logp_total=sum(r["logp"] for r in rows),
        executed_tokens=sum(r["executed_tokens"] for r in rows),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--degree", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="lengths / 8 (a smoke run)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    groups = {k: ((p // 8, r // 8, g) if args.quick else (p, r, g)) for k, (p, r, g) in GROUPS.items()}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, args.degree, port, groups, queue)) for r in range(args.degree)]
    for proc in procs:
        proc.start()
    runs = sum(len(plans_for(args.degree, g)) for _, _, g in groups.values())
    results = [summarise(queue.get(timeout=3600)) for _ in range(runs)]
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"a rank failed with exit code {proc.exitcode}")

    mib = 2**20
    print(f"d={args.degree} gloo, one layer: 8 q / 2 kv heads x 64, float32; bytes measured == analytic on every rank")
    print(
        f"{'group':15}{'plan':17}{'fwd MiB':>10}{'bwd MiB':>10}{'total MiB':>11}{'vs ring':>9}"
        f"{'busiest MiB':>13}{'time s':>8}{'tokens':>9}"
    )
    # tokens: tokens run through the model, summed over ranks (prompt once per lane / group, or per response)
    for res in results:
        ring = next(x for x in results if x["group"] == res["group"] and x["plan"] == "ring")
        total = res["fwd_total"] + res["bwd_total"]
        ratio = f"{(ring['fwd_total'] + ring['bwd_total']) / total:.1f}x" if total else "no comm"
        print(
            f"{res['group']:15}{res['plan']:17}{res['fwd_total'] / mib:10.1f}{res['bwd_total'] / mib:10.1f}"
            f"{total / mib:11.1f}{ratio:>9}{res['max_rank'] / mib:13.1f}{res['seconds']:8.1f}"
            f"{res['executed_tokens']:9d}"
        )
    print(f"\nanalytic bytes, Qwen2.5-7B-shaped (28 layers, 28 q / 4 kv heads x 128, bf16), d={args.degree}:")
    print(f"{'group':15}{'plan':17}{'total GiB':>11}{'vs ring':>9}")
    for name, (p, r, g) in groups.items():
        totals = {}
        for label, plan in plans_for(args.degree, g).items():
            b = [analytic_bytes(plan, p, [r] * g, rank, QWEN25_7B) for rank in range(args.degree)]
            totals[label] = sum(x["fwd"] + x["bwd"] for x in b)
        for label, total in totals.items():
            ratio = f"{totals['ring'] / total:.1f}x" if total else "no comm"
            print(f"{name:15}{label:17}{total / 2**30:11.2f}{ratio:>9}")
            results.append(dict(group=name, plan=label, qwen25_7b_bf16_total_bytes=total))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(degree=args.degree, groups=groups, results=results), f, indent=1)


if __name__ == "__main__":
    main()
