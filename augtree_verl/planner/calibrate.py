"""Measure a rank's hardware figures for ``ClusterProfile.calibrate`` (a few seconds, CPU/gloo or CUDA/NCCL).

Compute is measured on the profile's model shapes (call ``with_model`` first), with the kernels the replay runs:
- flops_per_s: without ``model``, median of [T, hidden] @ [hidden, intermediate] matmuls (an MLP projection;
  float32 on CPU, the profile's dtype on CUDA; widths capped on CPU so a 7B shape still calibrates in
  seconds). With ``model``, the replay's own throughputs (``_replay_throughputs``): what a response of n
  tokens adds to a replay after a prompt of p tokens is n A / F + n^2 / 2 B / F_causal + n p B / F_attention,
  A and B the cost model's dense FLOPs per token and FLOPs per (query, key) pair of a pass. Three such times
  (responses of both ``DENSE_TOKENS`` lengths after the tiny prompt, the shorter after a prompt of the longer
  length; both shorter where attention is too small a share of them to be seen, ``_dense_lengths``) give F
  (every kernel of the model's layers per token: norms, activations, RoPE cost as much as the matmuls on a
  small model), F_causal and F_attention where the replay runs them: its own attention calls
  (the varlen kernel for a call's own tokens, blocks against a prompt's K/V) at the lengths of long calls.
  A flash kernel's causal throughput grows with the sequence (its diagonal tiles, computed whole, are a
  shrinking share), and the replay's own calls (varlen blocks, blocks against a prompt) are not the
  microbenchmarks' single block of about a thousand tokens below: on a CPU those rated qwen2-small's causal
  attention at 37 GFLOP/s where its 2k-token replays reach 48, and the cost model over-predicted the long
  steps of ``augtree bench`` by 15-25% with them. Where noise makes a figure non-positive, the
  microbenchmark's stands (F follows from the rest, or from the matmuls where the shorter response's
  added time itself came out non-positive); F_causal is capped at F_attention (a causal block's
  visible pairs cost no less than a full block's).
- attention_flops_per_s: without ``model`` (or as the fallback above), median forward + backward of one
  non-causal attention block with the model's query/KV heads and head dim, through the CP engine's kernels
  (``ops.attention``: the ATen flash kernel on CPU, torch's flash kernels or flash-attn on CUDA, SDPA there
  where those cannot run: flash-attn selected but missing, or float32); 3 x forward FLOPs / time, as the cost
  model counts.
- causal_attention_flops_per_s: the same block causal, its visible half's FLOPs counted (a flash kernel
  skips the masked tiles but not the diagonal's work, so it reaches less); with ``model``, fitted on the
  replay (above).
- the fixed costs ``FIXED_COSTS`` (with ``model``: what ``replay`` runs), fitted on the replay itself: tiny trees
  (``OVERHEAD_PROMPT`` prompt tokens, n two-token responses, n = 1 and 1 + ``OVERHEAD_CALLS``) replayed on
  one device, each response its own micro-batch, and, with a world process group of W > 1 ranks, under
  every CP primitive and lane count (ring; TreeMoveKV and MoveQ with 1 and W lanes) over the world, as
  the engine runs them. Each tree's median time (repeats interleaved across the trees, so drifting load
  hits all alike), less what the cost model gives its FLOPs and bytes, is regressed on what the cost model
  counts for it (calls, slots, ring hops, all-to-alls, score exchanges; ``search.estimate`` under unit
  profiles, so the counts are the model's own): non-negative least squares, relative to each time. So a
  CP step's fixed cost (its decoder call over a ring, the LM-head call, the exchange, the keep-alives, one
  block attention and merge per ring hop) is measured where it runs, not inferred from a one-device call
  and a ping. Without a world group, or with ``context_parallel=False``, only the call and slot costs are
  fitted. The gradients of ``model.parameters()`` are left as they were (a wrapper without ``parameters()``,
  verl's FSDP2 view, leaves that to its caller). Without ``model`` the profile's fixed costs stay.
With an initialised process group of more than one rank, communication too (medians over many repeats, so
one descheduled step on a shared machine does not set the figure):
- launch_latency_s, ring_hop_s, all_to_all_s (until the replay fits them): median of a one-element ring
  exchange (``batch_isend_irecv``).
- p2p_bytes_per_s: each rank sends ``COMM_BYTES`` to its ring successor and receives from its predecessor
  (the K/V ring's pattern and message size class), alone and started before an attention step as the ring
  does; bytes sent / the larger of (exchange time, what the exchange adds to the attention step). On a CPU
  the transfer competes with the attention for the cores (gloo copies through sockets), so an overlapped
  ring step costs several times the idle exchange; NCCL on a GPU overlaps, and the idle figure stands.
- collective_bytes_per_s: ``all_to_all_single`` (MoveQ's query/state exchange); bytes sent to other ranks /
  median time.
- memory_per_rank_bytes (CUDA only): free memory now x ``CUDA_MEMORY_HEADROOM``; call it after the model and
  optimizer exist. On CPU the profile's figure is kept, as is ``internode_bytes_per_s`` (one node here).
Without such a group the communication figures are kept. With one, every rank must call it; the figures are
agreed (min of throughputs, max of latencies) so all ranks plan alike.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from augtree_verl.ops.attention import attention_backward, attention_forward
from augtree_verl.planner.cost import cost_model
from augtree_verl.planner.profile import ClusterProfile
from augtree_verl.planner.search import estimate
from augtree_verl.replay import StepPlan, Tree, per_response, replay
from augtree_verl.replay.rope import RopeRegimes

CUDA_MEMORY_HEADROOM = 0.9  # leave 10% of free memory to the allocator and NCCL
MATMUL_TOKENS = {"cpu": 1024, "cuda": 8192}
MATMUL_MAX_WIDTH = {"cpu": 2048, "cuda": 1 << 16}  # on CPU a 3584 x 18944 weight would take seconds per call
# Attention block: S queries x S keys; on CPU S is sized to ~ATTENTION_CPU_FLOPS forward FLOPs (clamped).
ATTENTION_TOKENS_CUDA = 4096
ATTENTION_CPU_FLOPS = 5e8
ATTENTION_CPU_TOKENS = (256, 2048)
ATTENTION_MAX_KV_HEADS = {"cpu": 2, "cuda": 1 << 10}  # throughput per head is flat; keeps a CPU call short
OVERHEAD_PROMPT, OVERHEAD_CALLS = 8, 4  # the tiny trees' prompt tokens, and the calls one has more
# The response and prompt lengths whose replay times give the model's throughputs (``_replay_throughputs``):
# the shorter as long as a typical response call, the longer where attention is a large share.
DENSE_TOKENS = {"cpu": (512, 2048), "cuda": (4096, 8192)}
# Where attention is under MIN_ATTENTION_SHARE of the longer probe's FLOPs (a big vocabulary's LM head on a narrow
# model: a 64-wide model with Qwen2.5's 151,665 tokens does 78 MFLOP a token in forward + backward and 2 kFLOP per
# (query, key) pair, so attention is 2.6% of a 2,048-token probe), the replay's times cannot see it: the probes
# shrink UNSEEN_ATTENTION_SHRINK-fold (seconds instead of minutes on a CPU) and the attention figures stay the
# microbenchmarks' (``_replay_throughputs``).
MIN_ATTENTION_SHARE = 0.05
UNSEEN_ATTENTION_SHRINK = 8
MIN_DENSE_SHARE = 0.1  # the dense share of the shorter response's time is taken as at least this (noise guard)
COMM_BYTES = {"cpu": 4 << 20, "cuda": 256 << 20}
REPEATS = 7
MIN_OVERHEAD_S = 1e-6  # a fixed cost the noise of a shared machine put at or below zero
# The replay's fixed costs the calibration fits (planner/cost.py): per call, per tree, per ring hop, per
# all-to-all, per score exchange; agreed by max over ranks, the rest by min.
FIXED_COSTS = ("call_overhead_s", "slot_overhead_s", "ring_hop_s", "all_to_all_s", "launch_latency_s")
THROUGHPUTS = (
    "flops_per_s",
    "attention_flops_per_s",
    "causal_attention_flops_per_s",
    "p2p_bytes_per_s",
    "collective_bytes_per_s",
    "internode_bytes_per_s",
)
TINY, HUGE = 1e-300, 1e300  # a figure that makes its term vanish (profiles take positive numbers only)
COMM_REPEATS = 15
LATENCY_REPEATS = 50


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn, device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    _seconds(fn, device)  # warm-up
    return statistics.median(_seconds(fn, device) for _ in range(repeats))


def _median_added_seconds(fn, baseline, device: torch.device, repeats: int) -> float:
    """Median over back-to-back pairs of time(fn) - time(baseline): what ``fn`` adds to ``baseline``, with
    drifting load cancelled pair by pair."""
    _seconds(fn, device)  # warm-up
    added = []
    for _ in range(repeats):
        base = _seconds(baseline, device)
        added.append(_seconds(fn, device) - base)
    return statistics.median(added)


def _dtype(profile, device: torch.device) -> torch.dtype:
    if device.type != "cuda":
        return torch.float32
    return {2: torch.bfloat16, 4: torch.float32}.get(profile.dtype_bytes, torch.bfloat16)


def calibrate(
    profile: ClusterProfile, group=None, device=None, model=None, lockstep_group=None, context_parallel: bool = True
) -> ClusterProfile:
    """``profile`` with compute, bandwidth, latency (and, on CUDA, memory) measured here, on its model shapes;
    ``model`` (optional, what ``replay`` runs: a causal LM or ``integration.fsdp_model.FSDPReplayModel``)
    sets the fixed costs from the replay itself (with a world process group and ``context_parallel``, the CP
    ones too), its calls in step over ``lockstep_group`` (an FSDP2-sharded model); see the module docstring.
    ``context_parallel=False`` (a run whose plans are all one-device: ``cp_degrees`` [1]) replays no CP tiny
    trees, so the CP fixed costs (``ring_hop_s``, ``all_to_all_s``, ``launch_latency_s``) keep the ping's
    figures: those trees are 10 of the 12, and over FSDP2 each replay all-gathers and reduce-scatters the model
    (minutes on CPU for a model with a 151k-token vocabulary, whose embedding and head gloo moves every call).

    Collective: when ``torch.distributed`` is initialised with more than one rank, every rank of ``group``
    must call it, and all of them get the same profile back.
    """
    return dataclasses.replace(profile, **_measure(profile, group, device, model, lockstep_group, context_parallel))


def _measure(profile, group, device, model, lockstep_group, context_parallel: bool) -> dict:
    """The measured ``ClusterProfile`` fields."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    dtype = _dtype(profile, device)
    attention_step, attention_flops = _attention_block(profile, device, dtype, causal=False)
    causal_step, causal_flops = _attention_block(profile, device, dtype, causal=True)
    measured = {
        "attention_flops_per_s": attention_flops / _median_seconds(attention_step, device, REPEATS),
        "causal_attention_flops_per_s": causal_flops / _median_seconds(causal_step, device, REPEATS),
    }
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if distributed:
        measured.update(_measure_comm(group, device, attention_step))
    if model is None:
        measured["flops_per_s"] = _matmul_flops(profile, device, dtype)
    else:
        # CP plans run over the world (the replay's mesh without one), so only a world group fits them.
        world_group = distributed and dist.get_world_size(group) == dist.get_world_size()
        cp_world = dist.get_world_size(group) if world_group and context_parallel else 1
        measured.update(
            _replay_costs(model, dataclasses.replace(profile, **measured), device, lockstep_group, cp_world)
        )
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        measured["memory_per_rank_bytes"] = float(free) * CUDA_MEMORY_HEADROOM
    return _agree(measured, group, device) if distributed else measured


