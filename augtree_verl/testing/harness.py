"""Run verl 0.9.1's real engines on CPU (docs/design.md §7): our CPU platform, gloo, a tiny Qwen2 from a config.

Importing this module has no side effects. Call :func:`use_cpu_platform` before anything imports
``verl.workers.engine`` (that import fixes verl's device for the process), then :func:`init_process_group`.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import random
import shutil
import socket
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

from augtree_verl.planner import ClusterProfile
from augtree_verl.testing import verl_batch

VOCAB = 128
MODEL_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    architectures=["Qwen2ForCausalLM"],
)
FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
# Noise added to the current policy's log-probs to make "old" ones: small enough that no token is clipped
# (a clipped token has zero gradient and would hide a wrong log-prob), large enough that ratios differ from 1.
OLD_LOGP_NOISE = 0.02
# AdamW's first update is lr * g / (|g| + eps): a gradient element below eps moves its weight by lr * g / eps, so
# a rounding error dg in it moves the weight by lr * dg / eps. Against a zero-initialised weight (biases), whose
# largest element is then about lr * G / (G + eps) (G: the largest gradient element), the weight's relative error
# is the gradient's times (1 + G / eps). The tiny models' gradients reach G = 3e-2 (v_proj.bias): eps 1e-3 made that
# factor 33, and a gradient agreeing to 4e-7 gave weights 1.2e-5 apart on an AVX-512 CPU
# (test_engine_parity_dp2); eps 1e-2 keeps the factor near 4, weights compare at the gradients' tolerance.
ADAM_EPS = 1e-2


def use_cpu_platform() -> None:
    """Select our CPU platform for verl in this process (and the processes it spawns, through the environment).

    Sets ``VERL_PLATFORM=cpu`` (and a private inductor cache folder, removed when this process exits: some
    runs write one even with torch.compile off), imports verl and our plugin, and resolves verl's platform.
    RuntimeError if this process resolved it to another device before (verl keeps the first one).
    """
    os.environ["VERL_PLATFORM"] = "cpu"
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        cache = tempfile.mkdtemp(prefix="augtree-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
    import verl  # noqa: F401  (loads our entry point when the package is installed)
    from verl.utils.device import get_device_name

    import augtree_verl.integration  # noqa: F401  (and this covers a plain checkout)

    if get_device_name() != "cpu":
        raise RuntimeError(
            f"verl resolved its device to {get_device_name()!r} before use_cpu_platform(); call it "
            "first in the process, before anything imports verl.workers.engine"
        )


# The ports free_port picks from: below Linux's ephemeral range (ip_local_port_range, 32768-60999 by default), which
# the kernel hands out as the local end of every outgoing connection, and above Ray's worker ports (10002-19999). A
# port bind(0) picked came from the ephemeral range, and once a connection of a background launch took it before
# the ranks bound it (EADDRINUSE in init_process_group).
PORT_RANGE = (20000, 32768)


def free_port() -> int:
    """A localhost TCP port free now, drawn from ``PORT_RANGE`` (no connection is given it meanwhile)."""
    draw = random.SystemRandom()  # not the test's seeded ``random``: two draws in a session differ
    for _ in range(1000):
        port = draw.randrange(*PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE} after 1000 draws")


# What a rank needs that takes seconds to import: ranks fork from one server process (multiprocessing's
# "forkserver") that imported these once, instead of each spawned rank importing them afresh (~9 s of a 2-rank
# launch on 2 cores, every launch). verl's platform is resolved there, after use_cpu_platform (below).
RANK_PRELOAD = ["torch", "transformers", "verl.workers.engine", "augtree_verl.integration", __name__]


def rank_start_method() -> str:
    """The start method of CPU gloo ranks: ``"forkserver"``, its server preloading :data:`RANK_PRELOAD` on the CPU
    platform (the preload takes effect when this process first starts the server). A rank forked from it starts
    with the server's environment: :func:`rank_entry` gives it the caller's, as a spawned rank has."""
    import multiprocessing

    use_cpu_platform()
    multiprocessing.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    return "forkserver"


def rank_entry(rank: int, environ: dict, fn, args: tuple) -> None:
    """``fn(rank, *args)`` in a rank started by :func:`rank_start_method`, with ``environ`` (the caller's
    ``os.environ`` when it started the ranks) as its environment."""
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` (``fn(rank, *args)`` on every rank, joined, the first
    failing rank's error raised here) with ranks started by :func:`rank_start_method`."""
    import torch.multiprocessing as mp

    mp.start_processes(
        rank_entry, args=(dict(os.environ), fn, args), nprocs=nprocs, join=True, start_method=rank_start_method()
    )


