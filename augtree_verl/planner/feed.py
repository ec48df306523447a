"""The rollout side of the planner service: report each finished group's lengths, fire and forget.

``PlannerFeed(name).report(uid, lengths)`` (a ``groups.GroupLengths``) sends one ``PlannerService.report`` call and
returns at once: it never waits for the actor, and a missing or dead actor costs at most one name lookup per
``LOOKUP_RETRY_S`` (logged once), so a slow or dead planner never slows the rollout.
"""

from __future__ import annotations

import logging
import time

import ray

from augtree_verl.groups import GroupLengths

logger = logging.getLogger(__name__)

LOOKUP_RETRY_S = 10.0  # how often a feed looks for an actor it could not find (a GCS round trip each time)


class PlannerFeed:
    """Sends finished groups to the planner actor ``name``; counts what it sent and what it could not."""

    def __init__(self, name: str, namespace: str | None = None):
        if not isinstance(name, str) or not name:
            raise ValueError(f"planner name must be a non-empty string, got {name!r}")
        self.name, self.namespace = name, namespace
        self._actor = None
        self._next_lookup_s = 0.0
        self.sent = 0
        self.not_sent = 0

    def report(self, uid: str, lengths: GroupLengths) -> bool:
        """Send one group's lengths (responses in (session, index) order); False if no actor could be reached."""
        actor = self._lookup()
        if actor is not None:
            try:
                actor.report.remote(uid, lengths, time.time_ns())
                self.sent += 1
                return True
            except ray.exceptions.RayError as err:  # the handle went bad: look the actor up again later
                logger.warning("planner feed %r: report failed (%s)", self.name, type(err).__name__)
                self._actor = None
        self.not_sent += 1
        return False

    def _lookup(self):
        if self._actor is not None or time.monotonic() < self._next_lookup_s:
            return self._actor
        try:
            self._actor = ray.get_actor(self.name, namespace=self.namespace)
        except ValueError:
            if self._next_lookup_s == 0.0:
                logger.warning("planner feed: no planner actor %r yet; groups are planned by the trainer", self.name)
            self._next_lookup_s = time.monotonic() + LOOKUP_RETRY_S
        return self._actor