def _matmul_flops(profile, device: torch.device, dtype: torch.dtype) -> float:
    width = MATMUL_MAX_WIDTH.get(device.type, MATMUL_MAX_WIDTH["cpu"])
    tokens = MATMUL_TOKENS.get(device.type, MATMUL_TOKENS["cpu"])
    hidden, inner = min(profile.hidden_size, width), min(profile.intermediate_size, width)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w = torch.randn(hidden, inner, device=device, dtype=dtype)
    return 2 * tokens * hidden * inner / _median_seconds(lambda: x @ w, device, REPEATS)


def _attention_block(profile, device: torch.device, dtype: torch.dtype, causal: bool):
    """(step, FLOPs): a forward + backward of one attention block (``causal`` or full) and the FLOPs the cost
    model counts for it."""
    kv_heads = min(profile.num_kv_heads, ATTENTION_MAX_KV_HEADS.get(device.type, ATTENTION_MAX_KV_HEADS["cpu"]))
    heads = kv_heads * (profile.num_heads // profile.num_kv_heads)
    dim, value_dim = profile.head_dim, profile.value_head_dim
    pair = 2 * heads * (dim + value_dim)  # FLOPs per (query, key) pair: QK^T and PV (``ModelShape``)
    if device.type == "cuda":
        tokens = ATTENTION_TOKENS_CUDA
    else:
        lo, hi = ATTENTION_CPU_TOKENS
        tokens = int(min(hi, max(lo, math.sqrt(ATTENTION_CPU_FLOPS / pair))))
    q = torch.randn(heads, tokens, dim, device=device, dtype=dtype)
    k = torch.randn(kv_heads, tokens, dim, device=device, dtype=dtype)
    v = torch.randn(kv_heads, tokens, value_dim, device=device, dtype=dtype)
    dout = torch.randn(heads, tokens, value_dim, device=device, dtype=dtype)
    return _attention_step(q, k, v, dout, causal), 3 * pair * tokens * tokens / (2 if causal else 1)


def _attention_step(q, k, v, dout, causal: bool):
    """A forward + backward of one attention block, with the CP engine's kernels where they run."""
    scale = q.shape[-1] ** -0.5
    try:
        if q.is_cuda:
            attention_forward(q, k, v, causal=causal, scale=scale)  # backend installed, dtype supported?
    except (ImportError, ValueError):  # flash-attn selected but missing, or float32 (no flash kernel)
        group = q.shape[0] // k.shape[0]
        q, k, v = (
            x.detach().requires_grad_() for x in (q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0))
        )
        return lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal), (q, k, v), dout
        )

    def step():
        out, lse = attention_forward(q, k, v, causal=causal, scale=scale)
        attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)

    return step


