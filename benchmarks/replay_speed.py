"""Flattened baseline vs grouped replay on CPU: measured and ideal (FLOP-count) speedup of one update step.

    python benchmarks/replay_speed.py [--repeats 3] [--threads 1] [--quick]

Both schedules run side by side in one process, alternating, on the same model and data; the medians of
the repetitions are reported, and the speedup is the median of the per-repetition ratios (each ratio
compares two runs made back to back, so load that drifts over minutes on a shared machine cancels out).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from augtree_verl import StepPlan, Tree, per_response, replay
from augtree_verl.replay.baseline import flattened_replay
from augtree_verl.replay.flops import ideal_speedup

# A small Qwen2-shaped model (GQA 8:2, SwiGLU 2.75x) that trains in seconds on 2 cores.
CONFIG = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    attn_implementation="sdpa",
)
GROUPS = {"prompt-heavy": (4096, 128, 8), "response-heavy": (256, 2048, 8)}


def step_time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="quarter-length groups, one repetition")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on shared cores multi-threaded kernels stall on their slowest thread)",
    )
    parser.add_argument("--group", choices=sorted(GROUPS), action="append", help="run only these groups")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = Qwen2Config(**CONFIG)
    model = Qwen2ForCausalLM(cfg).float().train()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M params, torch threads {torch.get_num_threads()}")
    print(
        f"{'group':16}{'P':>6}{'R':>6}{'G':>4}{'flattened s':>13}{'replay s':>10}{'speedup':>9}{'ideal':>7}"
        f"{'of ideal':>10}"
    )
    for name, (p, r, g) in GROUPS.items():
        if args.group and name not in args.group:
            continue
        if args.quick:
            p, r = p // 4, r // 4
        ids = lambda n: torch.randint(0, cfg.vocab_size, (n,))
        trees = [Tree.of_tokens(ids(p), [ids(r) for _ in range(g)])]
        loss_fn = lambda t, i, logp: -logp.mean()
        times = {"flattened": [], "replay": []}
        # Warm-up (first-call allocations and kernel selection), untimed.
        warm = [Tree.of_tokens(ids(64), [ids(16), ids(16)])]
        flattened_replay(model, warm, loss_fn)
        replay(model, StepPlan.build(warm), per_response(loss_fn))
        for _ in range(1 if args.quick else args.repeats):
            model.zero_grad(set_to_none=True)
            times["flattened"].append(step_time(lambda: flattened_replay(model, trees, loss_fn)))
            model.zero_grad(set_to_none=True)
            times["replay"].append(step_time(lambda: replay(model, StepPlan.build(trees), per_response(loss_fn))))
        flat, ours = (statistics.median(times[k]) for k in ("flattened", "replay"))
        speedup = statistics.median(a / b for a, b in zip(times["flattened"], times["replay"]))
        ideal = ideal_speedup(cfg, p, [r] * g)
        print(
            f"{name:16}{p:>6}{r:>6}{g:>4}{flat:>13.2f}{ours:>10.2f}{speedup:>8.2f}x{ideal:>6.2f}x"
            f"{speedup / ideal:>10.2f}"
        )


if __name__ == "__main__":
    main()
