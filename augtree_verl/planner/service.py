"""The planner service: a named async Ray actor that plans replay trees as rollouts finish, by training step.

Producer side (the trainer, as soon as a step's lengths are known)::

    client = PlannerClient(degrees=(1, 2, 4, 8))
    client.submit(step, {"uid-17": (prompt_len, [r1, r2, ...]), ...})   # returns at once

Consumer side (same client, when the update stage needs the plans)::

    plans = client.fetch(step, ["uid-17", ...])                       # dict group_id -> Plan

``fetch`` waits at most ``timeout_s``. Whatever the actor cannot deliver in time (missing, dead, late) the
client plans in-process from the lengths it submitted, logs a warning and counts it: training never stops
because the planner did. The planner is deterministic, so both paths give the same plan for the same
lengths, degrees and profile; the client checks on first contact that the actor uses the same ones.

Steps never mix: plans are stored per step, and a fetch for step s only returns plans of step s. The actor
keeps the newest ``RETAINED_STEPS`` steps (several workers may fetch the same groups) and drops older ones.
Plans travel as dicts (``Plan.to_dict``), with the actor's solve time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

import ray

from augtree_verl.plan import PRIMITIVES, Plan
from augtree_verl.planner.profile import ClusterProfile
from augtree_verl.planner.search import check_tree_lengths, plan_tree

logger = logging.getLogger(__name__)

RETAINED_STEPS = 4            # steps whose plans (actor) and lengths (client) are kept
ACTOR_WAIT_FRACTION = 0.8     # the actor answers at 80% of the client's timeout, leaving time for the reply


def _plan_groups(groups: dict, degrees: tuple, profile: ClusterProfile) -> dict[str, dict]:
    """group_id -> {"plan": Plan dict, "solve_ms": float} or {"error": message} (bad input, no plan fits)."""
    out = {}
    for gid, (prompt_len, response_lens) in groups.items():
        start = time.perf_counter()
        try:
            plan = plan_tree(prompt_len, response_lens, degrees=degrees, profile=profile)
        except ValueError as err:
            out[gid] = {"error": f"group {gid!r}: {err}"}
            continue
        out[gid] = {"plan": plan.to_dict(), "solve_ms": (time.perf_counter() - start) * 1e3}
    return out


class PlannerService:
    """Async actor: ``submit`` plans a step's groups off the event loop; ``fetch`` waits for them."""

    def __init__(self, degrees=(1, 2, 4, 8), profile: dict | None = None):
        self.degrees = tuple(degrees)
        self.profile = ClusterProfile.from_dict(profile) if profile else ClusterProfile.default()
        self.plans: dict[int, dict[str, dict]] = defaultdict(dict)
        self.arrived = asyncio.Event()          # set and replaced whenever plans arrive
        self.groups_planned = 0
        self.solve_ms_total = 0.0

    async def config(self) -> dict:
        return {"degrees": list(self.degrees), "profile": self.profile.to_dict()}

    async def submit(self, step: int, groups: dict) -> None:
        results = await asyncio.get_running_loop().run_in_executor(
            None, _plan_groups, groups, self.degrees, self.profile)
        self.plans[step].update(results)
        for stale in [s for s in self.plans if s <= step - RETAINED_STEPS]:
            del self.plans[stale]
        self.groups_planned += len(results)
        self.solve_ms_total += sum(r.get("solve_ms", 0.0) for r in results.values())
        self.arrived.set()
        self.arrived = asyncio.Event()

    async def fetch(self, step: int, group_ids: list, timeout_s: float) -> dict[str, dict]:
        """The step's results for ``group_ids`` that are ready within ``timeout_s`` (missing ones left out)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = self.plans.get(step, {})
            if all(g in ready for g in group_ids):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except asyncio.TimeoutError:
                break
        ready = self.plans.get(step, {})
        return {g: ready[g] for g in group_ids if g in ready}

    async def metrics(self) -> dict[str, float]:
        return {"planner/service_groups": float(self.groups_planned),
                "planner/service_solve_ms_mean": self.solve_ms_total / max(self.groups_planned, 1)}


def start_planner_service(name: str = "augtree_planner", *, degrees=(1, 2, 4, 8),
                          profile: ClusterProfile | None = None, namespace: str | None = None):
    """The named planner actor (created unless it exists). Needs ``ray.init`` first. Not detached: keep the
    returned handle for the whole run: Ray ends a non-detached actor once no handle refers to it. It reserves no CPU, so it never blocks training placement."""
    profile = profile if profile is not None else ClusterProfile.default()
    return ray.remote(PlannerService).options(
        name=name, namespace=namespace, get_if_exists=True, num_cpus=0, max_concurrency=1000,
    ).remote(tuple(degrees), profile.to_dict())


class PlannerClient:
    """Client of the planner actor ``name``; plans in-process whenever the actor cannot answer in time."""

    def __init__(self, name: str = "augtree_planner", *, degrees=(1, 2, 4, 8),
                 profile: ClusterProfile | None = None, timeout_s: float = 2.0, namespace: str | None = None):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.name, self.namespace, self.timeout_s = name, namespace, float(timeout_s)
        self.degrees = tuple(degrees)
        self.profile = profile if profile is not None else ClusterProfile.default()
        plan_tree(1, [1], degrees=self.degrees, profile=self.profile)     # fail now on bad degrees/profile
        self._actor = None
        self._checked = False
        self._lengths: dict[int, dict[str, tuple[int, list[int]]]] = defaultdict(dict)
        self._counts = defaultdict(float)

    # ---- producer --------------------------------------------------------------------------------
    def submit(self, step: int, groups: dict) -> None:
        """Send a step's groups (group_id -> (prompt_len, response_lens)) to the planner; returns at once."""
        step = self._check_step(step)
        if not isinstance(groups, dict):
            raise ValueError(f"groups must be a dict group_id -> (prompt_len, response_lens), "
                             f"got {type(groups).__name__}")
        clean = {}
        for gid, value in groups.items():
            if not isinstance(value, (tuple, list)) or len(value) != 2:
                raise ValueError(f"group {gid!r} of step {step}: expected (prompt_len, response_lens), "
                                 f"got {value!r}")
            try:
                P, R = check_tree_lengths(*value)
            except ValueError as err:
                raise ValueError(f"group {gid!r} of step {step}: {err}") from None
            clean[gid] = (P, [int(r) for r in R])
        self._lengths[step].update(clean)
        for stale in [s for s in self._lengths if s <= step - RETAINED_STEPS]:
            del self._lengths[stale]
        actor = self._connect()
        if actor is not None:
            actor.submit.remote(step, clean)     # fire and forget: a lost submit shows up as a late fetch

    # ---- consumer --------------------------------------------------------------------------------
    def fetch(self, step: int, group_ids: list) -> dict[str, Plan]:
        """Plans of ``group_ids`` for ``step``; waits at most ``timeout_s``, then plans the rest in-process."""
        step = self._check_step(step)
        group_ids = list(group_ids)
        unknown = [g for g in group_ids if g not in self._lengths.get(step, {})]
        if unknown:
            raise ValueError(f"group {unknown[0]!r} of step {step} was never submitted to this client")
        start = time.perf_counter()
        received = self._fetch_remote(step, group_ids)
        plans = {}
        late = []
        for gid in group_ids:
            result = received.get(gid)
            if result is None:
                late.append(gid)
                continue
            if "error" in result:
                raise ValueError(result["error"])
            plans[gid] = Plan.from_dict(result["plan"])
            self._count_plan(plans[gid], result["solve_ms"])
        if late:
            logger.warning("planner %r: %d of %d groups of step %d not delivered within %.2fs; planning them "
                           "in-process", self.name, len(late), len(group_ids), step, self.timeout_s)
            for gid in late:
                solve_start = time.perf_counter()
                prompt_len, response_lens = self._lengths[step][gid]
                try:
                    plans[gid] = plan_tree(prompt_len, response_lens, degrees=self.degrees, profile=self.profile)
                except ValueError as err:
                    raise ValueError(f"group {gid!r}: {err}") from None
                self._count_plan(plans[gid], (time.perf_counter() - solve_start) * 1e3)
                self._counts["planner/fallbacks"] += 1
        self._counts["planner/fetch_ms_total"] += (time.perf_counter() - start) * 1e3
        self._counts["planner/fetches"] += 1
        return {gid: plans[gid] for gid in group_ids}

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """Counters since the start (or the last ``reset=True`` read): fallbacks, plans per primitive, mean
        solve and fetch times in milliseconds."""
        c = self._counts
        planned = c["planner/plans"]
        out = {"planner/fallbacks": c["planner/fallbacks"], "planner/plans": planned,
               "planner/solve_ms_mean": c["planner/solve_ms_total"] / planned if planned else 0.0,
               "planner/fetch_ms_mean": (c["planner/fetch_ms_total"] / c["planner/fetches"]
                                         if c["planner/fetches"] else 0.0),
               "planner/degree_mean": c["planner/degree_total"] / planned if planned else 0.0}
        out.update({f"planner/plans_{p}": c[f"planner/plans_{p}"] for p in PRIMITIVES})
        if reset:
            self._counts.clear()
        return out

    # ---- internals -------------------------------------------------------------------------------
    @staticmethod
    def _check_step(step) -> int:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        return step

    def _count_plan(self, plan: Plan, solve_ms: float) -> None:
        self._counts["planner/plans"] += 1
        self._counts[f"planner/plans_{plan.primitive}"] += 1
        self._counts["planner/solve_ms_total"] += solve_ms
        self._counts["planner/degree_total"] += plan.degree

    def _connect(self):
        """The actor handle, looked up (and its configuration checked) on first use and after a failure."""
        if self._actor is not None:
            return self._actor
        if not ray.is_initialized():
            return None
        try:
            actor = ray.get_actor(self.name, namespace=self.namespace)
        except ValueError:
            return None                          # not started (yet): fetch will plan in-process
        if not self._checked:
            try:
                config = ray.get(actor.config.remote(), timeout=self.timeout_s)
            except (ray.exceptions.RayError, TimeoutError):
                return None
            if tuple(config["degrees"]) != self.degrees or config["profile"] != self.profile.to_dict():
                raise ValueError(f"planner actor {self.name!r} runs degrees={tuple(config['degrees'])} and a "
                                 f"different profile than this client (degrees={self.degrees}); plans would "
                                 f"differ between the actor and the in-process fallback")
            self._checked = True
        self._actor = actor
        return actor

    def _fetch_remote(self, step: int, group_ids: list) -> dict[str, dict]:
        actor = self._connect()
        if actor is None:
            return {}
        ref = actor.fetch.remote(step, group_ids, ACTOR_WAIT_FRACTION * self.timeout_s)
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            return {}                            # the actor gives up on its own at ACTOR_WAIT_FRACTION
        except ray.exceptions.RayError as err:   # actor died or was killed: look it up again next time
            logger.warning("planner %r unreachable (%s)", self.name, type(err).__name__)
            self._actor = None
            return {}