def _attention_share(profile, tokens: int) -> float:
    """Attention's share of the FLOPs of a ``tokens``-token response after a tiny prompt: its causal pairs
    against the dense work per token."""
    pairs = tokens * profile.attention_pair_flops / 2
    return pairs / (pairs + profile.linear_flops + profile.head_flops)


def _dense_lengths(profile, device: torch.device) -> tuple[int, int]:
    """The (shorter, longer) response lengths whose replay times give the throughputs: ``DENSE_TOKENS``, shrunk
    ``UNSEEN_ATTENTION_SHRINK``-fold where attention is under ``MIN_ATTENTION_SHARE`` of the longer one."""
    short, long = DENSE_TOKENS.get(device.type, DENSE_TOKENS["cpu"])
    if _attention_share(profile, long) >= MIN_ATTENTION_SHARE:
        return short, long
    return short // UNSEEN_ATTENTION_SHRINK, long // UNSEEN_ATTENTION_SHRINK


def _replay_costs(model, profile, device: torch.device, lockstep_group, cp_world: int) -> dict:
    """The throughputs (``_replay_throughputs``) and the fixed costs (``FIXED_COSTS``) of ``replay`` on ``model``
    (the module docstring); ``profile`` has the microbenchmarks' attention throughputs and the bandwidths;
    ``cp_world`` > 1: the CP plans of tiny trees run over the world too."""
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, model.get_input_embeddings().num_embeddings, (n,), generator=gen).to(device)
    prompt = ids(OVERHEAD_PROMPT)
    lengths = _dense_lengths(profile, device)
    loss = per_response(lambda t, i, scores: scores.sum())
    params = [p for p in model.parameters() if p.requires_grad] if hasattr(model, "parameters") else []
    saved = [p.grad for p in params]

    longest = max(lengths) + 1

    def step(trees, plans=None, micro_batch_tokens=longest):
        return lambda: replay(
            model,
            StepPlan.build(
                trees,
                plans=plans,
                lockstep_group=lockstep_group,
                micro_batch_tokens=micro_batch_tokens,
                rope=RopeRegimes.of(model.config),
            ),
            loss,
        )

    one = step([Tree.of_tokens(prompt, [ids(2)])])
    configs = _tiny_trees(profile, prompt, ids, cp_world)
    try:
        short, long = lengths
        context = ids(long)
        added = [
            _median_added_seconds(step([Tree.of_tokens(prompt, [ids(n + 1)])]), one, device, REPEATS) for n in lengths
        ]
        added.append(
            _median_added_seconds(
                step([Tree.of_tokens(context, [ids(short + 1)])]),
                step([Tree.of_tokens(context, [ids(2)])]),
                device,
                REPEATS,
            )
        )
        seconds = _interleaved_medians(
            [step([tree], [plan], micro_batch_tokens=1) for tree, plan, _, _ in configs], device, REPEATS
        )
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    fitted = _fit_fixed_costs(
        [counts for _, _, counts, _ in configs], [t - variable for t, (_, _, _, variable) in zip(seconds, configs)]
    )
    names = FIXED_COSTS if cp_world > 1 else FIXED_COSTS[:2]
    throughputs = _replay_throughputs(profile, lengths, added)
    if "flops_per_s" not in throughputs:
        throughputs["flops_per_s"] = _matmul_flops(profile, device, _dtype(profile, device))
    return {
        **throughputs,
        **{name: max(fitted[i], MIN_OVERHEAD_S) for i, name in enumerate(FIXED_COSTS) if name in names},
    }


