"""One benchmark process (a CP rank, or the only process): every method's update step, timed side by side.

Per workload: build the trees, then ``repeats`` rounds in which every method runs one full update step
(forward + backward of the GRPO loss, gradients zeroed before). Methods are interleaved within a round so
slow drifts of a shared machine hit them alike; the reported step time is the median over rounds, and
ratios between methods (``paired_ratio``) are medians of the per-round ratios, so load that drifts between
rounds cancels out. After
every step the method's parameter gradients (summed over CP ranks) are compared with the reference: the
flattened baseline's gradients (MegaN's own first step on one device; with CP, the flattened baseline run
untimed with the responses split over the ranks and the gradients summed). verl-fsdp2 (verl_fsdp2.py) is
checked the same way, and its log-probs against the flattened baseline's too. Before the rounds, every method
runs one more, untimed step under the memory meter (``integration.memory_meter.UnshardedGroups``, whose hooks
slow a step): each rank's peak bytes held (``peak_bytes``).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist
from tqdm import tqdm

from augtree_verl.bench.config import BenchConfig
from augtree_verl.bench.loss import grpo_loss
from augtree_verl.bench.methods import DEPTH1_SHARED_TOKENS, VERL_FSDP2, Method, describe_plans, methods_for
from augtree_verl.bench.workloads import SHARED_WORKLOADS, Workload, build_workload
from augtree_verl.cp.mesh import CPMesh
from augtree_verl.models import load_model, vocab_size
from augtree_verl.planner import ClusterProfile
from augtree_verl.planner.startup import startup_profile
from augtree_verl.replay import ReplayOptions, ReplayStats, StepPlan, Tree, per_response, replay
from augtree_verl.replay.baseline import flattened_replay
from augtree_verl.replay.flops import step_flops, trie_flops
from augtree_verl.replay.rope import RopeRegimes
from augtree_verl.replay.trie import build_trie

# float32: every method sums the same terms in another order (prompt adjoints accumulated over micro-batches,
# attention split over [prompt ; response] or over ranks), so gradients differ by rounding only; 1e-5 of a
# tensor's largest magnitude is ~100x float32 epsilon and far below any real bug.
FLOAT32_GRAD_RTOL = 1e-5
# bf16 (the CUDA path): epsilon 2^-8, so rounding of long sums in another order reaches ~1e-2.
BF16_GRAD_RTOL = 1e-2
VERL_NAME = VERL_FSDP2.name


@dataclass
class MethodResult:
    workload: str
    method: str
    step_times_s: list[float]
    executed_tokens: int
    logical_tokens: int
    comm_bytes: int
    max_grad_rel_err: float
    plan: str
    ideal_speedup: float
    tolerance: float
    speedup_vs_megan: float | None = None
    # The planner's predicted step time (AugTree methods; None for the baselines), beside the measured one.
    predicted_s: float | None = None
    # verl-fsdp2 only: its log-probs against the flattened baseline's, max|Δ| / max|ref| (None: not checked).
    max_logp_rel_err: float | None = None
    comm_counted: bool = True  # False for verl-fsdp2: FSDP2's all-gathers and reduce-scatters are not counted
    # Per rank: the most bytes one step held at once (``UnshardedGroups.peak_bytes``: tensors saved for backward,
    # in-flight prompts' K/V leaves, last hidden states and their gradient sums; for verl-fsdp2 also FSDP2's
    # unsharded parameters and gradients).
    peak_bytes: list[int] = field(default_factory=list)
    groups: list[dict] = field(default_factory=list)
    # The shared workloads only: ideal FLOP ratios of every shared token run once, and of depth-1 reuse, over
    # flattened (``ideal_trie_speedup``).
    ideal_trie: float | None = None
    ideal_depth1: float | None = None

    @property
    def prediction_error(self) -> float | None:
        """|predicted - measured| / measured, or None without a prediction."""
        if self.predicted_s is None:
            return None
        return abs(self.predicted_s - self.step_time_s) / self.step_time_s

    @property
    def max_peak_bytes(self) -> int:
        """The peak of the rank that held the most (what must fit on a device)."""
        return max(self.peak_bytes, default=0)

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.step_times_s)

    @property
    def wrong(self) -> bool:
        logp_ok = self.max_logp_rel_err is None or self.max_logp_rel_err <= self.tolerance
        return not (self.max_grad_rel_err <= self.tolerance and logp_ok)  # NaN is wrong too

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "step_time_s": self.step_time_s,
            "prediction_error": self.prediction_error,
            "status": "WRONG" if self.wrong else "ok",
        }

    @classmethod
    def from_dict(cls, row: dict) -> MethodResult:
        """Inverse of ``to_dict`` (the derived keys are recomputed)."""
        return cls(**{k: v for k, v in row.items() if k not in ("step_time_s", "prediction_error", "status")})


def run_benchmark(cfg: BenchConfig, rank: int = 0, world: int = 1, device: str = "cpu") -> list[MethodResult]:
    """Run every workload and method; with ``world`` > 1 all ranks call this inside one process group."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = load_model(cfg.model, device=device, dtype=dtype, seed=cfg.seed)
    methods = {name: methods_for(world, device, depth1=name in SHARED_WORKLOADS) for name in cfg.workloads}
    every = max(methods.values(), key=len)
    # The planner's cost model for this machine and process group, as a training run gets it: this model's,
    # device's and world's cache file (``planner.startup``: ``$AUGTREE_PROFILE_CACHE``), else calibrated now
    # (collective: every rank calls it and gets the same figures, so the ranks of a CP group plan alike) and
    # cached; on one device it only predicts the AugTree step times (``predicted_s``).
    run_profile = startup_profile(
        replace(
            ClusterProfile.default().with_model(model.config),
            activation_checkpointing=False,
            dtype_bytes=dtype.itemsize,
        ),
        user_file=None,
        device=torch.device(device),
        model=model,
    )
    profile = run_profile.profile
    if rank == 0:
        print(run_profile.describe([world]), flush=True)
    bar = tqdm(
        total=sum((cfg.repeats + 1) * len(m) + (world > 1) for m in methods.values()),
        disable=rank != 0,
        desc="augtree bench",
        unit="step",
        dynamic_ncols=True,
    )
    verl = _build_verl(model, every)
    _warm_up(model, every, rank, world, profile, device, verl)
    results = []
    for name in cfg.workloads:
        workload = build_workload(
            name, cfg.budget_tokens, cfg.group_size, cfg.num_groups, vocab_size=vocab_size(model), seed=cfg.seed
        )
        results += _run_workload(
            model,
            workload,
            methods[name],
            cfg.repeats,
            cfg.seed,
            rank,
            world,
            profile,
            bar,
            FLOAT32_GRAD_RTOL if dtype == torch.float32 else BF16_GRAD_RTOL,
            verl,
        )
    bar.close()
    if verl is not None:
        verl.close()
    return results


