"""The run's planner profile, made once at start-up on the trainer workers (docs/design.md §6).

    run = startup_profile(base, user_file=None, device=device, group=group, model=model)
    run.profile, run.source      # the ClusterProfile every planner of the run uses, and where it came from

``base`` carries the run's model shape, dtype and activation checkpointing (``ClusterProfile.with_model`` plus
``dataclasses.replace``). Its hardware figures come from, in this order:

1. ``user_file`` (the engine knob ``planner_profile``): a profile JSON, e.g. a cache file of an earlier run;
2. the cache: ``$AUGTREE_PROFILE_CACHE`` (default ``~/.cache/augtree-verl/profiles``) holds one file per
   (model shape, dtype, checkpointing, device, world size, ranks per node, CP costs fitted or not), named by a
   hash of that key; a run without CP (``context_parallel=False``) also takes a file with them fitted;
3. ``calibrate.calibrate(base, group, device, model)`` on this device and process group (seconds), saved to the cache.

A file whose model fields (``MODEL_FIELDS``) differ from the run's is refused by name (a user file) or
recalibrated over (a cache file). Collective over ``group`` when it has more than one rank: rank 0 of the
group reads the files and broadcasts what it found (or the error, which every rank raises), so ranks on
nodes with different caches never disagree on whether to calibrate. Every rank gets the same profile: rank 0's
file, or the calibration, whose figures the ranks agree on (``calibrate``). ``publish`` keeps the result in the
process (the training engine's worker), ``published_profile`` hands it to the trainer (run there by name).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from augtree_verl.planner.calibrate import calibrate
from augtree_verl.planner.profile import MODEL_FIELDS, ClusterProfile

CACHE_ENV = "AUGTREE_PROFILE_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/augtree-verl/profiles")


@dataclass(frozen=True)
class RunProfile:
    profile: ClusterProfile
    source: str  # "calibrated now (...)", "cache file PATH" or "the user's file PATH"

    def describe(self, degrees) -> str:
        """One line for the start-up log: the figures and where they came from."""
        p = self.profile
        return (
            f"planner profile from {self.source}: dense {p.flops_per_s:.3g} FLOP/s, attention "
            f"{p.attention_flops_per_s:.3g} FLOP/s (causal {p.causal_attention_flops_per_s:.3g}), p2p "
            f"{p.p2p_bytes_per_s:.3g} B/s, all-to-all {p.collective_bytes_per_s:.3g} B/s; fixed costs: score "
            f"exchange {p.launch_latency_s:.3g} s, ring hop {p.ring_hop_s:.3g} s, all-to-all "
            f"{p.all_to_all_s:.3g} s, call {p.call_overhead_s:.3g} s, slot {p.slot_overhead_s:.3g} s; memory "
            f"{p.memory_per_rank_bytes:.3g} B/rank, {p.ranks_per_node} ranks/node; model "
            f"{p.num_layers} layers, hidden {p.hidden_size}, heads {p.num_heads}/{p.num_kv_heads}x"
            f"{p.head_dim}, MLP {p.intermediate_size}, vocab {p.vocab_size}, {p.dtype_bytes} B/element, "
            f"checkpointing {'on' if p.activation_checkpointing else 'off'}; CP degrees {list(degrees)}"
        )


def device_name(device: torch.device) -> str:
    """What the cache key calls this device: the accelerator's name, or the CPU's architecture and cores."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}-{platform.machine()}-{os.cpu_count()}cores"


def cache_file(
    profile: ClusterProfile,
    device: torch.device,
    world: int,
    cache_dir: Path | None = None,
    context_parallel: bool = True,
) -> Path:
    """The cache file of ``profile``'s model fields on ``device`` in a world of ``world`` ranks, its CP fixed costs
    fitted or not (``context_parallel``, ``calibrate.calibrate``)."""
    key = {name: getattr(profile, name) for name in MODEL_FIELDS}
    key.update(
        ranks_per_node=profile.ranks_per_node,
        device=device_name(device),
        world=world,
        context_parallel=context_parallel,
    )
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = cache_dir if cache_dir is not None else Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR)
    slug = "".join(c if c.isalnum() else "-" for c in key["device"])
    return root.expanduser() / f"profile-{slug}-w{world}-{digest}.json"


