"""What one training step holds at once on a rank: verl's stock fsdp2 engine vs the augtree engine (ZeRO-3).

    python benchmarks/engine_memory.py [--layers 6] [--json rows.json]

Two gloo ranks (CPU), a random-weight 6-layer tiny Qwen2 (``--layers``), gradient checkpointing on, fp32,
verl micro-batches of one row, one ``train_batch`` per engine and batch:

- prompt-heavy: per rank 2 groups, prompt 512, 4 responses of 16;
- response-heavy: per rank 2 groups, prompt 16, 4 responses of 256.

Reported per engine and batch (rank 0; ``UnshardedGroups`` in ``augtree_verl/integration/fsdp_model.py``):
the most FSDP2 parameter groups unsharded at once, and the peak bytes of unsharded parameters + unsharded
gradient buffers + tensors saved for backward (saved-tensor hooks). Ours also holds the prompts' dormant
state (their K/V leaves and the boundaries their delayed backward needs) during their responses; nothing
is offloaded (``offload`` false). ``--json PATH`` writes the rows
``{"engine", "batch", "offload", "max_unsharded_groups", "peak_bytes"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch.multiprocessing as mp

from augtree_verl.testing import harness as H

WORLD = 2
# name: (prompt length, response length, responses per group, groups per rank)
BATCHES = {"prompt-heavy": (512, 16, 4, 2), "response-heavy": (16, 256, 4, 2)}
ENGINES = {"stock": "fsdp2", "augtree": "augtree"}


def _rank_main(rank: int, port: int, model_path: str, out_path: str) -> None:
    H.use_cpu_platform()  # before verl loads its engines, in this spawned process too
    import torch
    from verl.utils import tensordict_utils as tu

    from augtree_verl.integration.memory_meter import UnshardedGroups
    from augtree_verl.testing import verl_batch

    torch.set_num_threads(1)
    H.init_process_group(rank=rank, world_size=WORLD, port=port)
    engines = {name: H.build_engine(strategy, model_path, gradient_checkpointing=True)
               for name, strategy in ENGINES.items()}
    rows_out = []
    for batch_name, (p, r, g, groups) in BATCHES.items():
        rows = H.group_rows([(p, [r] * g)] * (groups * WORLD))
        mine = [row for k, row in enumerate(rows) if (k // g) % WORLD == rank]  # whole groups per rank
        batch = verl_batch.rows_to_batch(mine, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
        tu.assign_non_tensor(batch, global_batch_size=len(rows))
        for name, (engine, loss_fn) in engines.items():
            with engine.train_mode(), UnshardedGroups(engine.module) as seen:
                engine.train_batch(batch.clone(), loss_function=loss_fn)
            rows_out.append({"engine": name, "batch": batch_name, "offload": False,
                             "max_unsharded_groups": seen.max, "peak_bytes": seen.peak_bytes})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows_out, f)
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of the tiny model (>= 6)")
    parser.add_argument("--json", help="write the rows to this path")
    args = parser.parse_args()
    if args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model_path = tempfile.mkdtemp(prefix="augtree-memory-")
    Qwen2ForCausalLM(Qwen2Config(**{**H.MODEL_SHAPE, "num_hidden_layers": args.layers})).save_pretrained(model_path)
    out_path = os.path.join(model_path, "rows.json")
    mp.start_processes(_rank_main, args=(H.free_port(), model_path, out_path), nprocs=WORLD, join=True,
                       start_method="spawn")
    with open(out_path) as f:
        rows = json.load(f)
    print(f"{'engine':9}{'batch':16}{'offload':9}{'max unsharded groups':>22}{'peak MiB':>10}")
    for row in rows:
        print(f"{row['engine']:9}{row['batch']:16}{str(row['offload']):9}{row['max_unsharded_groups']:>22}"
              f"{row['peak_bytes'] / 2**20:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