def spawn(fn, args: tuple, nprocs: int, timeout_s: float) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes (one gloo rank each, :func:`rank_start_method`) and
    wait for all of them.

    Each rank runs one intra-op thread (the ranks share the machine's cores; more threads each only make
    them wait for one another). The first failing rank's error is raised here (torch terminates the others).
    After ``timeout_s`` seconds (e.g. ranks deadlocked in mismatched collectives) every rank is killed and
    TimeoutError raised. No process outlives the call.
    """
    import torch.multiprocessing as mp

    method = rank_start_method()
    context = mp.start_processes(
        rank_entry,
        args=(dict(os.environ), _one_thread_rank, (fn, args)),
        nprocs=nprocs,
        join=False,
        start_method=method,
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{fn.__name__}: {nprocs} ranks still running after {timeout_s:.0f} s (deadlocked collectives?)"
                )
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


def _one_thread_rank(rank: int, fn, args: tuple) -> None:
    torch.set_num_threads(1)
    fn(rank, *args)


def init_process_group(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    """A gloo group (world size 1 in-process by default); a no-op if this process already has one."""
    if dist.is_initialized():
        return
    port = port or free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)


def save_tiny_qwen2(directory: str, seed: int = 0, num_hidden_layers: int = MODEL_SHAPE["num_hidden_layers"]) -> str:
    """A random-weight tiny Qwen2 (GQA) saved as a Hugging Face checkpoint; returns its path."""
    torch.manual_seed(seed)
    Qwen2ForCausalLM(Qwen2Config(**{**MODEL_SHAPE, "num_hidden_layers": num_hidden_layers})).save_pretrained(directory)
    return directory


def build_engine(
    strategy: str,
    model_path: str,
    *,
    loss_agg_mode: str = "token-mean",
    lr: float = 1e-2,
    weight_decay: float = 0.0,
    entropy_coeff: float = 0.0,
    gradient_checkpointing: bool = False,
    engine_knobs: dict | None = None,
    forward_only: bool = False,
    model_settings: dict | None = None,
):
    """verl's engine for ``strategy`` ("fsdp2" = stock, "augtree" = ours), built the way verl's workers build it.

    ``model_settings``: fields of verl's ``HFModelConfig`` (``actor_rollout_ref.model``), e.g. ``lora_rank``.

    ``forward_only=True`` builds it as verl builds the reference policy's engine. A training AugTree engine
    plans with a fixed profile of the model (``planner_profile``: no start-up calibration, which engines that
    only test exactness do not need) unless ``engine_knobs`` names ``planner_profile`` (None: calibrate).

    Returns ``(engine, loss_fn)`` with ``loss_fn`` verl's ``ppo_loss`` bound to the actor config.
    """
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss

    from augtree_verl.integration.config import AugTreeEngineConfig

    # verl packs rows for use_remove_padding, which hybrid linear-attention models (Qwen3.5, Qwen3-Next) do not
    # support on the torch kernels (the recurrence would run across rows): verl's note for them is False.
    text = AutoConfig.from_pretrained(model_path).get_text_config(decoder=True)
    hybrid = "linear_attention" in (getattr(text, "layer_types", None) or ())
    model_config = HFModelConfig(
        path=model_path,
        load_tokenizer=False,
        enable_gradient_checkpointing=gradient_checkpointing,
        override_config={"attn_implementation": "sdpa"},
        **{"use_remove_padding": not hybrid, **(model_settings or {})},
    )
    common: dict[str, Any] = dict(mixed_precision=FP32, use_torch_compile=False, forward_only=forward_only)
    if strategy == "augtree":
        knobs = dict(engine_knobs or {})
        if not forward_only and "planner_profile" not in knobs:
            knobs["planner_profile"] = fixed_profile(model_path, gradient_checkpointing, FP32["param_dtype"])
        fsdp_config = AugTreeEngineConfig(**common, **knobs)
    else:
        fsdp_config = FSDPEngineConfig(strategy=strategy, **common)
    optim = FSDPOptimizerConfig(
        lr=lr,
        clip_grad=1.0,
        total_training_steps=100,
        weight_decay=weight_decay,
        override_optimizer_config={"eps": ADAM_EPS},
    )
    actor_config = FSDPActorConfig(
        strategy=strategy,
        rollout_n=1,
        ppo_mini_batch_size=8,
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
        loss_agg_mode=loss_agg_mode,
        entropy_coeff=entropy_coeff,
        fsdp_config=fsdp_config,
        optim=optim,
        use_torch_compile=False,
    )
    # What ActorRolloutRefWorker.init_model sets on the engine config.
    engine_config = actor_config.engine
    engine_config.use_dynamic_bsz = False
    engine_config.micro_batch_size_per_gpu = 2
    engine_config.infer_micro_batch_size_per_gpu = 2
    torch.manual_seed(0)  # what verl draws at build (LoRA's A matrices): the same for every engine built here
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optim,
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine, functools.partial(ppo_loss, config=actor_config)


def fixed_profile(model_path: str, gradient_checkpointing: bool, param_dtype: str, **figures) -> str:
    """A profile file of the model at ``model_path`` as the engine trains it here (compute dtype ``param_dtype``,
    verl's mixed-precision name; this world's ranks on one node), with the default profile's hardware figures
    (``figures``: some replaced, e.g. ``flops_per_s``); written beside the model."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    dtype_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}[param_dtype]
    profile = dataclasses.replace(
        ClusterProfile.default().with_model(AutoConfig.from_pretrained(model_path)),
        dtype_bytes=dtype_bytes,
        activation_checkpointing=gradient_checkpointing,
        ranks_per_node=world,
        **figures,
    )
    tag = "".join(f"_{k}{v:g}" for k, v in sorted(figures.items()))
    path = os.path.join(
        model_path, f"planner_profile_w{world}_ckpt{int(gradient_checkpointing)}_{param_dtype}{tag}.json"
    )
    partial = f"{path}.{os.getpid()}.tmp"  # every rank writes the same file: whole, never half-read
    profile.save(partial)
    os.replace(partial, path)
    return path


