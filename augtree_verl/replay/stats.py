"""What one ``replay`` call did: phase times, token counts and bytes moved (for metrics and benchmarks).

Everything that sums, combines over a CP group or becomes a metric is read from the dataclass fields
(``PHASES``, ``ReplayStats.counters``, ``ReplayStats.keyed``): a new counter is one line, ``name: int = counter(...)``.

Phase timers (``start_timer`` / ``stop_timer``): on CPU wall-clock ``perf_counter``; on CUDA a pair of
CUDA events recorded on the current stream, so timing never synchronises the hot loop. Event pairs are
resolved (their end events waited for) only when a phase time is read.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import Field, dataclass, field, fields

import torch

from augtree_verl.plan import PRIMITIVES

# "single" counts trees run without a plan (one device, no planner); the others count trees by their plan's
# primitive (a planner fallback runs with the one-device plan: ring at degree 1).
PLAN_KINDS = ("single",) + PRIMITIVES
# the bytes of a trie's context-parallel root (``replay.cp_trie``): its ring prefill, the K/V all-gather and the
# gradients' return
TRIE_ROOT = "trie_root"
COMM_KEYS = tuple(f"{p}/{d}" for p in PRIMITIVES + (TRIE_ROOT,) for d in ("fwd", "bwd"))


def counter(metric: str | None = None):
    """An integer counter field: summed over a CP group and reported as the metric ``metric`` (default: the
    field's name)."""
    return field(default=0, metadata={"metric": metric})


def keyed(keys: tuple[str, ...]):
    """A ``dict[str, int]`` counter field; ``keys``: the ones summed over a CP group and reported (as
    ``<field>/<key>``)."""
    return field(default_factory=lambda: defaultdict(int), metadata={"keys": keys})


class _PhaseSeconds:
    """A phase-time field: reading it first adds the elapsed time of its pending CUDA event pairs.
    ``metric``: its metric name (default: the field's name)."""

    def __init__(self, metric: str | None = None):
        self.metric = metric

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
    prefill_s: float = _PhaseSeconds()  # Phase A: prompt forwards
    replay_s: float = _PhaseSeconds()  # Phase B: response micro-batches, forward (+ backward)
    prompt_backward_s: float = _PhaseSeconds("delayed_backward_s")  # Phase C: delayed prompt backwards
    # the forward-only pass a loss that couples the rows of a call needs first (``integration.loss_calls``)
    scores_first_s: float = _PhaseSeconds("loss/scores_first_s")
    logical_tokens: int = counter()  # sum over responses of |P| + |R_i| (what the flattened baseline runs)
    executed_tokens: int = counter()  # tokens run through the model (prompt once per tree, padding included)
    trees: int = counter()
    nodes: int = counter("trie/nodes")  # prefills of trie nodes (a group's prompt is one; dummies excluded)
    # context-parallel plans run on one device because their tree shares tokens with others beyond its own
    # prompt and its trie's root cannot run context-parallel (``step_plan.shared_root_plans``)
    trie_demoted: int = counter("trie/cp_demoted")
    cp_roots: int = counter("trie/cp_roots")  # tries whose root ran context-parallel (``replay.cp_trie``)
    # trees split into one per regime of a length-dependent rope, each prefilling its prompt (``replay.rope``)
    rope_splits: int = counter("rope/split_trees")
    # trees whose prompt has images (``replay.vlm``), each its own trie; their vision tower forwards (one a tree),
    # the lock-step's zero-weighted dummy tower calls, their context-parallel plans run on one device, and the trees
    # of a uid and prompt split by their images (``integration.batch_trees``)
    vision_trees: int = counter("vision/trees")
    tower_calls: int = counter("vision/tower_calls")
    tower_dummies: int = counter("vision/dummy_tower_calls")
    vision_cp_demoted: int = counter("vision/cp_demoted")
    vision_splits: int = counter("vision/split_trees")
    micro_batches: int = counter()
    offloaded_bytes: int = counter("offload/offloaded_bytes")  # prompt activations held on the host (``Offload``)
    prefetched_bytes: int = counter("offload/prefetched_bytes")  # of those, copied back ahead of their use
    offload_copies: int = counter("offload/copies")  # offload copies, both directions
    # bytes sent by this rank, keyed "<primitive>/fwd" and "<primitive>/bwd" (and the score exchanges')
    comm_bytes: dict[str, int] = keyed(COMM_KEYS)
    # plan kind -> number of trees run with it
    plans: dict[str, int] = keyed(PLAN_KINDS)

    @classmethod
    def counters(cls) -> list[Field]:
        """The integer counter fields (``counter``)."""
        return [f for f in fields(cls) if "metric" in f.metadata]

    @classmethod
    def keyed(cls) -> list[Field]:
        """The ``dict[str, int]`` counter fields (``keyed``)."""
        return [f for f in fields(cls) if "keys" in f.metadata]

    @staticmethod
    def metric_name(name: str) -> str:
        """The metric a phase or counter field ``name`` is reported as."""
        spec = vars(ReplayStats).get(name)
        metric = (
            spec.metric
            if isinstance(spec, _PhaseSeconds)
            else next(f for f in fields(ReplayStats) if f.name == name).metadata.get("metric")
        )
        return metric or name

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

    def add_bytes(self, primitive: str, direction: str, nbytes: int) -> None:
        self.comm_bytes[f"{primitive}/{direction}"] += int(nbytes)

    @property
    def total_comm_bytes(self) -> int:
        return sum(self.comm_bytes.values())


PHASES = tuple(name for name, value in vars(ReplayStats).items() if isinstance(value, _PhaseSeconds))
