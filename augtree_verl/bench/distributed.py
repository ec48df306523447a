"""Run the benchmark on ``cp`` processes: one CP group over gloo (CPU) or NCCL (CUDA), spawned here."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from augtree_verl.bench.config import BenchConfig
from augtree_verl.bench.runner import MethodResult, run_benchmark
from augtree_verl.bench.workloads import select_groups
from augtree_verl.models import check_model_name

INIT_TIMEOUT = timedelta(minutes=10)  # a rank may wait that long at a barrier while rank 0 runs a long step


def run(cfg: BenchConfig) -> list[MethodResult]:
    """The benchmark's results: in this process for ``cfg.cp == 1``, else gathered from ``cfg.cp`` spawned ranks."""
    # Bad workload sizes or model names fail here, before any process starts.
    for name in cfg.workloads:
        select_groups(name, cfg.budget_tokens, cfg.group_size, cfg.num_groups)
    check_model_name(cfg.model)
    if cfg.cp == 1:
        return run_benchmark(cfg, device=_device(cfg, 0))
    if cfg.device.startswith("cuda") and torch.cuda.device_count() < cfg.cp:
        raise ValueError(f"--cp {cfg.cp} on cuda needs {cfg.cp} GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="augtree-bench-") as tmp:
        out = os.path.join(tmp, "results.json")
        mp.spawn(_rank_main, args=(cfg, _free_port(), out), nprocs=cfg.cp, join=True)
        with open(out) as f:
            rows = json.load(f)
    return [MethodResult.from_dict(r) for r in rows]


def _rank_main(rank: int, cfg: BenchConfig, port: int, out: str) -> None:
    device = _device(cfg, rank)
    if device == "cpu":
        # The ranks share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.cp))
    else:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo" if device == "cpu" else "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=cfg.cp,
        timeout=INIT_TIMEOUT,
    )
    try:
        results = run_benchmark(cfg, rank=rank, world=cfg.cp, device=device)
        if rank == 0:
            with open(out, "w") as f:
                json.dump([r.to_dict() for r in results], f)
    finally:
        dist.destroy_process_group()


def _device(cfg: BenchConfig, rank: int) -> str:
    return "cpu" if cfg.device == "cpu" else f"cuda:{rank}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
