"""GPU check for the CP primitives (issue 3, item 7): flash-attn branch vs the CPU path, and primitive timings.

    python benchmarks/gpu_check_cp.py [--out gpu_check_cp.json]     # one CUDA GPU with flash-attn
    python benchmarks/gpu_check_cp.py --cpu-smoke                    # same code on CPU, tiny sizes, float32

1. ``ops.attention`` on CUDA (flash-attn varlen forward/backward through the version shim) against the CPU path
   (ATen CPU flash kernel, float32) on the same (bf16-rounded) inputs: full and causal blocks, MHA and GQA, odd lengths,
   and a blockwise (ring-style) merged attention with its merged-state backward. The device runs bf16;
   tolerance |got - want| <= 1e-3 + 1e-2 |want| elementwise (bf16 has 8 mantissa bits).
2. ``replay_cp`` timings of RingCP / TreeMoveKV / MoveQ on a one-rank process group (NCCL; one GPU cannot
   hold several NCCL ranks), on a Qwen2.5-7B-shaped model with ``--layers`` layers, bf16: this times the
   schedules' compute (prompt per response vs once), not communication.
Prints a summary, writes JSON (``--out``) and exits non-zero when a tolerance is exceeded. Without CUDA (and
without ``--cpu-smoke``) it exits with a message, never silently.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import socket
import sys
import time

import torch

from augtree_verl.ops.attention import attention_backward, attention_forward
from augtree_verl.ops.merge import empty_state, merge_into

ATOL, RTOL = 1e-3, 1e-2  # bf16 vs float32 reference: 8 mantissa bits
QWEN25_7B_SHAPE = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                       num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1_000_000.0,
                       tie_word_embeddings=False)
TINY_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)


def worst_violation(got: torch.Tensor, want: torch.Tensor) -> float:
    """max over elements of |got - want| - (ATOL + RTOL |want|); <= 0 passes."""
    got, want = got.float().cpu(), want.float().cpu()
    return ((got - want).abs() - (ATOL + RTOL * want.abs())).max().item()


def op_cases(device, dtype, small: bool):
    g = torch.Generator().manual_seed(0)
    heads = [(4, 4), (8, 2)] if small else [(28, 4), (32, 32)]
    dim = 16 if small else 128
    lengths = [(37, 37), (21, 70)] if small else [(777, 777), (513, 2049)]
    for h, hk in heads:
        for sq, sk in lengths:
            for causal in ([True, False] if sq == sk else [False]):
                q = torch.randn(h, sq, dim, generator=g) * 0.5
                k = torch.randn(hk, sk, dim, generator=g) * 0.5
                v = torch.randn(hk, sk, dim, generator=g)
                dout = torch.randn(h, sq, dim, generator=g)
                yield f"h{h}/kv{hk} {sq}x{sk} causal={causal}", q, k, v, dout, causal


def run_block(q, k, v, dout, causal, scale):
    out, lse = attention_forward(q, k, v, causal=causal, scale=scale)
    grads = attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    return (out, lse, *grads)


def run_merged(q, k, v, dout, scale, blocks: int):
    """Keys split into ``blocks`` full blocks, merged in float32, merged-state backward per block."""
    cols = torch.tensor_split(torch.arange(k.shape[1]), blocks)
    out, lse = empty_state(q.shape[0], q.shape[1], q.shape[2], q)
    for c in cols:
        merge_into(out, lse, *attention_forward(q, k[:, c], v[:, c], causal=False, scale=scale))
    out = out.to(q.dtype)
    dq, dk, dv = torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(k, dtype=torch.float32), \
        torch.zeros_like(v, dtype=torch.float32)
    for c in cols:
        bq, bk, bv = attention_backward(dout, q, k[:, c], v[:, c], out, lse, causal=False, scale=scale)
        dq += bq
        dk[:, c] += bk
        dv[:, c] += bv
    return out, lse, dq, dk, dv


def check_ops(device, dtype, small: bool) -> list[dict]:
    names = ["out", "lse", "dq", "dk", "dv"]
    rows = []
    for label, q, k, v, dout, causal in op_cases(device, dtype, small):
        scale = q.shape[-1] ** -0.5
        # the reference sees the same (bf16-rounded) inputs, so only the kernels' arithmetic is compared
        q, k, v, dout = (x.to(dtype).float() for x in (q, k, v, dout))
        want = run_block(q, k, v, dout, causal, scale)  # CPU path, float32
        dev = [x.to(device, dtype) for x in (q, k, v, dout)]
        got = run_block(*dev, causal, scale)
        rows.append(dict(case=label, **{n: worst_violation(a, b) for n, a, b in zip(names, got, want)}))
        if not causal:
            want = run_merged(q, k, v, dout, scale, 3)
            got = run_merged(*dev, scale, 3)
            rows.append(dict(case=label + " merged x3", **{n: worst_violation(a, b) for n, a, b in zip(names, got, want)}))
    return rows


def time_primitives(device, dtype, layers: int, small: bool) -> list[dict]:
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from augtree_verl import Plan, ReplayStats, ReplayTree
    from augtree_verl.cp.engine import replay_cp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=10))
    try:
        shape = TINY_SHAPE if small else QWEN25_7B_SHAPE
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**shape, num_hidden_layers=layers)).to(device, dtype).train()
        groups = {"prompt-heavy": (512, 32, 4), "response-heavy": (32, 256, 4)} if small else \
            {"prompt-heavy": (16384, 256, 8), "response-heavy": (512, 4096, 8)}
        rows = []
        for name, (p, r, g) in groups.items():
            ids = lambda n: torch.randint(0, shape["vocab_size"], (n,), device=device)
            tree = ReplayTree(ids(p), [ids(r) for _ in range(g)])
            plans = {"ring": Plan(degree=1, primitive="ring"),
                     "tree_move_kv": Plan(degree=1, primitive="tree_move_kv", rounds=g, lanes=1,
                                          placement=tuple((i, 0) for i in range(g))),
                     "move_q": Plan(degree=1, primitive="move_q", rounds=g, lanes=1,
                                    placement=tuple((i, 0) for i in range(g)))}
            for label, plan in plans.items():
                times = []
                for _ in range(2):  # warm-up, then the timed run
                    model.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    replay_cp(model, [tree], lambda t, i, lp: -lp.mean(), [plan], stats=ReplayStats())
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                rows.append(dict(group=name, primitive=label, seconds=times[-1]))
        return rows
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="run the same code on CPU, tiny sizes, float32")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        # runs every code path of the script; the CPU kernels are the reference, not the device under test
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check_cp: no CUDA device here; run it where the device tool lends a GPU, "
                             "or pass --cpu-smoke")
        if importlib.util.find_spec("flash_attn") is None:
            raise SystemExit("gpu_check_cp: flash-attn is not installed (pip install -e '.[gpu]')")
        device, dtype = torch.device("cuda"), torch.bfloat16
    ops = check_ops(device, dtype, small=args.cpu_smoke)
    timings = time_primitives(device, dtype, args.layers, small=args.cpu_smoke)
    failed = [r for r in ops if max(v for k, v in r.items() if k != "case") > 0]
    print(f"ops.attention on {device} {dtype} vs CPU float32 (worst |err| - ({ATOL} + {RTOL}|ref|), <= 0 passes):")
    for r in ops:
        print(f"  {r['case']:36}" + "".join(f"{k}={v:+.1e} " for k, v in r.items() if k != "case"))
    print("replay_cp on one rank (compute only):")
    for r in timings:
        print(f"  {r['group']:15}{r['primitive']:14}{r['seconds']:8.3f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=str(device), ops=ops, timings=timings), f, indent=1)
    print("FAIL" if failed else "OK", f"({len(failed)} of {len(ops)} op checks over tolerance)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
