"""The AugTree engine's knobs: verl's FSDP engine config plus the replay and planner settings.

Selected in a verl run with::

    actor_rollout_ref.actor.strategy=augtree
    actor_rollout_ref.actor.fsdp_config._target_=augtree_verl.integration.config.AugTreeEngineConfig
    +actor_rollout_ref.actor.fsdp_config.micro_batch_tokens=16384   # any knob below, with a leading +
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verl.workers.config import FSDPEngineConfig

from augtree_verl.integration import verl_compat
from augtree_verl.integration.strategy import STRATEGY
from augtree_verl.plan import PRIMITIVES
from augtree_verl.planner.client import DEFAULT_TIMEOUT_S
from augtree_verl.planner.service import DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S
from augtree_verl.replay.microbatch import DEFAULT_MICRO_BATCH_TOKENS

# The FSDP sharding the "augtree" strategy builds on. "fsdp"/"fsdp2" are accepted as the strategy too: verl's
# fsdp_config yaml says "fsdp" until the actor config copies its own strategy ("augtree") onto it.
FSDP_STRATEGY = "fsdp2"
ACCEPTED_STRATEGIES = (STRATEGY, "fsdp", FSDP_STRATEGY)


@dataclass
class AugTreeEngineConfig(FSDPEngineConfig):
    """verl's ``FSDPEngineConfig`` plus:

    micro_batch_tokens: token budget of one replay micro-batch (rows x longest response).
    cp_degrees: context-parallel degrees the planner may choose from (1 = one device per tree). Ranks form
        CP groups of max(cp_degrees) ranks that share their samples (data-parallel size = world / max); a
        tree planned with degree d runs on d ranks of its group. Each degree must divide the largest.
    The planner knobs below (``use_planner`` to ``planner_max_entries``) are read by the AugTree trainer modes
    from the actor's config; the trainer plans every group and puts the plans in the batch, which the actor
    and the reference model both apply (a plain verl trainer puts none: every tree runs on one device).

    use_planner: True: plans come from the planner service (a named Ray actor, fed by the rollout workers
        while the rollout runs; the trainer plans in-process what it cannot hand over). False: no service;
        the trainer plans every group in-process, with the same planner (the same plans, CP included).
    force_primitive: pin the planner to one primitive ("ring", "tree_move_kv", "move_q"); None lets it choose.
    fallback_threshold_tokens: a group whose prompt + longest response is shorter than this runs without CP.
    planner_name: name of the planner service the rollout workers report group lengths to.
    planner_timeout_s: how long the trainer waits for the planner service's answer before planning the
        groups in-process (counted as ``planner/unreachable``).
    planner_ttl_s: how long the planner service keeps a reported group's plan that no step has used (an
        async trainer uses a group a few steps after its rollout; DAPO drops some groups for good).
    planner_max_entries: the most unused plans the service keeps; the oldest leave first (counted as evicted).
    planner_profile: a ``ClusterProfile`` JSON file (e.g. a cache file of an earlier run) with the hardware
        figures to plan with; None: the training engine takes them from the cache or calibrates them at
        start-up (``integration.run_profile``). Its model shape, dtype and checkpointing must be the run's.
    offload_prompt_activations: while a tree's responses replay, its prompt's saved activations (the
        checkpoint boundaries under gradient checkpointing) wait in host memory for the delayed prompt
        backward (``replay.offload``): pinned buffers and a side stream on CUDA, prefetched a layer ahead.
        Context-parallel trees too: each rank offloads its own shard of the prompt.
    replay_memory_budget_gib: the device memory (GiB) one rank's replay of a step may need at its peak
        (``replay.memory``: the deepest trie path's K/V, gradient sums and saved activations plus the largest
        call); a step over it is refused before its first model call, on every rank at once, naming the trie,
        the node and its length. None: on CUDA the memory this process may still use less a safety margin
        (``replay.memory.device_budget_bytes``), on CPU no check.
    probe_prompt_tokens, probe_response_tokens: the run's longest prompt and response (recipes set them from
        verl's ``data.max_prompt_length`` and ``data.max_response_length``): the start-up exactness probe
        (``replay.model_check.probe_exactness``) also replays a row of their lengths and crosses every length
        threshold of the model below their sum, capped to the longest row the device holds (within
        ``replay_memory_budget_gib``). None (either): the probe's short tree and the thresholds the model's
        positions reach.
    """

    strategy: str = STRATEGY
    micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS
    cp_degrees: list[int] = field(default_factory=lambda: [1])
    use_planner: bool = True
    force_primitive: str | None = None
    fallback_threshold_tokens: int = 0
    planner_name: str = "augtree_planner"
    planner_timeout_s: float = DEFAULT_TIMEOUT_S
    planner_ttl_s: float = DEFAULT_TTL_S
    planner_max_entries: int = DEFAULT_MAX_ENTRIES
    planner_profile: str | None = None
    offload_prompt_activations: bool = False
    replay_memory_budget_gib: float | None = None
    probe_prompt_tokens: int | None = None
    probe_response_tokens: int | None = None

    def __post_init__(self):
        # FSDPEngineConfig.__post_init__ only adds a strategy assertion that rejects "augtree".
        verl_compat.engine_config_post_init(self)
        if self.strategy not in ACCEPTED_STRATEGIES:
            raise ValueError(
                f"AugTreeEngineConfig.strategy must be one of {ACCEPTED_STRATEGIES}, got {self.strategy!r}"
            )
        _check_int("micro_batch_tokens", self.micro_batch_tokens, minimum=1)
        _check_int("fallback_threshold_tokens", self.fallback_threshold_tokens, minimum=0)
        _check_int("planner_max_entries", self.planner_max_entries, minimum=1)
        for name in ("probe_prompt_tokens", "probe_response_tokens"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        degrees = list(self.cp_degrees) if not isinstance(self.cp_degrees, (str, bytes)) else None
        if not degrees:
            raise ValueError(
                f"AugTreeEngineConfig.cp_degrees must be a non-empty list of ints, got {self.cp_degrees!r}"
            )
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in degrees):
            raise ValueError(f"AugTreeEngineConfig.cp_degrees must hold ints >= 1, got {degrees!r}")
        if any(max(degrees) % d for d in degrees):
            raise ValueError(f"AugTreeEngineConfig.cp_degrees must each divide the largest, got {degrees!r}")
        verl_compat.set_frozen_field(self, "cp_degrees", sorted(set(degrees)))
        if self.force_primitive is not None and self.force_primitive not in PRIMITIVES:
            raise ValueError(
                f"AugTreeEngineConfig.force_primitive must be None or one of {PRIMITIVES}, got {self.force_primitive!r}"
            )
        for name in ("use_planner", "offload_prompt_activations"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"AugTreeEngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.planner_name, str) or not self.planner_name:
            raise ValueError(f"AugTreeEngineConfig.planner_name must be a non-empty string, got {self.planner_name!r}")
        if (
            isinstance(self.planner_timeout_s, bool)
            or not isinstance(self.planner_timeout_s, (int, float))
            or not self.planner_timeout_s > 0
        ):
            raise ValueError(
                f"AugTreeEngineConfig.planner_timeout_s must be a number > 0, got {self.planner_timeout_s!r}"
            )
        if (
            isinstance(self.planner_ttl_s, bool)
            or not isinstance(self.planner_ttl_s, (int, float))
            or not self.planner_ttl_s > 0
        ):
            raise ValueError(f"AugTreeEngineConfig.planner_ttl_s must be a number > 0, got {self.planner_ttl_s!r}")
        budget = self.replay_memory_budget_gib
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0):
            raise ValueError(
                f"AugTreeEngineConfig.replay_memory_budget_gib must be None or a number > 0, got {budget!r}"
            )
        if self.planner_profile is not None and (not isinstance(self.planner_profile, str) or not self.planner_profile):
            raise ValueError(
                f"AugTreeEngineConfig.planner_profile must be None or a file path, got {self.planner_profile!r}"
            )


def _check_int(name: str, value, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"AugTreeEngineConfig.{name} must be an int >= {minimum}, got {value!r}")
