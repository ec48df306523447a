"""What one ``augtree bench`` run measures: workloads, budget, group size, CP degree, model, device, repeats."""

from __future__ import annotations

from dataclasses import dataclass, replace

from augtree_verl.bench.workloads import ALL_WORKLOADS, WORKLOADS
from augtree_verl.models import DEFAULT_MODEL

# Defaults sized for 2 CPU cores: 5 repeats steady the paired ratios of sub-second steps. Measured on an
# otherwise idle 2-core machine (load ~2, the bench's own two ranks): the default run takes 14 min, --quick 2 min,
# before AugTree[one device] and the metered memory step per method (whose hooks about double a step) were added;
# not measured since: by step count, about 1.6x that (--quick 1.9x).
DEFAULT_BUDGET = 32_768
DEFAULT_GROUP_SIZE = 8
DEFAULT_REPEATS = 5
DEFAULT_CP = 2  # shows every method (MegaR and the CP primitives need d > 1) on a 2-core machine
QUICK = dict(budget_tokens=8_192, group_size=4, repeats=3, model="qwen2-tiny")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class BenchConfig:
    workloads: tuple[str, ...] = WORKLOADS
    budget_tokens: int = DEFAULT_BUDGET  # logical tokens per group (G·P + ΣR_i), see workloads.py
    group_size: int = DEFAULT_GROUP_SIZE
    num_groups: int | None = None  # groups (trees) per step; None: the workload's (workloads.DEFAULT_GROUPS)
    cp: int = DEFAULT_CP
    model: str = DEFAULT_MODEL
    device: str = "cpu"
    repeats: int = DEFAULT_REPEATS
    seed: int = 0

    def __post_init__(self):
        for w in self.workloads:
            if w not in ALL_WORKLOADS:
                raise ValueError(f"unknown workload {w!r}; choose one of {ALL_WORKLOADS} or 'all'")
        if not self.workloads:
            raise ValueError("no workload given")
        for name in ("budget_tokens", "group_size", "num_groups", "cp", "repeats"):
            value = getattr(self, name)
            if name == "num_groups" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")

    @classmethod
    def quick(cls, **overrides) -> BenchConfig:
        return cls(**{**QUICK, **overrides})

    def with_(self, **changes) -> BenchConfig:
        return replace(self, **changes)