def _replay_throughputs(profile, lengths: tuple[int, int], added: list[float]) -> dict:
    """flops_per_s, causal_attention_flops_per_s and attention_flops_per_s from the seconds ``added`` to a
    replay by a response of ``lengths[0]`` and of ``lengths[1]`` tokens after ``OVERHEAD_PROMPT`` prompt
    tokens, and of ``lengths[0]`` tokens after ``lengths[1]`` (the module docstring). Where attention is under
    ``MIN_ATTENTION_SHARE`` of the longer response's FLOPs, ``profile``'s attention figures (the
    microbenchmarks') stand and only the dense one is measured."""
    p = profile
    dense, pair = (p.train_factor * f for f in (p.linear_flops + p.head_flops, p.attention_pair_flops))
    short, long = lengths
    # [n A, n^2 / 2 B, n p B] per measurement: the seconds per unit of 1 / F, 1 / F_causal, 1 / F_attention.
    work = np.array(
        [
            [n * dense, n * n / 2 * pair, n * context * pair]
            for n, context in ((short, OVERHEAD_PROMPT), (long, OVERHEAD_PROMPT), (short, long))
        ]
    )
    full, causal = p.attention_flops_per_s, p.causal_attention_flops_per_s
    if _attention_share(p, long) >= MIN_ATTENTION_SHARE:
        inverse = np.linalg.solve(work, np.array(added, dtype=np.float64))
        full = 1.0 / inverse[2] if inverse[2] > 0 else full
        causal = min(1.0 / inverse[1] if inverse[1] > 0 else causal, full)
    out = {"causal_attention_flops_per_s": float(causal), "attention_flops_per_s": float(full)}
    if added[0] > 0:  # else the load outran the shorter response: the caller's matmul figure stands
        dense_s = max(added[0] - work[0, 1] / causal - work[0, 2] / full, MIN_DENSE_SHARE * added[0])
        out["flops_per_s"] = float(work[0, 0] / dense_s)
    return out


