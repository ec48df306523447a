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

    def add_bytes(self, primitive: str, direction: str, nbytes: int) -> None:
        self.comm_bytes[f"{primitive}/{direction}"] += int(nbytes)

    @property
    def total_comm_bytes(self) -> int:
        return sum(self.comm_bytes.values())