def _build_verl(model, methods: list[Method]):
    """verl's engine for the verl-fsdp2 method (imported only when that method runs), else None."""
    if not any(m.verl for m in methods):
        return None
    from augtree_verl.bench.verl_fsdp2 import VerlFsdp2

    return VerlFsdp2.build(model)


def _run_workload(
    model,
    workload: Workload,
    methods: list[Method],
    repeats: int,
    seed: int,
    rank: int,
    world: int,
    profile,
    bar,
    tolerance: float,
    verl=None,
) -> list[MethodResult]:
    device = model.get_input_embeddings().weight.device
    trees = [Tree.of_tokens(t.prompt.to(device), [r.to(device) for r in t.responses]) for t in workload.trees]
    loss_fn = grpo_loss(trees, seed)
    reference = None
    if world > 1:
        bar.set_postfix_str(f"{workload.name}: flattened reference")
        reference = _split_flattened_grads(model, trees, loss_fn, rank, world)
        bar.update()
    plans = {m.name: m.plans(trees, world, profile if world > 1 else None) for m in methods}
    shared = workload.name in SHARED_WORKLOADS
    ideal_trie = ideal_trie_speedup(model.config, trees) if shared else None
    ideal_depth1 = ideal_trie_speedup(model.config, trees, DEPTH1_SHARED_TOKENS) if shared else None
    results = {
        m.name: MethodResult(
            workload=workload.name,
            method=m.name,
            step_times_s=[],
            executed_tokens=0,
            logical_tokens=workload.logical_tokens,
            comm_bytes=0,
            max_grad_rel_err=0.0,
            plan=describe_plans(
                *m.as_run(trees, plans[m.name], profile, world), m.flattened, world if m.verl else None
            ),
            ideal_speedup=ideal_speedup(model.config, workload.groups),
            tolerance=tolerance,
            predicted_s=m.predicted_s(trees, plans[m.name], profile, world),
            groups=[
                {"id": g.id, "prompt_len": g.prompt_len, "response_lens": list(g.response_lens)}
                for g in workload.groups
            ],
            ideal_trie=ideal_trie,
            ideal_depth1=ideal_depth1,
        )
        for m in methods
    }
    verl_step = verl.prepare(model, trees, seed, rank, world) if verl is not None else None
    if verl_step is not None:
        results[VERL_NAME].max_logp_rel_err = verl_step.max_logp_rel_err
        results[VERL_NAME].comm_counted = False
    for m in methods:
        bar.set_postfix_str(f"{workload.name}: {m.name} (memory)")
        results[m.name].peak_bytes = _peak_bytes(
            model, trees, loss_fn, m, plans[m.name], world, profile, verl, verl_step
        )
        bar.update()
    for _ in range(repeats):
        for m in methods:
            bar.set_postfix_str(f"{workload.name}: {m.name}")
            res = results[m.name]
            seconds, stats = _timed_step(model, trees, loss_fn, m, plans[m.name], world, profile, verl, verl_step)
            grads = verl.full_grads() if m.verl else _summed_grads(model, world)
            if reference is None:  # one device: MegaN's first step is the flattened reference
                reference = grads
            res.step_times_s.append(seconds)
            res.max_grad_rel_err = _worse(res.max_grad_rel_err, max_rel_err(grads, reference))
            res.executed_tokens, res.comm_bytes = (
                (verl_step.executed_tokens, 0) if m.verl else _totals(stats, workload.logical_tokens, world, device)
            )
            bar.update()
    megan = results[methods[0].name]
    for res in results.values():
        res.speedup_vs_megan = paired_ratio(megan, res)
    return list(results.values())