def group_batch(
    groups: list[tuple[int, list[int]]],
    *,
    seed: int = 0,
    micro_batch_size: int = 2,
    order: list[int] | None = None,
    temperature: float = 1.0,
) -> TensorDict:
    """A verl V1 batch (nested, no padding) of :func:`group_rows`, permuted by ``order`` (e.g. a shuffle).

    ``old_log_probs`` are placeholders: set them with :func:`set_old_log_probs`.
    """
    rows = group_rows(groups, seed=seed)
    if order is not None:
        rows = [rows[i] for i in order]
    return rows_to_batch(rows, micro_batch_size=micro_batch_size, temperature=temperature)


def group_rows(groups: list[tuple[int, list[int]]], *, seed: int = 0) -> list[dict]:
    """``groups[g] = (prompt_len, [response_len, ...])`` -> rows, group by group, one uid per group."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for gi, (p, rs) in enumerate(groups):
        prompt = torch.randint(0, VOCAB, (p,), generator=g)
        advantages = torch.randn(len(rs), generator=g)
        for ri, r in enumerate(rs):
            rows.append(
                dict(
                    uid=f"group-{gi}",
                    prompt=prompt,
                    response=torch.randint(0, VOCAB, (r,), generator=g),
                    advantage=float(advantages[ri]),
                )
            )
    return rows


def rows_to_batch(
    rows: list[dict],
    *,
    micro_batch_size: int = 2,
    temperature: float = 1.0,
    extra: dict[str, list] | None = None,
    mrope: bool = False,
) -> TensorDict:
    """The harness's batches: fixed-size micro-batches of ``micro_batch_size`` rows (see ``verl_batch``)."""
    return verl_batch.rows_to_batch(
        rows,
        extra=extra,
        mrope=mrope,
        temperature=temperature,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch_size,
    )


response_logps = verl_batch.response_values


def set_old_log_probs(batch: TensorDict, current: list[torch.Tensor], seed: int = 0) -> None:
    """old_log_probs = current log-probs + small noise (see OLD_LOGP_NOISE)."""
    g = torch.Generator().manual_seed(seed)
    batch["old_log_probs"] = torch.nested.as_nested_tensor(
        [c + OLD_LOGP_NOISE * torch.randn(c.shape, generator=g) for c in current], layout=torch.jagged
    )


def full_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter as a full (unsharded) tensor, by name."""
    out = {}
    for name, value in engine.module.state_dict().items():
        out[name] = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
    return out
