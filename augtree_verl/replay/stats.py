"""What one ``replay`` call did: phase times, token counts and bytes moved (for metrics and benchmarks)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class ReplayStats:
    prefill_s: float = 0.0           # Phase A: prompt forwards
    replay_s: float = 0.0            # Phase B: response micro-batches, forward (+ backward)
    prompt_backward_s: float = 0.0   # Phase C: delayed prompt backwards
    logical_tokens: int = 0          # sum over responses of |P| + |R_i| (what the flattened baseline runs)
    executed_tokens: int = 0         # tokens actually run through the model (prompt once per tree, padding included)
    trees: int = 0
    micro_batches: int = 0
    # bytes sent by this rank, keyed "<primitive>/fwd" and "<primitive>/bwd"
    comm_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # primitive name -> number of trees run with it
    plans: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, other: "ReplayStats", *, count_trees: bool = True) -> None:
        """Add ``other``'s times, executed tokens, micro-batches and bytes; its trees (logical tokens, tree
        and plan counts) only with ``count_trees`` (one member of a CP group counts a shared tree)."""
        self.prefill_s += other.prefill_s
        self.replay_s += other.replay_s
        self.prompt_backward_s += other.prompt_backward_s
        self.executed_tokens += other.executed_tokens
        self.micro_batches += other.micro_batches
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