_published: RunProfile | None = None  # this process's training engine's profile (``publish``)


def publish(run: RunProfile) -> None:
    """Keep ``run`` as this process's profile, for ``published_profile``."""
    global _published
    _published = run


def published_profile() -> dict:
    """``{"profile": ClusterProfile dict, "source": str}`` of this process's training engine; what the trainer
    runs on the actor worker group's rank 0. ``ValueError`` when no AugTree engine trains here."""
    if _published is None:
        raise ValueError(
            "no AugTree training engine has made a planner profile in this worker process "
            "(actor_rollout_ref.actor.strategy must be augtree)"
        )
    return {"profile": _published.profile.to_dict(), "source": _published.source}


def startup_profile(
    base: ClusterProfile,
    *,
    user_file: str | None,
    device: torch.device,
    group=None,
    model=None,
    lockstep_group=None,
    cache_dir: Path | None = None,
    context_parallel: bool = True,
) -> RunProfile:
    """The run's profile (see the module docstring); ``model`` and ``lockstep_group``: what calibration
    replays (``ClusterProfile.calibrate``; optional); ``context_parallel=False``: the run plans no CP (its
    ``cp_degrees`` are [1]), so a calibration fits no CP fixed costs and a cache file of either kind serves."""
    device = torch.device(device)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    world = dist.get_world_size(group) if distributed else 1
    path = cache_file(base, device, world, cache_dir, context_parallel)
    # A run without CP also reads a file with the CP costs fitted (its other figures are the same measurements).
    paths = [path] if context_parallel else [cache_file(base, device, world, cache_dir, True), path]
    found: list = [None]
    if not distributed or dist.get_rank(group) == 0:
        found[0] = _read(base, user_file, paths)
    if distributed:
        dist.broadcast_object_list(found, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    kind, value = found[0]
    if kind == "error":
        raise ValueError(value)
    if kind == "found":
        profile, source = value
        return RunProfile(
            dataclasses.replace(
                ClusterProfile.from_dict(profile), min_parallel_efficiency=base.min_parallel_efficiency
            ),
            source,
        )
    start = time.perf_counter()
    profile = calibrate(
        base, group=group, device=device, model=model, lockstep_group=lockstep_group, context_parallel=context_parallel
    )
    seconds = time.perf_counter() - start
    note = f"calibrated now in {seconds:.1f} s on {device_name(device)}, world {world}"
    if not context_parallel:
        note += " (no CP costs fitted: one-device plans only)"
    if not distributed or dist.get_rank(group) == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            profile.save(partial)
            partial.replace(path)  # atomic: a concurrent reader sees all or nothing
            note += f", cached to {path}"
        except OSError as err:
            note += f", not cached ({err})"
    return RunProfile(profile, note)


def _read(base: ClusterProfile, user_file: str | None, paths: list[Path]) -> tuple[str, object]:
    """("found", (profile dict, source)), ("calibrate", None) or ("error", message), on rank 0: the user's file,
    else the first of the cache ``paths`` that holds a profile of ``base``'s model."""
    if user_file is not None:
        try:
            profile = ClusterProfile.load(user_file)
        except (OSError, ValueError, TypeError) as err:
            return "error", f"planner_profile={user_file!r} cannot be read as a ClusterProfile: {err}"
        mismatch = _model_mismatch(profile, base)
        if mismatch:
            return "error", (
                f"planner_profile={user_file!r} was made for another model: {mismatch}; use a "
                f"profile of this model, dtype and checkpointing, or unset planner_profile to "
                f"calibrate one"
            )
        return "found", (profile.to_dict(), f"the user's file {user_file}")
    for path in paths:
        try:
            profile = ClusterProfile.load(path)
        except (OSError, ValueError, TypeError):
            continue
        if not _model_mismatch(profile, base):
            return "found", (profile.to_dict(), f"cache file {path}")
    return "calibrate", None


def _model_mismatch(profile: ClusterProfile, run: ClusterProfile) -> str:
    """'' when ``profile`` has ``run``'s model fields and ranks per node, else the differing ones by name."""
    names = (*MODEL_FIELDS, "ranks_per_node")
    return ", ".join(
        f"{n}={getattr(profile, n)!r} (this run: {getattr(run, n)!r})"
        for n in names
        if getattr(profile, n) != getattr(run, n)
    )
