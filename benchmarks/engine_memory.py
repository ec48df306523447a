"""What one training step holds at once on a rank: verl's stock fsdp2 engine vs the augtree engine (ZeRO-3),
ours with and without prompt-activation offload.

    python benchmarks/engine_memory.py [--layers 6] [--repeats 1] [--batches NAME ...] [--json rows.json]

Two gloo ranks (CPU), a random-weight tiny Qwen2 shaped like Qwen2.5-7B where memory is concerned (hidden
112, 7 query heads and 1 K/V head of 16: a boundary [P, hidden] is 3.5x a layer's K/V [2, P, H_kv * D], as
at 7B; MLP 592 = 5.3x hidden), ``--layers`` decoder layers (6), gradient checkpointing on, fp32, verl
micro-batches of one row, per engine and batch one ``train_batch`` (``--repeats``: more steps, times are
the median):

- prompt-heavy: per rank 2 groups, prompt 2048, 4 responses of 16;
- response-heavy: per rank 2 groups, prompt 16, 4 responses of 512;
- deep-trie: per rank one conversation trained turn by turn (step-wise multi-turn: turn t's row has the
  system prompt and turns 1..t-1 as its prompt, its own uid), a 512-token system prompt and 6 turns of a
  32-token user message and a 256-token answer: a chain of 11 trie nodes and a leaf, 2,240 distinct tokens
  against 9,120 flattened, replayed depth first (the path's state plus one micro-batch alive; its node
  boundaries are under the offload's 256 KiB floor at this width, so nothing moves to the host).

Reported per engine and batch (rank 0; ``UnshardedGroups`` in ``augtree_verl/integration/memory_meter.py``):
the most FSDP2 parameter groups unsharded at once; the peak device bytes of unsharded parameters +
unsharded gradient buffers + tensors saved for backward on the device + the in-flight prompts' K/V leaves,
last hidden states and float32 gradient sums; the peak bytes in the offload's host pool; the step time
(ours with and without offload side by side, in the same processes, on the same batches; on CPU the copies
are memcpy). ``--json PATH`` writes the rows ``{"engine", "batch", "offload", "max_unsharded_groups",
"peak_bytes", "peak_host_bytes", "step_s"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch.multiprocessing as mp

from augtree_verl.testing import harness as H

WORLD = 2
MODEL = {
    **H.MODEL_SHAPE,
    "hidden_size": 112,
    "num_attention_heads": 7,
    "num_key_value_heads": 1,
    "intermediate_size": 592,
    "max_position_embeddings": 4096,
}
# name: (prompt length, response length, responses per group, groups per rank)
BATCHES = {"prompt-heavy": (2048, 16, 4, 2), "response-heavy": (16, 512, 4, 2)}
# the deep-trie batch: (system prompt, turns, user message, answer) tokens
DEEP_TRIE = (512, 6, 32, 256)
# row name: (engine, offload)
ENGINES = {"stock": ("fsdp2", False), "augtree": ("augtree", False), "augtree+offload": ("augtree", True)}


def _rank_main(rank: int, port: int, model_path: str, out_path: str, repeats: int, batches: list[str]) -> None:
    H.use_cpu_platform()  # before verl loads its engines, in this spawned process too
    import torch
    from verl.utils import tensordict_utils as tu

    from augtree_verl.integration.memory_meter import UnshardedGroups
    from augtree_verl.testing import verl_batch

    torch.set_num_threads(1)
    H.init_process_group(rank=rank, world_size=WORLD, port=port)
    engines = {
        name: H.build_engine(
            strategy,
            model_path,
            gradient_checkpointing=True,
            engine_knobs={"offload_prompt_activations": offload} if strategy == "augtree" else None,
        )
        for name, (strategy, offload) in ENGINES.items()
    }
    rows_out = []
    for batch_name in batches:
        rows, mine = _rows(batch_name, rank)
        batch = verl_batch.rows_to_batch(mine, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
        tu.assign_non_tensor(batch, global_batch_size=len(rows))
        seen = {name: [0, 0, 0, []] for name in engines}  # max groups, peak bytes, peak host bytes, step times
        for _ in range(repeats):
            for name, (engine, loss_fn) in engines.items():  # side by side, every repeat
                with engine.train_mode(), UnshardedGroups(engine.module) as meter:
                    torch.distributed.barrier()
                    start = time.perf_counter()
                    engine.train_batch(batch.clone(), loss_function=loss_fn)
                    seen[name][3].append(time.perf_counter() - start)
                s = seen[name]
                s[0], s[1], s[2] = max(s[0], meter.max), max(s[1], meter.peak_bytes), max(s[2], meter.peak_host_bytes)
        for name, (groups_max, peak, host, times) in seen.items():
            rows_out.append(
                {
                    "engine": ENGINES[name][0].replace("fsdp2", "stock"),
                    "batch": batch_name,
                    "offload": ENGINES[name][1],
                    "max_unsharded_groups": groups_max,
                    "peak_bytes": peak,
                    "peak_host_bytes": host,
                    "step_s": statistics.median(times),
                }
            )
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows_out, f)
    torch.distributed.destroy_process_group()


def _rows(batch_name: str, rank: int) -> tuple[list[dict], list[dict]]:
    """(every rank's rows, this rank's) of a batch."""
    import torch

    if batch_name != "deep-trie":
        p, r, g, groups = BATCHES[batch_name]
        rows = H.group_rows([(p, [r] * g)] * (groups * WORLD))
        return rows, [row for k, row in enumerate(rows) if (k // g) % WORLD == rank]  # whole groups per rank
    system, turns, user, answer = DEEP_TRIE
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, H.MODEL_SHAPE["vocab_size"], (n,), generator=gen)
    rows = []
    for conversation in range(WORLD):
        context = ids(system)
        for turn in range(turns):
            prompt, response = torch.cat([context, ids(user)]), ids(answer)
            rows.append(
                dict(
                    uid=f"conversation-{conversation}-turn-{turn}",
                    prompt=prompt,
                    response=response,
                    advantage=float(torch.randn(1, generator=gen)),
                )
            )
            context = torch.cat([prompt, response])
    return rows, rows[rank * turns : (rank + 1) * turns]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of the tiny model (>= 6)")
    parser.add_argument("--repeats", type=int, default=1, help="training steps per engine and batch")
    parser.add_argument(
        "--batches",
        nargs="+",
        default=[*BATCHES, "deep-trie"],
        choices=[*BATCHES, "deep-trie"],
        help="the batches to run (default: all)",
    )
    parser.add_argument("--json", help="write the rows to this path")
    args = parser.parse_args()
    if args.layers < 1 or args.repeats < 1:
        raise ValueError(f"--layers and --repeats must be >= 1, got {args.layers} and {args.repeats}")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model_path = tempfile.mkdtemp(prefix="augtree-memory-")
    Qwen2ForCausalLM(Qwen2Config(**{**MODEL, "num_hidden_layers": args.layers})).save_pretrained(model_path)
    out_path = os.path.join(model_path, "rows.json")
    mp.start_processes(
        _rank_main,
        args=(H.free_port(), model_path, out_path, args.repeats, args.batches),
        nprocs=WORLD,
        join=True,
        start_method="spawn",
    )
    with open(out_path) as f:
        rows = json.load(f)
    print(
        f"{'engine':9}{'batch':16}{'offload':9}{'max unsharded groups':>22}{'peak MiB':>10}{'host MiB':>10}"
        f"{'step s':>8}"
    )
    for row in rows:
        print(
            f"{row['engine']:9}{row['batch']:16}{str(row['offload']):9}{row['max_unsharded_groups']:>22}"
            f"{row['peak_bytes'] / 2**20:>10.2f}{row['peak_host_bytes'] / 2**20:>10.2f}{row['step_s']:>8.2f}"
        )
    for batch in args.batches:
        off, on = (
            next(r for r in rows if r["engine"] == "augtree" and r["batch"] == batch and r["offload"] is o)
            for o in (False, True)
        )
        print(
            f"{batch}: offload peak {1 - on['peak_bytes'] / off['peak_bytes']:.0%} lower than without, step time "
            f"{on['step_s'] / off['step_s']:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
