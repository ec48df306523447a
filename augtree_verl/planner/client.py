"""The trainer side of the planner service: the plans of a batch's groups, from the actor or in-process.

    client = PlannerClient("augtree_planner", degrees=(1, 2, 4, 8), profile=run_profile, timeout_s=2.0)
    plans = client.plans({"uid-17|3000": ("uid-17", GroupLengths(3000, (40, 900, 15, 300))), ...},
                         from_rollout={"uid-17|3000", ...})          # tree_id -> Plan

A tree in ``from_rollout`` whose group the rollout reported with exactly these lengths (responses in the
rollout's (session, index) order) gets the actor's plan, computed while the rollout ran. Every other tree
(not reported, reported with other lengths, lost to a planner restart, the actor missing, dead or late,
and the trees the caller does not ask about, e.g. padding) is planned here, logged and counted. The planner is
deterministic, so both paths give the same plan for the same lengths, degrees, profile and ``force_primitive``;
the client checks on first contact that the actor uses the same ones. The actor's plans arrive as ``Plan``
objects. ``PlannerClient(None, ...)`` has no
actor: it plans every tree in-process (the engine config's ``use_planner=false``). A group no plan fits
(``plan_tree`` raises: too large for every allowed degree) gets the one-device plan ``Plan()`` and is counted
as unplannable, never raised.

``metrics(reset=True)`` (once per step) gives the counters since the last read, under ``planner/``:
``plans_from_rollout``, ``plans_in_process``, ``plan_wait_s`` (time spent in ``plans``), ``queue_depth``
(groups the actor holds, reported but not trained yet), ``evicted`` (entries dropped by TTL or size bound),
and the causes: ``missing``, ``mismatched``, ``unplannable``, ``unreachable``, ``restarts``,
``reported_twice``, ``rejected``; plus plans per primitive, mean degree and mean solve time; and, when plans came
from the actor, ``plan_lead_s_min`` / ``plan_lead_s_mean``: how long those plans had been ready when the trainer
took them (the actor's clock; the least is the plan made last, the one the trainer came closest to waiting for).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Collection, Mapping

import ray

from augtree_verl.groups import GroupLengths
from augtree_verl.plan import PRIMITIVES, Plan
from augtree_verl.planner.profile import ClusterProfile
from augtree_verl.planner.search import plan_tree
from augtree_verl.planner.service import plan_group

logger = logging.getLogger(__name__)

# How long the actor waits for a report not there yet: a worker reports a group just before marking it
# finished, and Ray orders calls per caller only, so a report may trail the trainer's request by a moment.
REPORT_IN_FLIGHT_WAIT_S = 0.05
ACTOR_COUNTERS = ("evicted", "reported_twice", "rejected")  # cumulative on the actor; reported as deltas
# How long the trainer waits for the actor (``AugTreeEngineConfig.planner_timeout_s`` defaults to this).
DEFAULT_TIMEOUT_S = 2.0


class PlannerClient:
    """Client of the planner actor ``name`` (None: no actor); plans in-process whatever the actor cannot hand
    over, with ``profile`` (the run's, ``planner.startup``). ``force_primitive`` pins every plan to one
    primitive, as ``plan_tree``'s argument."""

    def __init__(
        self,
        name: str | None,
        *,
        degrees,
        profile: ClusterProfile,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        namespace: str | None = None,
        force_primitive: str | None = None,
    ):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
        self.name, self.namespace, self.timeout_s = name, namespace, float(timeout_s)
        self.degrees = tuple(degrees)
        self.profile = profile
        self.force_primitive = force_primitive
        # fail now on bad degrees, profile or primitive
        plan_tree(1, [1], degrees=self.degrees, profile=self.profile, force_primitive=force_primitive)
        self._actor = None
        self._checked = False
        self._instance = None  # the actor instance last heard from
        self._seen = dict.fromkeys(ACTOR_COUNTERS, 0)
        self._counts: defaultdict[str, float] = defaultdict(float)
        self._leads: list[float] = []  # waited_s of the actor's plans since the last reset
        self._queue_depth = 0.0

    def plans(
        self, groups: Mapping[str, tuple[str, GroupLengths]], from_rollout: Collection[str] = ()
    ) -> dict[str, Plan]:
        """``tree_id -> Plan`` for ``groups`` (tree_id -> (uid, ``GroupLengths``); ``Tree.lengths`` names a tree
        whose lengths are bad), in their order.

        ``from_rollout``: the tree ids to ask the actor for (at most one tree per uid; ignored without an
        actor); ValueError names a tree whose value is not such a pair.
        """
        start = time.perf_counter()
        for tree_id, value in groups.items():
            if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GroupLengths)):
                raise ValueError(f"tree {tree_id!r}: expected (uid, GroupLengths), got {value!r}")
        wanted = set(from_rollout) if self.name is not None else set()
        asked = [t for t in groups if t in wanted]
        uids = [groups[t][0] for t in asked]
        if len(set(uids)) != len(uids):
            raise ValueError(f"from_rollout holds several trees of one group: {sorted(asked)}")
        received = self._take(dict(groups[t] for t in asked))
        reached = received is not None
        received = received or {}

        plans = {}
        for tree_id, (uid, lengths) in groups.items():
            result = received.get(uid) if tree_id in wanted else None
            if result is not None and "plan" in result:
                plans[tree_id] = result["plan"]
                self._count_plan(plans[tree_id], result["solve_ms"])
                self._counts["planner/plans_from_rollout"] += 1
                self._leads.append(result["waited_s"])
                continue
            if tree_id in wanted and reached:
                if result is None:
                    self._counts["planner/missing"] += 1
                elif "mismatch" in result:
                    self._counts["planner/mismatched"] += 1
                    logger.warning(
                        "planner: group %r was reported with lengths %s but the batch has %s; planning it in-process",
                        uid,
                        result["mismatch"],
                        lengths,
                    )
            plans[tree_id] = self._plan_here(tree_id, uid, lengths)
        self._counts["planner/plan_wait_s"] += time.perf_counter() - start
        return plans

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """Counters since the start (or the last ``reset=True`` read); see the module docstring."""
        c = self._counts
        planned = c["planner/plans"]
        out = {
            k: c[f"planner/{k}"]
            for k in (
                "plans_from_rollout",
                "plans_in_process",
                "plan_wait_s",
                "evicted",
                "missing",
                "mismatched",
                "unplannable",
                "unreachable",
                "restarts",
                "reported_twice",
                "rejected",
                "plans",
            )
        }
        out = {f"planner/{k}": v for k, v in out.items()}
        out["planner/queue_depth"] = self._queue_depth
        out["planner/solve_ms_mean"] = c["planner/solve_ms_total"] / planned if planned else 0.0
        out["planner/degree_mean"] = c["planner/degree_total"] / planned if planned else 0.0
        out.update({f"planner/plans_{p}": c[f"planner/plans_{p}"] for p in PRIMITIVES})
        if self._leads:
            out["planner/plan_lead_s_min"] = min(self._leads)
            out["planner/plan_lead_s_mean"] = sum(self._leads) / len(self._leads)
        if reset:
            self._counts.clear()
            self._leads.clear()
        return out

    # ---- internals -------------------------------------------------------------------------------
    def _plan_here(self, tree_id: str, uid: str, lengths: GroupLengths) -> Plan:
        """The actor's own planning (``plan_group``), run here; the one-device plan where no plan fits."""
        start = time.perf_counter()
        result = plan_group(lengths, self.degrees, self.profile, self.force_primitive)
        plan = result.get("plan")
        if plan is None:
            logger.warning("planner: tree %r (group %r) gets the one-device plan: %s", tree_id, uid, result["error"])
            self._counts["planner/unplannable"] += 1
            plan = Plan()
        self._counts["planner/plans_in_process"] += 1
        self._count_plan(plan, (time.perf_counter() - start) * 1e3)
        return plan

    def _count_plan(self, plan: Plan, solve_ms: float) -> None:
        self._counts["planner/plans"] += 1
        self._counts[f"planner/plans_{plan.primitive}"] += 1
        self._counts["planner/solve_ms_total"] += solve_ms
        self._counts["planner/degree_total"] += plan.degree

    def _take(self, requests: dict) -> dict | None:
        """The actor's results for ``requests`` (uid -> ``GroupLengths``); None when no actor answers in time."""
        if not requests:
            return {}
        actor = self._connect()
        reply = None
        if actor is not None:
            ref = actor.take.remote(requests, list(requests), min(REPORT_IN_FLIGHT_WAIT_S, self.timeout_s / 2))
            try:
                reply = ray.get(ref, timeout=self.timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as err:  # late, dead or restarting
                logger.warning("planner %r: %s", self.name, type(err).__name__)
                self._actor = None  # look it up anew next time
        if reply is None:
            logger.warning("planner %r did not answer; planning %d groups in-process", self.name, len(requests))
            self._counts["planner/unreachable"] += 1
            return None
        self._read_state(reply)
        return reply["results"]

    def _read_state(self, state: dict) -> None:
        if state["instance"] != self._instance:
            if self._instance is not None:
                self._counts["planner/restarts"] += 1  # a new actor: its counters start from 0
            self._instance = state["instance"]
            self._seen = dict.fromkeys(ACTOR_COUNTERS, 0)
        for key in ACTOR_COUNTERS:
            self._counts[f"planner/{key}"] += state[key] - self._seen[key]
            self._seen[key] = state[key]
        self._queue_depth = float(state["queue_depth"])

    def _connect(self):
        """The actor handle, looked up (and its configuration checked) on first use and after a failure."""
        if self._actor is not None:
            return self._actor
        if self.name is None or not ray.is_initialized():
            return None
        try:
            actor = ray.get_actor(self.name, namespace=self.namespace)
        except ValueError:
            return None  # not started: everything is planned in-process
        if not self._checked:
            try:
                config = ray.get(actor.config.remote(), timeout=self.timeout_s)
            except (ray.exceptions.RayError, TimeoutError):
                return None
            if (
                tuple(config["degrees"]) != self.degrees
                or config["profile"] != self.profile.to_dict()
                or config["force_primitive"] != self.force_primitive
            ):
                raise ValueError(
                    f"planner actor {self.name!r} runs degrees={tuple(config['degrees'])}, "
                    f"force_primitive={config['force_primitive']!r} and "
                    f"{'the same' if config['profile'] == self.profile.to_dict() else 'a different'} "
                    f"profile, this client degrees={self.degrees}, force_primitive="
                    f"{self.force_primitive!r}; plans would differ between the actor and the "
                    f"in-process fallback"
                )
            self._checked = True
        self._actor = actor
        return actor
