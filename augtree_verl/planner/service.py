"""The planner service: a named async Ray actor that plans each group as its rollout finishes, keyed by uid.

Rollout side (``planner.feed.PlannerFeed``, in each agent-loop worker): when a group's n responses are done,
``report(uid, lengths)`` (a ``groups.GroupLengths``; fire and forget). The actor plans the group at once (about half a
millisecond) and keeps the entry.

Trainer side (``planner.client.PlannerClient``, in the batch balance): ``take(requests, wait_for, wait_s)``
hands over the plans of the requested uids whose reported ``GroupLengths`` equal the trainer's, and
removes those entries (used once). Entries also leave by age (``ttl_s``: DAPO drops groups, async trainers
train a group one or more steps later, a group may never be trained) and by a size bound (``max_entries``,
oldest sent first, whatever order the reports ran in); both count as evicted.

A second report of a uid replaces the first (a retried rollout; counted). Reports whose uid is not a
non-empty string or whose lengths are not a ``GroupLengths`` are dropped and counted, never raised: a rollout
worker must not see planner errors. Plans travel as ``Plan`` objects (Ray pickles them), or
``{"error": message}`` where no plan fits the group; only the batch's plan field holds them as dicts
(``plan_field``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import ray

from augtree_verl.groups import GroupLengths
from augtree_verl.planner.profile import ClusterProfile
from augtree_verl.planner.search import plan_tree

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 3600.0  # an async trainer uses a group within a few steps; a step is minutes at most
DEFAULT_MAX_ENTRIES = 65536  # ~100 steps of 512 groups; an entry is a few hundred bytes


@dataclass
class _Entry:
    lengths: GroupLengths
    result: dict  # {"plan": Plan, "solve_ms": float} or {"error": message}
    arrived_s: float  # time.monotonic() when its plan was made (at report)
    sent_ns: int  # the reporter's time.time_ns() at sending: which of two reports is newer


def plan_group(lengths: GroupLengths, degrees, profile: ClusterProfile, force_primitive: str | None = None) -> dict:
    """``{"plan": Plan, "solve_ms": float}``, or ``{"error": message}`` when no plan fits the group."""
    start = time.perf_counter()
    try:
        plan = plan_tree(
            lengths.prompt_len,
            lengths.response_lens,
            degrees=degrees,
            profile=profile,
            force_primitive=force_primitive,
        )
    except ValueError as err:
        return {"error": str(err)}
    return {"plan": plan, "solve_ms": (time.perf_counter() - start) * 1e3}


class PlannerService:
    """Async actor holding one entry per reported uid: its lengths and plan, until taken or evicted."""

    def __init__(
        self,
        degrees,
        profile: dict,
        ttl_s: float = DEFAULT_TTL_S,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        force_primitive: str | None = None,
    ):
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be an int >= 1, got {max_entries!r}")
        self.degrees = tuple(degrees)
        self.profile = ClusterProfile.from_dict(profile)  # the run's (``planner.startup``)
        self.force_primitive = force_primitive
        plan_tree(1, [1], degrees=self.degrees, profile=self.profile, force_primitive=force_primitive)  # bad input
        self.ttl_s, self.max_entries = float(ttl_s), max_entries
        self.instance = uuid.uuid4().hex  # a restarted actor has a new one (and no entries)
        self.entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest sent report first
        self.arrived = asyncio.Event()  # set and replaced whenever a report arrives
        self.counts = {"reported": 0, "reported_twice": 0, "rejected": 0, "evicted": 0}
        self.last_planned_s: float | None = None  # time.monotonic() when the latest report's plan was done

    async def config(self) -> dict:
        return {
            "degrees": list(self.degrees),
            "profile": self.profile.to_dict(),
            "ttl_s": self.ttl_s,
            "max_entries": self.max_entries,
            "force_primitive": self.force_primitive,
        }

    async def report(self, uid: str, lengths: GroupLengths, sent_ns: int | None = None) -> None:
        """A finished group's lengths, responses in (session, index) order; planned now, kept until taken.
        A uid that is not a non-empty string, or ``lengths`` that are not a ``GroupLengths``, is dropped and
        counted (``rejected``), never raised.

        ``sent_ns`` (the reporter's ``time.time_ns()``; default: arrival) orders two reports of one uid: an
        async actor runs calls in no guaranteed order, even from one caller, so the newer report is the one
        sent later, not the one that ran later."""
        try:
            if not isinstance(uid, str) or not uid:
                raise ValueError(f"uid must be a non-empty string, got {uid!r}")
            if not isinstance(lengths, GroupLengths):  # the record was checked where it was made
                raise ValueError(f"lengths must be a GroupLengths, got {lengths!r}")
        except ValueError as err:
            self.counts["rejected"] += 1
            logger.warning("planner: dropped the report of group %r: %s", uid, err)
            return
        sent_ns = time.time_ns() if sent_ns is None else int(sent_ns)
        self.counts["reported"] += 1
        if uid in self.entries:
            self.counts["reported_twice"] += 1
            if self.entries[uid].sent_ns > sent_ns:  # an older report that ran late: the newer one stays
                return
            del self.entries[uid]
        result = plan_group(lengths, self.degrees, self.profile, self.force_primitive)
        self.entries[uid] = _Entry(lengths, result, time.monotonic(), sent_ns)
        self._keep_sent_order(uid)
        self.last_planned_s = time.monotonic()
        self._evict()
        self.arrived.set()
        self.arrived = asyncio.Event()

    async def take(self, requests: dict, wait_for: list, wait_s: float) -> dict:
        """Hand over the plans of ``requests`` (uid -> ``GroupLengths`` as the trainer sees them).

        Waits at most ``wait_s`` for the uids in ``wait_for`` that have not been reported yet (a report sent
        just before its group was marked finished may still be on its way: Ray orders calls per caller only).
        Returns ``{"results": {uid: result}, ...state}`` where result is the entry's ``{"plan", "solve_ms"}``
        or ``{"error"}``, with ``waited_s`` (how long its plan was ready before this call handed it over), if its
        lengths equal the request, ``{"mismatch": GroupLengths}`` (the reported lengths) if they differ, and
        absent if the uid was never reported (or already evicted).
        Every requested entry is removed.
        """
        deadline = time.monotonic() + wait_s
        while any(uid not in self.entries for uid in wait_for):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except asyncio.TimeoutError:
                break
        self._evict()
        now = time.monotonic()
        results = {}
        for uid, lengths in requests.items():
            entry = self.entries.pop(uid, None)
            if entry is None:
                continue
            if entry.lengths == lengths:
                results[uid] = {**entry.result, "waited_s": now - entry.arrived_s}
            else:
                results[uid] = {"mismatch": entry.lengths}
        return {"results": results, **self._state()}

    async def state(self) -> dict:
        self._evict()
        return self._state()

    def _state(self) -> dict:
        """Cumulative counters of this actor instance, its instance id, how many entries it holds and when
        it finished planning the latest report (``time.monotonic()``, one clock for every process of a host)."""
        return {
            "instance": self.instance,
            "queue_depth": len(self.entries),
            "last_planned_s": self.last_planned_s,
            **self.counts,
        }

    def _keep_sent_order(self, uid: str) -> None:
        """Move the entries sent after ``uid``'s report (that ran before it) behind it: entries stay in the
        order their reports were sent, so the size bound evicts the oldest sent, whatever order calls ran in."""
        sent_ns = self.entries[uid].sent_ns
        newer = []
        for other, entry in reversed(self.entries.items()):
            if other == uid:
                continue
            if entry.sent_ns <= sent_ns:
                break
            newer.append(other)
        for other in reversed(newer):
            self.entries.move_to_end(other)

    def _evict(self) -> None:
        now = time.monotonic()
        while self.entries:
            uid, oldest = next(iter(self.entries.items()))
            if len(self.entries) <= self.max_entries and now - oldest.arrived_s <= self.ttl_s:
                break
            del self.entries[uid]
            self.counts["evicted"] += 1


def start_planner_service(
    name: str = "augtree_planner",
    *,
    degrees,
    profile: ClusterProfile,
    namespace: str | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    force_primitive: str | None = None,
):
    """The named planner actor (created unless it exists), planning with ``profile`` (the run's, from
    ``planner.startup``). Needs ``ray.init`` first. ``force_primitive`` pins its plans to one primitive
    (``plan_tree``'s argument).

    Not detached: keep the returned handle for the whole run (Ray ends a non-detached actor once no handle
    refers to it). It reserves no CPU, so it never blocks training placement. Ray restarts it if its
    process dies; the new instance starts empty, and the groups it lost are planned in-process (counted).
    """
    return (
        ray.remote(PlannerService)
        .options(
            name=name,
            namespace=namespace,
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=1000,
            max_restarts=-1,
            max_task_retries=0,
        )
        .remote(tuple(degrees), profile.to_dict(), ttl_s, max_entries, force_primitive)
    )