def _tiny_trees(profile, prompt: torch.Tensor, ids, cp_world: int) -> list[tuple]:
    """(tree, plan or None, counts [len(FIXED_COSTS)], variable s) of the calibration's tiny trees: the prompt
    with n two-token responses on one device (one micro-batch each), and with ``cp_world`` > 1 under each CP
    primitive and lane count over the world; counts and variable seconds (FLOPs and bytes) are what the
    cost model estimates for them."""
    variable = dataclasses.replace(profile, **dict.fromkeys(FIXED_COSTS, TINY))
    units = [dataclasses.replace(variable, **dict.fromkeys(THROUGHPUTS, HUGE), **{name: 1.0}) for name in FIXED_COSTS]
    P = prompt.shape[0]
    out: list[tuple] = []
    cost = cost_model(variable)
    for n in (1, 1 + OVERHEAD_CALLS):
        out.append(
            (
                Tree.of_tokens(prompt, [ids(2) for _ in range(n)]),
                None,
                [n, 1] + [0] * (len(FIXED_COSTS) - 2),
                cost.prefill(P, 1)[0] + cost.one_device(P, [2] * n),
            )
        )
    if cp_world > 1:
        for primitive, lanes in (
            ("ring", 1),
            ("tree_move_kv", 1),
            ("tree_move_kv", cp_world),
            ("move_q", 1),
            ("move_q", cp_world),
        ):
            for n in (lanes, lanes * (1 + OVERHEAD_CALLS)):
                plan = functools.partial(estimate, P, [2] * n, degree=cp_world, primitive=primitive, lanes=lanes)
                out.append(
                    (
                        Tree.of_tokens(prompt, [ids(2) for _ in range(n)]),
                        plan(profile=profile),
                        [plan(profile=u).est_time_s for u in units],
                        plan(profile=variable).est_time_s,
                    )
                )
    return out


