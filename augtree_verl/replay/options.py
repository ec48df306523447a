"""``ReplayOptions``: how one ``replay`` runs, apart from what it runs (the ``StepPlan``, decided before it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from augtree_verl.replay.offload import Offload
from augtree_verl.replay.scoring import EntropyFn
from augtree_verl.replay.stats import ReplayStats


@dataclass(frozen=True)
class ReplayOptions:
    """``temperature`` > 0 divides the logits; ``entropy_fn`` (tempered float32 logits [N, V] -> entropy [N]) adds
    entropies to the scores; ``offload`` (``replay.offload.Offload``; training only): each prompt's saved
    activations wait in host memory between its prefill and its delayed backward; ``stats``: where the run counts
    (phase times, tokens, bytes, and the plan's demotions)."""

    temperature: float = 1.0
    entropy_fn: EntropyFn | None = None
    offload: Offload | None = None
    stats: ReplayStats = field(default_factory=ReplayStats)

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
