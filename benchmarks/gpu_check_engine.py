"""GPU check (issue 5, item 8): the ``augtree`` engine against verl's stock FSDP2 engine on one GPU with flash-attn.

Both engines are built the way verl's actor workers build them (``EngineRegistry.new`` with an
``FSDPActorConfig``) from one random-weight model that has Qwen2.5-7B-Instruct's layer shapes (hidden 3584,
28 query / 4 KV heads of 128, vocab 152,064) but only ``--layers`` layers (no weights can be downloaded; the
shapes are what matter for the kernels). The batch is a few GRPO groups with long prompts; our engine sees its
rows in a shuffled (rollout-completion) order. The script compares

- per-token response log-probs and entropies (``infer_batch``, the old-log-prob / ref path),
- the PPO loss (verl's ``ppo_loss``, token-mean) and every parameter's gradient after one
  ``forward_backward_batch``, before any optimizer step,
- wall time (median of ``--repeats`` after one warm-up) and peak GPU memory of both passes,

prints a summary, writes it as JSON (``--out``) and exits non-zero if a tolerance is exceeded.

    python benchmarks/gpu_check_engine.py --out gpu_check_engine.json          # one GPU, bf16 + flash-attn
    python benchmarks/gpu_check_engine.py --dtype fp32 --layers 2             # tight parity, fp32 + SDPA
    python benchmarks/gpu_check_engine.py --cpu-smoke                         # same code paths on CPU, tiny model
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import random
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

# Qwen2.5-7B-Instruct's config.json, minus the layer count (set by --layers).
QWEN25_7B_SHAPE = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                       num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1_000_000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY_SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=False)
# (prompt length, response lengths) per group: a RAG-like prompt-heavy group of 8, a 16k prompt with short
# answers, and a response-heavy group (~52k tokens flattened, ~36k with each prompt once).
GPU_GROUPS = [(8192, [256, 512, 1024, 384, 128, 768, 640, 896]), (16384, [64] * 8), (1024, [2048, 1536, 1024, 512])]
SMOKE_GROUPS = [(9, [3, 5, 4, 2]), (6, [4]), (4, [6, 2, 3])]
# old log-probs = current + noise this small: no token is clipped (a clipped token has zero gradient and would
# hide a wrong log-prob), yet ratios differ from 1 (see docs/design.md §5).
OLD_LOGP_NOISE = 0.02

# Tolerances on rel_err = max|ours - stock| / max|stock| per tensor.
# fp32 (CPU smoke, or --dtype fp32 on GPU with TF32 off): the schedules sum the same terms in another order;
# the project's float32 parity bound (tests/parity.py).
FP32_RTOL = 1e-5
# bf16 with flash-attn: each matmul output rounds to 8 mantissa bits (2^-8 ~ 3.9e-3 relative) and the
# prompt-once schedule groups attention and GEMMs differently, so values differ by a few bf16 ulps; gradients
# accumulate that over layers. First-run bounds, to tighten from measured numbers; the gradient cosine is the
# shape-independent check that the two engines push the weights the same way.
BF16_LOGP_RTOL = 2e-2
BF16_GRAD_RTOL = 1e-1
MIN_GRAD_COSINE = {"fp32": 1 - 1e-6, "bf16": 0.99}


@dataclass(frozen=True)
class Setup:
    device: str               # "cuda" or "cpu"
    dtype: str                # compute dtype of FSDP mixed precision: "bf16" or "fp32"
    attn: str                 # Hugging Face attn_implementation
    layers: int
    shape: str                # "qwen2.5-7b" or "tiny"
    max_tokens: int           # token budget per micro-batch (verl's max_token_len_per_gpu; our micro_batch_tokens)
    repeats: int

    @property
    def groups(self):
        return SMOKE_GROUPS if self.shape == "tiny" else GPU_GROUPS

    @property
    def logp_rtol(self) -> float:
        return FP32_RTOL if self.dtype == "fp32" else BF16_LOGP_RTOL

    @property
    def grad_rtol(self) -> float:
        return FP32_RTOL if self.dtype == "fp32" else BF16_GRAD_RTOL


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    diff = (got.float() - want.float()).abs().max().item()
    return diff / scale if scale else diff


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process_group(setup: Setup) -> None:
    import torch.distributed as dist

    if setup.device == "cuda":
        torch.cuda.set_device(0)
    backend = "nccl" if setup.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def save_random_model(directory: str, setup: Setup) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = TINY_SHAPE if setup.shape == "tiny" else QWEN25_7B_SHAPE
    config = Qwen2Config(**shape, num_hidden_layers=setup.layers, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    with torch.device(setup.device):
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16 if setup.dtype == "bf16" else torch.float32).save_pretrained(directory)
    del model
    return directory


def build_engine(strategy: str, model_path: str, setup: Setup):
    """verl's engine for ``strategy`` ("fsdp2" = stock, "augtree" = ours) and its bound PPO loss."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss

    from augtree_verl.integration.config import AugTreeEngineConfig

    precision = "bf16" if setup.dtype == "bf16" else "fp32"
    common = dict(mixed_precision={"param_dtype": precision, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
                  use_torch_compile=False)
    if strategy == "augtree":
        fsdp_config = AugTreeEngineConfig(**common, micro_batch_tokens=setup.max_tokens, use_planner=False)
    else:
        fsdp_config = FSDPEngineConfig(strategy=strategy, **common)
    model_config = HFModelConfig(path=model_path, load_tokenizer=False, use_remove_padding=True,
                                 enable_gradient_checkpointing=setup.shape != "tiny",
                                 override_config={"attn_implementation": setup.attn})
    optim = FSDPOptimizerConfig(lr=1e-6, clip_grad=1.0, total_training_steps=10, weight_decay=0.0)
    rows = sum(len(rs) for _, rs in setup.groups)
    actor_config = FSDPActorConfig(strategy=strategy, rollout_n=1, ppo_mini_batch_size=rows, use_dynamic_bsz=True,
                                   ppo_max_token_len_per_gpu=setup.max_tokens, loss_agg_mode="token-mean",
                                   fsdp_config=fsdp_config, optim=optim, use_torch_compile=False)
    engine_config = actor_config.engine  # what ActorRolloutRefWorker.init_model sets on it
    engine_config.use_dynamic_bsz = True
    engine_config.max_token_len_per_gpu = setup.max_tokens
    engine_config.infer_max_token_len_per_gpu = setup.max_tokens
    engine = EngineRegistry.new(model_type="language_model", backend=strategy, model_config=model_config,
                                engine_config=engine_config, optimizer_config=optim,
                                checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine, functools.partial(ppo_loss, config=actor_config)


def make_rows(setup: Setup, vocab: int) -> list[dict]:
    """One dict per trajectory, group by group: uid, prompt, response, advantage (one scalar per response)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for gi, (p, rs) in enumerate(setup.groups):
        prompt = torch.randint(0, vocab, (p,), generator=g)
        for r in rs:
            rows.append(dict(uid=f"group-{gi}", prompt=prompt, response=torch.randint(0, vocab, (r,), generator=g),
                             advantage=float(torch.randn((), generator=g))))
    return rows


def to_batch(rows: list[dict], setup: Setup, old_log_probs: list[torch.Tensor] | None = None, *, entropy=False):
    """The TensorDict verl's engines take, with dynamic micro-batches of at most ``setup.max_tokens``."""
    from augtree_verl.testing import verl_batch

    return verl_batch.rows_to_batch(rows, old_log_probs=old_log_probs, use_dynamic_bsz=True,
                                    max_token_len_per_gpu=setup.max_tokens, calculate_entropy=entropy)


def response_values(output, rows: list[dict], setup: Setup, key: str) -> list[torch.Tensor]:
    """Per row, the response part of a nested model output, float32 on CPU."""
    from augtree_verl.testing import verl_batch

    batch = to_batch(rows, setup)
    return [v.detach().float().cpu() for v in verl_batch.response_values(output, batch, key)]


def full_grads(engine) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in engine.module.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().float().cpu()
    return grads


def synchronize(setup: Setup) -> None:
    if setup.device == "cuda":
        torch.cuda.synchronize()


def timed(setup: Setup, fn):
    """(result of the last call, median seconds over ``repeats`` calls after one warm-up, peak GPU GiB)."""
    fn()
    times = []
    if setup.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(setup.repeats):
        synchronize(setup)
        start = time.perf_counter()
        result = fn()
        synchronize(setup)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if setup.device == "cuda" else 0.0
    return result, statistics.median(times), peak


def run(setup: Setup) -> dict:
    init_single_process_group(setup)
    model_path = save_random_model(tempfile.mkdtemp(prefix="augtree-gpu-check-"), setup)
    stock, stock_loss = build_engine("fsdp2", model_path, setup)
    ours, our_loss = build_engine("augtree", model_path, setup)

    vocab = (TINY_SHAPE if setup.shape == "tiny" else QWEN25_7B_SHAPE)["vocab_size"]
    rows = make_rows(setup, vocab)
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)  # our engine sees rollout-completion order
    shuffled = [rows[k] for k in order]

    def infer(engine, batch_rows):
        with engine.eval_mode():
            return engine.infer_batch(to_batch(batch_rows, setup, entropy=True), loss_function=None)

    out_stock, t_infer_stock, mem_infer_stock = timed(setup, lambda: infer(stock, rows))
    out_ours, t_infer_ours, mem_infer_ours = timed(setup, lambda: infer(ours, shuffled))
    report = {"setup": asdict(setup), "rows": len(rows),
              "tokens": {"flattened": sum(len(r["prompt"]) + len(r["response"]) for r in rows),
                         "prompt_once": sum(p + sum(rs) for p, rs in setup.groups)}}
    for key in ("log_probs", "entropy"):
        want, got = response_values(out_stock, rows, setup, key), response_values(out_ours, shuffled, setup, key)
        errs = [rel_err(got[j], want[k]) for j, k in enumerate(order)]
        report[key] = {"rel_err_max": max(errs)}

    current = response_values(out_stock, rows, setup, "log_probs")
    g = torch.Generator().manual_seed(1)
    old = [c + OLD_LOGP_NOISE * torch.randn(c.shape, generator=g) for c in current]

    def forward_backward(engine, loss_fn, batch_rows, batch_old, keep_grads=False):
        """One forward_backward_batch from zero gradients; with ``keep_grads`` also every full gradient."""
        with engine.train_mode(zero_grad_on_exit=not keep_grads):  # verl zeroes gradients on leaving train mode
            engine.optimizer_zero_grad()
            output = engine.forward_backward_batch(to_batch(batch_rows, setup, batch_old), loss_fn,
                                                   forward_only=False)
        if not keep_grads:
            return output, None
        grads = full_grads(engine)
        engine.optimizer_zero_grad()
        return output, grads

    old_shuffled = [old[k] for k in order]
    _, t_train_stock, mem_train_stock = timed(setup, lambda: forward_backward(stock, stock_loss, rows, old))
    _, t_train_ours, mem_train_ours = timed(setup, lambda: forward_backward(ours, our_loss, shuffled, old_shuffled))
    fb_stock, grads_stock = forward_backward(stock, stock_loss, rows, old, keep_grads=True)
    fb_ours, grads_ours = forward_backward(ours, our_loss, shuffled, old_shuffled, keep_grads=True)

    loss_stock, loss_ours = float(sum(fb_stock["loss"])), float(sum(fb_ours["loss"]))
    flat_s = torch.cat([grads_stock[n].flatten() for n in sorted(grads_stock)])
    flat_o = torch.cat([grads_ours[n].flatten() for n in sorted(grads_stock)])
    param_errs = {n: rel_err(grads_ours[n], grads_stock[n]) for n in grads_stock}
    worst = max(param_errs, key=param_errs.get)
    report["loss"] = {"stock": loss_stock, "augtree": loss_ours,
                      "rel_err": abs(loss_ours - loss_stock) / abs(loss_stock) if loss_stock else abs(loss_ours)}
    report["grad"] = {"norm_stock": flat_s.norm().item(), "norm_augtree": flat_o.norm().item(),
                      "cosine": torch.nn.functional.cosine_similarity(flat_s, flat_o, dim=0).item(),
                      "rel_err_max": param_errs[worst], "worst_param": worst,
                      "params_compared": len(param_errs), "same_param_set": grads_stock.keys() == grads_ours.keys()}
    report["time_s"] = {"infer": {"stock": t_infer_stock, "augtree": t_infer_ours},
                        "forward_backward": {"stock": t_train_stock, "augtree": t_train_ours}}
    report["speedup"] = {"infer": t_infer_stock / t_infer_ours, "forward_backward": t_train_stock / t_train_ours}
    report["peak_mem_gib"] = {"infer": {"stock": mem_infer_stock, "augtree": mem_infer_ours},
                              "forward_backward": {"stock": mem_train_stock, "augtree": mem_train_ours}}
    checks = {
        "log_probs": report["log_probs"]["rel_err_max"] <= setup.logp_rtol,
        "entropy": report["entropy"]["rel_err_max"] <= setup.logp_rtol,
        "loss": report["loss"]["rel_err"] <= setup.logp_rtol,
        "grad_rel_err": report["grad"]["rel_err_max"] <= setup.grad_rtol,
        "grad_cosine": report["grad"]["cosine"] >= MIN_GRAD_COSINE[setup.dtype],
        "same_param_set": report["grad"]["same_param_set"],
    }
    report["tolerances"] = {"logp_rtol": setup.logp_rtol, "grad_rtol": setup.grad_rtol,
                            "min_grad_cosine": MIN_GRAD_COSINE[setup.dtype]}
    report["checks"] = checks
    report["pass"] = all(checks.values())
    return report


def parse_setup(argv=None) -> tuple[Setup, str | None]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny model on CPU (fp32, SDPA, gloo): exercises every code path, no flash-attn")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="fp32 uses SDPA (flash-attn has no fp32 kernels) and a tight tolerance")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the Qwen2.5-7B-shaped model")
    parser.add_argument("--max-tokens", type=int, default=32768, help="tokens per micro-batch, both engines")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per pass, after one warm-up")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        setup = Setup(device="cpu", dtype="fp32", attn="sdpa", layers=2, shape="tiny", max_tokens=64,
                      repeats=1)
    else:
        setup = Setup(device="cuda", dtype=args.dtype, attn="flash_attention_2" if args.dtype == "bf16" else "sdpa",
                      layers=args.layers, shape="qwen2.5-7b", max_tokens=args.max_tokens, repeats=args.repeats)
    if setup.layers < 1 or setup.repeats < 1 or setup.max_tokens < max(p + max(rs) for p, rs in setup.groups):
        raise ValueError(f"--layers and --repeats must be >= 1 and --max-tokens must fit the longest sequence, "
                         f"got {setup}")
    return setup, args.out