def _interleaved_medians(fns, device: torch.device, repeats: int) -> list[float]:
    """Median seconds of each of ``fns``, run in turn ``repeats`` times (so drifting load hits all alike)."""
    for fn in fns:  # warm-up
        _seconds(fn, device)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            t.append(_seconds(fn, device))
    return [statistics.median(t) for t in times]


def _fit_fixed_costs(counts: list[list[float]], seconds: list[float]) -> list[float]:
    """Non-negative least squares of ``seconds`` [C] on ``counts`` [C, F], relative to each time (a tiny
    tree's 10% counts as much as a larger one's): every subset of the coefficients free, the rest 0, the
    best feasible fit; coefficients no row counts are 0."""
    A, y = np.array(counts, dtype=np.float64), np.array(seconds, dtype=np.float64)
    weight = 1.0 / np.maximum(np.abs(y), MIN_OVERHEAD_S)
    A, y = A * weight[:, None], y * weight
    used = [j for j in range(A.shape[1]) if A[:, j].any()]
    best, best_residual = np.zeros(A.shape[1]), float(np.sum(y**2))
    for size in range(1, len(used) + 1):
        for free in itertools.combinations(used, size):
            x = np.linalg.lstsq(A[:, free], y, rcond=None)[0]
            if (x < 0).any():
                continue
            residual = float(np.sum((A[:, free] @ x - y) ** 2))
            if residual < best_residual:
                best, best_residual = np.zeros(A.shape[1]), residual
                best[list(free)] = x
    return best.tolist()


def _comm_device(group, device: torch.device) -> torch.device:
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _measure_comm(group, device: torch.device, work) -> dict:
    """Communication figures; ``work`` (a compute step on the compute device) is what the ring overlaps."""
    compute_device, device = device, _comm_device(group, device)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nbytes = COMM_BYTES.get(device.type, COMM_BYTES["cpu"])
    send = torch.ones(nbytes // 4, device=device)
    recv = torch.empty_like(send)
    succ = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    pred = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world

    def start(x, y):
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, x, succ, group), dist.P2POp(dist.irecv, y, pred, group)])

    def exchange(x, y):
        for request in start(x, y):
            request.wait()

    def overlapped():
        requests = start(send, recv)
        work()
        for request in requests:
            request.wait()

    tiny_send, tiny_recv = torch.ones(1, device=device), torch.empty(1, device=device)
    dist.barrier(group)
    latency = _median_seconds(lambda: exchange(tiny_send, tiny_recv), device, LATENCY_REPEATS)
    out = dict.fromkeys(("launch_latency_s", "ring_hop_s", "all_to_all_s"), latency)  # until fitted
    dist.barrier(group)
    alone = _median_seconds(lambda: exchange(send, recv), device, COMM_REPEATS)
    dist.barrier(group)
    added = _median_added_seconds(overlapped, work, compute_device, COMM_REPEATS)
    out["p2p_bytes_per_s"] = nbytes / max(alone, added)
    rows = send[: send.numel() // world * world]
    received = torch.empty_like(rows)
    dist.barrier(group)
    seconds = _median_seconds(lambda: dist.all_to_all_single(received, rows, group=group), device, COMM_REPEATS)
    out["collective_bytes_per_s"] = (world - 1) / world * rows.numel() * 4 / seconds
    return out


def _agree(measured: dict, group, device: torch.device) -> dict:
    """Every rank ends with the same figures: min of throughputs and memory, max of latencies."""
    device = _comm_device(group, device)
    names = sorted(measured)
    signs = torch.tensor([-1.0 if name in FIXED_COSTS else 1.0 for name in names], dtype=torch.float64)
    values = torch.tensor([measured[name] for name in names], dtype=torch.float64) * signs
    values = values.to(device)
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    values = values.cpu() * signs
    return {name: float(v) for name, v in zip(names, values.tolist())}
