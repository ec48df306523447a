"""A batch behind one long system prompt on a CP group of 2 (gloo, CPU): its root context-parallel against the
chunks, side by side.

    python benchmarks/cp_trie.py [--system 4096] [--groups 4] [--responses 4] [--response-len 128] [--repeats 3]

The batch: ``--groups`` prompts of 64 tokens behind one ``--system``-token system prompt, ``--responses``
responses of ``--response-len`` tokens each (seeded random ids). One training step (forward, GRPO-like loss,
backward, delayed prompt backwards) of the real ``replay`` engine on 2 spawned gloo ranks, per arrangement:

- chunks: no CP plan, no cost model: the trie cut into a chunk per rank (``pack_subgroups``), each rank
  prefilling the system prompt for its chunk;
- CP root: the trie whole with its root context-parallel over both ranks (``replay.cp_trie``): the system prompt
  prefilled once, its K/V all-gathered, the groups dealt over the ranks.

Printed per arrangement: the median step time (slowest rank), tokens each rank ran, bytes moved, the maximum
relative difference of the summed gradients from the chunks' (both are exact; this shows they agree), and what
the planner's cost model predicts for each, calibrated on this machine at start-up as the engine's run profile
is, and the arrangement it picks (``StepPlan.build(trie_cost=...)``). The model: Qwen2-shaped, 2 layers of hidden 512 (8
query / 2 K/V heads of 64), so that a 4k-token prefill runs in seconds on 2 shared cores; times are indicative.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from augtree_verl import Plan, ReplayOptions, ReplayStats, StepPlan, Tree, per_response, replay
from augtree_verl.cp.mesh import CPMesh
from augtree_verl.planner import ClusterProfile
from augtree_verl.planner.calibrate import calibrate
from augtree_verl.planner.cost import cost_model, step_seconds

CONFIG = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
    attn_implementation="sdpa",
)
WORLD = 2
ARRANGEMENTS = ("chunks", "CP root")


def batch(system: int, groups: int, responses: int, response_len: int) -> list[Tree]:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, CONFIG["vocab_size"], (n,), generator=g)
    prefix = ids(system)
    return [
        Tree.of_tokens(torch.cat([prefix, ids(64)]), [ids(response_len) for _ in range(responses)])
        for _ in range(groups)
    ]


def plans_for(arrangement: str, trees: list[Tree]) -> list[Plan | None]:
    return [Plan(degree=WORLD) if arrangement == "CP root" else None for _ in trees]


def _rank_main(rank: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=30))
    torch.set_num_threads(1)  # one core per rank
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).float()
    trees = batch(args.system, args.groups, args.responses, args.response_len)
    # The planner's cost model of this machine (collective: both ranks get the same figures), as the engine's.
    base = dataclasses.replace(
        ClusterProfile.default().with_model(model.config), dtype_bytes=4, activation_checkpointing=False
    )
    profile = calibrate(base, device=torch.device("cpu"), model=model)
    g = torch.Generator().manual_seed(1)
    adv = [torch.randn(len(t.responses), generator=g).tolist() for t in trees]
    loss = per_response(lambda t, i, logp: -(logp * adv[t][i]).mean())
    out, reference = {}, None
    for arrangement in ARRANGEMENTS:
        times = []
        for _ in range(args.repeats + 1):  # the first is a warm-up
            model.zero_grad(set_to_none=True)
            stats = ReplayStats()
            dist.barrier()
            start = time.perf_counter()
            step_plan = StepPlan.build(trees, plans=plans_for(arrangement, trees), mesh=CPMesh.whole_world())
            replay(model, step_plan, loss, ReplayOptions(stats=stats))
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(elapsed.item())
        grads = torch.cat(
            [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()]
        )
        dist.all_reduce(grads)
        reference = grads if arrangement == "chunks" else reference
        out[arrangement] = dict(
            seconds=statistics.median(times[1:]),
            tokens=stats.executed_tokens,
            bytes=stats.total_comm_bytes,
            roots=len(step_plan.cp_roots),
            grad_diff=((grads - reference).abs().max() / reference.abs().max()).item(),
        )
    if rank == 0:
        queue.put((out, *predictions(trees, profile)))
    dist.destroy_process_group()


def predictions(trees: list[Tree], profile: ClusterProfile) -> tuple[dict[str, float], str]:
    """The planner's predicted step time per arrangement with ``profile``, and the one it picks."""
    predicted = {a: step_seconds(trees, plans_for(a, trees), WORLD, profile, choose_roots=False) for a in ARRANGEMENTS}
    picked = StepPlan.build(trees, mesh=CPMesh.for_planning((1, WORLD), 0), trie_cost=cost_model(profile))
    return predicted, "CP root" if picked.cp_roots else "chunks"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", type=int, default=4096)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--response-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, args, queue)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    out, predicted, picked = queue.get(timeout=3600)
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"a rank failed with exit code {proc.exitcode}")
    print(
        f"{args.groups} groups x {args.responses} responses of {args.response_len} behind a {args.system}-token "
        f"system prompt, {WORLD} gloo ranks, median of {args.repeats}"
    )
    print(
        f"{'arrangement':<10} {'step s':>8} {'vs chunks':>9} {'tokens/rank':>11} {'bytes':>12} {'grad diff':>9} "
        f"{'predicted s':>11}"
    )
    for a in ARRANGEMENTS:
        r = out[a]
        diff = r["grad_diff"]
        print(
            f"{a:<10} {r['seconds']:8.3f} {out['chunks']['seconds'] / r['seconds']:8.2f}x {r['tokens']:11,} "
            f"{r['bytes']:12,} {diff:9.1e} {predicted[a]:11.4f}"
        )
    ratio = predicted["chunks"] / predicted["CP root"]
    print(f"the cost model picks: {picked} (predicted CP root over chunks: {ratio:.2f}x)")


if __name__ == "__main__":
    main()