def paired_ratio(a: MethodResult, b: MethodResult) -> float:
    """Median over rounds of a's step time / b's step time in the same round."""
    return statistics.median(x / y for x, y in zip(a.step_times_s, b.step_times_s))


def _warm_up(model, methods: list[Method], rank: int, world: int, profile, device, verl=None) -> None:
    """One untimed step per method on a small tree: first-call allocations, kernel choice, comm setup."""
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, vocab_size(model), (n,), generator=gen).to(device)
    trees = [Tree.of_tokens(ids(64), [ids(16), ids(24)])]
    loss_fn = grpo_loss(trees, 0)
    verl_step = verl.prepare(model, trees, 0, rank, world) if verl is not None else None
    for m in methods:
        _timed_step(model, trees, loss_fn, m, m.plans(trees, world, profile), world, profile, verl, verl_step)
    model.zero_grad(set_to_none=True)


def _timed_step(
    model, trees, loss_fn, method: Method, plans, world: int, profile, verl=None, verl_step=None
) -> tuple[float, ReplayStats | None]:
    model.zero_grad(set_to_none=True)
    _sync(model, world)
    start = time.perf_counter()
    stats = None
    if method.verl:
        verl.step(verl_step)
    elif method.flattened:
        flattened_replay(model, trees, loss_fn)
    else:
        stats = ReplayStats()
        # The CP group even where every plan is one-device: each tree (or trie) on its rank.
        mesh = CPMesh.whole_world() if world > 1 else None
        replay(
            model,
            StepPlan.build(
                trees,
                plans=plans,
                mesh=mesh,
                min_shared_tokens=method.min_shared_tokens,
                cp_alone=method.fixed is not None,
                trie_cost=method.trie_cost(profile, world),
                rope=RopeRegimes.of(model.config),
            ),
            per_response(loss_fn),
            ReplayOptions(stats=stats),
        )
    _sync(model, world)
    return time.perf_counter() - start, stats


