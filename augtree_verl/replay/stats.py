"""What one ``replay`` call did: phase times, token counts and bytes moved (for metrics and benchmarks).

Phase timers (``start_timer`` / ``stop_timer``): on CPU wall-clock ``perf_counter``; on CUDA a pair of
CUDA events recorded on the current stream, so timing never synchronises the hot loop. Event pairs are
resolved (their end events waited for) only when a phase time is read.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

PHASES = ("prefill_s", "replay_s", "prompt_backward_s")


class _PhaseSeconds:
    """A phase-time field: reading it first adds the elapsed time of its pending CUDA event pairs."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return 0.0  # the dataclass default
        pending = obj.__dict__.setdefault("_pending", [])
        if pending:
            obj._resolve()
        return obj.__dict__.get("_" + self.name, 0.0)

    def __set__(self, obj, value):
        obj.__dict__["_" + self.name] = float(value)


@dataclass
class ReplayStats:
    prefill_s: float = _PhaseSeconds()          # Phase A: prompt forwards
    replay_s: float = _PhaseSeconds()           # Phase B: response micro-batches, forward (+ backward)
    prompt_backward_s: float = _PhaseSeconds()  # Phase C: delayed prompt backwards
    logical_tokens: int = 0          # sum over responses of |P| + |R_i| (what the flattened baseline runs)
    executed_tokens: int = 0         # tokens actually run through the model (prompt once per tree, padding included)
    trees: int = 0
    micro_batches: int = 0
    offloaded_bytes: int = 0         # prompt activations held on the host instead of the device (``Offload``)
    prefetched_bytes: int = 0        # of those, bytes copied back ahead of the prompt backward's use
    offload_copies: int = 0          # offload copies, both directions
    # bytes sent by this rank, keyed "<primitive>/fwd" and "<primitive>/bwd"
    comm_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # primitive name -> number of trees run with it
    plans: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def start_timer(self, device: torch.device):
        """A start mark for ``stop_timer``: a recorded CUDA event on a CUDA device, else ``perf_counter()``."""
        if torch.device(device).type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop_timer(self, phase: str, start) -> None:
        """Add the time since ``start`` (from ``start_timer``) to ``phase`` (one of ``PHASES``); on CUDA
        the end event is recorded now and the pair resolved when the phase time is next read."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}, expected one of {PHASES}")
        if isinstance(start, float):
            setattr(self, phase, getattr(self, phase) + time.perf_counter() - start)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.__dict__.setdefault("_pending", []).append((phase, start, end))

    def _resolve(self) -> None:
        pending, self.__dict__["_pending"] = self.__dict__["_pending"], []
        for phase, start, end in pending:
            end.synchronize()
            self.__dict__["_" + phase] = self.__dict__.get("_" + phase, 0.0) + start.elapsed_time(end) / 1000.0

    def add(self, other: ReplayStats, *, count_trees: bool = True) -> None:
        """Add ``other``'s times, executed tokens, micro-batches, bytes and offload counters; its trees (logical
        tokens, tree and plan counts) only with ``count_trees`` (one member of a CP group counts a shared tree)."""
        self.prefill_s += other.prefill_s
        self.replay_s += other.replay_s
        self.prompt_backward_s += other.prompt_backward_s
        self.executed_tokens += other.executed_tokens
        self.micro_batches += other.micro_batches
        self.offloaded_bytes += other.offloaded_bytes
        self.prefetched_bytes += other.prefetched_bytes
        self.offload_copies += other.offload_copies
        for key, value in other.comm_bytes.items():
            self.comm_bytes[key] += value
        if count_trees:
            self.logical_tokens += other.logical_tokens
            self.trees += other.trees
            for key, value in other.plans.items():
                self.plans[key] += value

    def add_bytes(self, primitive: str, direction: str, nbytes: int) -> None:
        self.comm_bytes[f"{primitive}/{direction}"] += int(nbytes)

    @property
    def total_comm_bytes(self) -> int:
        return sum(self.comm_bytes.values())