def main(argv=None) -> int:
    setup, out_path = parse_setup(argv)
    if setup.device == "cpu":
        # verl registers no CPU platform; ours is selected before verl imports its engines (docs/design.md §7).
        from augtree_verl.testing.harness import use_cpu_platform

        use_cpu_platform()
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check_engine: no CUDA device here; run it where the device tool lends a GPU, "
                             "or use --cpu-smoke")
        if setup.attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            raise SystemExit("gpu_check_engine: flash-attn is not installed (pip install -e '.[gpu]')")
        # fp32 parity needs true fp32 matmuls; bf16 runs are unaffected.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    import verl  # noqa: F401  (loads the augtree plugins: engine backend, CPU platform)
    import augtree_verl.integration  # noqa: F401  (and for a plain checkout without the entry points)

    report = run(setup)
    print(json.dumps(report, indent=2))
    if out_path:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=2)
    print(f"gpu_check_engine: {'PASS' if report['pass'] else 'FAIL'}  "
          f"log-prob rel err {report['log_probs']['rel_err_max']:.2e}, grad cosine {report['grad']['cosine']:.6f}, "
          f"forward+backward {report['time_s']['forward_backward']['stock']:.3f}s stock vs "
          f"{report['time_s']['forward_backward']['augtree']:.3f}s augtree", file=sys.stderr)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
