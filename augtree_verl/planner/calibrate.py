"""Measure a rank's hardware figures for ``ClusterProfile.calibrate`` (a few seconds, CPU/gloo or CUDA/NCCL).

- flops_per_s: median of square matmuls (float32 on CPU, the profile's dtype on CUDA).
- launch_latency_s: median of a one-element op, or of a tiny ring exchange when there are peers (larger).
- p2p_bytes_per_s: each rank sends a buffer to its ring successor and receives one from its predecessor
  (``batch_isend_irecv``); bytes sent / median time.
- collective_bytes_per_s: ``all_gather`` of one buffer per rank; bytes received per rank / median time.
- memory_per_rank_bytes (CUDA only): free memory now x ``CUDA_MEMORY_HEADROOM``; call it after the model and
  optimizer exist. On CPU the profile's figure is kept, as is ``internode_bytes_per_s`` (one node here).
Without an initialised process group of more than one rank the communication figures are kept. With one,
every rank must call it; the figures are agreed (min of throughputs, max of latency) so all ranks plan alike.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

CUDA_MEMORY_HEADROOM = 0.9    # leave 10% of free memory to the allocator and NCCL
MATMUL_SIZE = {"cpu": 512, "cuda": 4096}
COMM_BYTES = {"cpu": 4 << 20, "cuda": 256 << 20}
REPEATS = 5
LATENCY_REPEATS = 50


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()                                          # warm-up
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _dtype(profile, device: torch.device) -> torch.dtype:
    if device.type != "cuda":
        return torch.float32
    return {2: torch.bfloat16, 4: torch.float32}.get(profile.dtype_bytes, torch.bfloat16)


def measure_hardware(profile, group=None, device=None) -> dict:
    """The measured ``ClusterProfile`` fields (see the module docstring)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
    device = torch.device(device)
    dtype = _dtype(profile, device)
    n = MATMUL_SIZE.get(device.type, MATMUL_SIZE["cpu"])
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    measured = {"flops_per_s": 2 * n ** 3 / _median_seconds(lambda: a @ b, device, REPEATS)}
    one = torch.ones(1, device=device)
    measured["launch_latency_s"] = _median_seconds(lambda: one.add_(0), device, LATENCY_REPEATS)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        measured["memory_per_rank_bytes"] = float(free) * CUDA_MEMORY_HEADROOM

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        comm = _measure_comm(group, device)
        measured["launch_latency_s"] = max(measured["launch_latency_s"], comm.pop("launch_latency_s"))
        measured.update(comm)
        measured = _agree(measured, group, device)
    return measured


def _comm_device(group, device: torch.device) -> torch.device:
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _measure_comm(group, device: torch.device) -> dict:
    device = _comm_device(group, device)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nbytes = COMM_BYTES.get(device.type, COMM_BYTES["cpu"])
    send = torch.ones(nbytes // 4, device=device)
    recv = torch.empty_like(send)
    succ = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    pred = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world

    def exchange(x, y):
        ops = [dist.P2POp(dist.isend, x, succ, group), dist.P2POp(dist.irecv, y, pred, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    tiny_send, tiny_recv = torch.ones(1, device=device), torch.empty(1, device=device)
    dist.barrier(group)
    out = {"launch_latency_s": _median_seconds(lambda: exchange(tiny_send, tiny_recv), device, REPEATS)}
    dist.barrier(group)
    out["p2p_bytes_per_s"] = nbytes / _median_seconds(lambda: exchange(send, recv), device, REPEATS)
    chunk = torch.ones(nbytes // 4 // world, device=device)
    gathered = [torch.empty_like(chunk) for _ in range(world)]
    dist.barrier(group)
    seconds = _median_seconds(lambda: dist.all_gather(gathered, chunk, group=group), device, REPEATS)
    out["collective_bytes_per_s"] = (world - 1) * chunk.numel() * 4 / seconds
    return out


def _agree(measured: dict, group, device: torch.device) -> dict:
    """Every rank ends with the same figures: min of throughputs and memory, max of latency."""
    device = _comm_device(group, device)
    names = sorted(measured)
    signs = torch.tensor([-1.0 if name == "launch_latency_s" else 1.0 for name in names], dtype=torch.float64)
    values = torch.tensor([measured[name] for name in names], dtype=torch.float64) * signs
    values = values.to(device)
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    values = values.cpu() * signs
    return {name: float(v) for name, v in zip(names, values.tolist())}