def _peak_bytes(model, trees, loss_fn, method: Method, plans, world: int, profile, verl, verl_step) -> list[int]:
    """Each rank's peak bytes held during one untimed step of ``method`` (``UnshardedGroups`` on the model the
    method trains)."""
    # Imported here: the integration package loads verl, which ``augtree bench`` imports only when it needs it.
    from augtree_verl.integration.memory_meter import UnshardedGroups

    with UnshardedGroups(verl.engine.module if method.verl else model) as seen:
        _timed_step(model, trees, loss_fn, method, plans, world, profile, verl, verl_step)
    device = model.get_input_embeddings().weight.device
    peaks = [torch.tensor([seen.peak_bytes], dtype=torch.int64, device=device) for _ in range(world)]
    if world > 1:
        dist.all_gather(peaks, peaks[0].clone())
    return [int(p) for p in peaks]


def _sync(model, world: int) -> None:
    device = model.get_input_embeddings().weight.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if world > 1:
        dist.barrier()


def _totals(stats: ReplayStats | None, logical: int, world: int, device) -> tuple[int, int]:
    """(executed tokens, bytes sent) summed over ranks. The flattened baseline runs every logical token."""
    if stats is None:
        return logical, 0
    both = torch.tensor([stats.executed_tokens, stats.total_comm_bytes], dtype=torch.int64, device=device)
    if world > 1:
        dist.all_reduce(both)
    return int(both[0]), int(both[1])


def _as_tree(loss_fn, t: int, i: int, _t: int, _i: int, logp: torch.Tensor) -> torch.Tensor:
    """``loss_fn`` of response ``i`` of tree ``t``, called for a one-response tree (its own indices 0, 0)."""
    return loss_fn(t, i, logp)


def _summed_grads(model, world: int) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (zeros where none), summed over the CP ranks, in float32."""
    names, flat = [], []
    for n, p in model.named_parameters():
        names.append(n)
        flat.append((p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().reshape(-1))
    sizes = [f.numel() for f in flat]
    buf = torch.cat(flat)
    if world > 1:
        dist.all_reduce(buf)
    shapes = [p.shape for _, p in model.named_parameters()]
    return {n: t.view(s) for n, t, s in zip(names, buf.split(sizes), shapes)}


def _split_flattened_grads(model, trees, loss_fn, rank: int, world: int) -> dict[str, torch.Tensor]:
    """The flattened baseline's gradients with the responses dealt round-robin over the ranks, summed.

    The loss is a sum over responses, so the shares add up to the full flattened gradient exactly
    (up to the order of the final sum)."""
    model.zero_grad(set_to_none=True)
    flat = [(t, i) for t, tree in enumerate(trees) for i in range(len(tree.responses))]
    for t, i in flat[rank::world]:
        one = Tree.of_tokens(trees[t].prompt, [trees[t].responses[i]])
        flattened_replay(model, [one], functools.partial(_as_tree, loss_fn, t, i))
    return _summed_grads(model, world)


def _worse(a: float, b: float) -> float:
    """The larger error, NaN winning."""
    return a if a != a else b if b != b else max(a, b)


def max_rel_err(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """max over parameters of max|g - g0| / max|g0| (a parameter whose reference is all zero: max|g|)."""
    worst = 0.0
    for n, g0 in reference.items():
        diff = (grads[n] - g0).abs().max().item()
        scale = g0.abs().max().item()
        err = diff / scale if scale > 0 else diff
        if err != err:  # NaN
            return float("nan")
        worst = max(worst, err)
    return worst


def ideal_trie_speedup(config, trees, min_shared_tokens: int = 0) -> float:
    """Flattened over trie training FLOPs for one step over ``trees`` (``Tree.of_tokens``): the tries of
    ``replay.trie.build_trie`` with nodes of any length, shared when they save ``min_shared_tokens`` token
    passes (0: every shared token once; ``DEPTH1_SHARED_TOKENS``: each prompt once)."""
    flat = sum(step_flops(config, t.prompt_len, list(t.response_lens), reuse=False) for t in trees)
    return flat / trie_flops(config, build_trie(trees, min_node_tokens=1, min_shared_tokens=min_shared_tokens))


def ideal_speedup(config, groups) -> float:
    """Flattened over prompt-reuse training FLOPs for one step over ``groups`` (replay/flops.py's count)."""
    flat = sum(step_flops(config, g.prompt_len, list(g.response_lens), reuse=False) for g in groups)
    reuse = sum(step_flops(config, g.prompt_len, list(g.response_lens), reuse=True) for g in groups)
    return flat / reuse
