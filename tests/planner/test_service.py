"""The planner service keyed by uid, with real Ray actors: fed by ``PlannerFeed``, taken by ``PlannerClient``."""

import asyncio
import dataclasses
import logging
import time
import uuid

import pytest
import ray

from augtree_verl.groups import GroupLengths, Tree
from augtree_verl.plan import Plan
from augtree_verl.planner import ClusterProfile, plan_tree
from augtree_verl.planner.client import PlannerClient
from augtree_verl.planner.feed import PlannerFeed
from augtree_verl.planner.service import PlannerService, start_planner_service

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

DEGREES = (1, 2, 4, 8)
PROFILE = ClusterProfile.default()  # what plan_tree plans with unless told otherwise
PROMPT_HEAVY = (131072, [256] * 8)  # MoveQ
RESPONSE_HEAVY = (512, [16384] * 8)  # TreeMoveKV
TOO_LARGE = (4 * 10**6, [256] * 8)  # no plan fits a rank's memory at degrees (1, 2, 4, 8)
ACTOR_START_TIMEOUT_S = 120  # the actor imports torch on a shared 2-core machine


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def started_service(**kwargs):
    name = f"planner-{uuid.uuid4().hex[:8]}"
    actor = start_planner_service(name, degrees=DEGREES, **{"profile": PROFILE, **kwargs})
    ray.get(actor.config.remote(), timeout=ACTOR_START_TIMEOUT_S)
    return name, actor


def feed_and_client(**service_kwargs):
    name, actor = started_service(**service_kwargs)
    return actor, PlannerFeed(name), PlannerClient(name, degrees=DEGREES, profile=PROFILE, timeout_s=30.0)


def settle(actor, reports):
    """The actor's state once it has handled ``reports`` reports (an async actor runs calls in any order)."""
    deadline = time.monotonic() + 30
    while True:
        state = ray.get(actor.state.remote(), timeout=30)
        if state["reported"] + state["rejected"] >= reports or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def request(groups):
    """Client request: tree_id -> (uid, GroupLengths), one tree per uid."""
    return {f"{uid}|{p}": (uid, GroupLengths(p, rs)) for uid, (p, rs) in groups.items()}


def expected(group):
    return plan_tree(*group, degrees=DEGREES)


@pytest.mark.timeout(300)
def test_reported_groups_are_planned_before_the_trainer_asks_and_used_once():
    actor, feed, client = feed_and_client()
    groups = {"a": PROMPT_HEAVY, "b": RESPONSE_HEAVY, "c": (300, [40, 50, 7])}
    for uid, (p, rs) in groups.items():
        assert feed.report(uid, GroupLengths(p, rs))
    assert settle(actor, 3)["queue_depth"] == 3
    time.sleep(0.2)  # the trainer asks a while after the last plan was made
    plans = client.plans(request(groups), from_rollout=request(groups))
    assert list(plans) == ["a|131072", "b|512", "c|300"]
    for uid, group in groups.items():
        assert plans[f"{uid}|{group[0]}"] == expected(group)
    m = client.metrics(reset=True)
    assert m["planner/plans_from_rollout"] == 3 and m["planner/plans_in_process"] == 0
    assert m["planner/queue_depth"] == 0 and m["planner/evicted"] == 0
    assert m["planner/plans_move_q"] >= 1 and m["planner/plans_tree_move_kv"] >= 1
    assert 0 < m["planner/plan_wait_s"] < client.timeout_s
    # how long the plans were ready before the trainer took them: at least the pause, the last-made one least
    assert 0.2 <= m["planner/plan_lead_s_min"] <= m["planner/plan_lead_s_mean"] < 60
    # Used once: asking again finds nothing and plans in-process.
    again = client.plans(request({"a": PROMPT_HEAVY}), from_rollout=request({"a": PROMPT_HEAVY}))
    assert again["a|131072"] == expected(PROMPT_HEAVY)
    m = client.metrics(reset=True)
    assert m["planner/plans_in_process"] == 1 and m["planner/missing"] == 1
    assert "planner/plan_lead_s_min" not in m, "no plan came from the actor this time"


@pytest.mark.timeout(300)
def test_unreported_and_not_asked_groups_are_planned_in_process_and_counted():
    actor, feed, client = feed_and_client()
    feed.report("a", GroupLengths(*PROMPT_HEAVY))
    settle(actor, 1)
    groups = request({"a": PROMPT_HEAVY, "never": RESPONSE_HEAVY, "pad": (40, [3, 3])})
    plans = client.plans(groups, from_rollout=["a|131072", "never|512"])  # "pad": not asked
    assert plans == {
        "a|131072": expected(PROMPT_HEAVY),
        "never|512": expected(RESPONSE_HEAVY),
        "pad|40": expected((40, [3, 3])),
    }
    m = client.metrics()
    assert (m["planner/plans_from_rollout"], m["planner/plans_in_process"], m["planner/missing"]) == (1, 2, 1)


@pytest.mark.timeout(300)
def test_lengths_that_differ_from_the_batch_never_apply_the_rollouts_plan(caplog):
    actor, feed, client = feed_and_client()
    feed.report("failed", GroupLengths(512, [16384] * 8))  # the trainer sees 7: one sample failed
    feed.report("order", GroupLengths(700, [10, 5000]))  # the trainer sees another order
    feed.report("twice", GroupLengths(*PROMPT_HEAVY))  # a group reported twice: the newer report wins
    feed.report("twice", GroupLengths(*RESPONSE_HEAVY))
    feed.report("same", GroupLengths(300, [40, 50]))  # reported twice with the same lengths
    feed.report("same", GroupLengths(300, [40, 50]))
    assert settle(actor, 6)["reported_twice"] == 2
    batch = {"failed": (512, [16384] * 7), "order": (700, [5000, 10]), "twice": PROMPT_HEAVY, "same": (300, [40, 50])}
    with caplog.at_level(logging.WARNING, logger="augtree_verl.planner.client"):
        plans = client.plans(request(batch), from_rollout=request(batch))
    for uid, group in batch.items():
        assert plans[f"{uid}|{group[0]}"] == expected(group)
    m = client.metrics()
    assert m["planner/mismatched"] == 3 and m["planner/plans_in_process"] == 3
    assert m["planner/plans_from_rollout"] == 1 and m["planner/reported_twice"] == 2
    assert "group 'failed' was reported with lengths" in caplog.text
    assert settle(actor, 6)["queue_depth"] == 0  # mismatched entries are dropped too


def test_the_size_bound_evicts_the_oldest_sent_report_whatever_order_the_reports_ran_in():
    service = PlannerService(degrees=DEGREES, profile=PROFILE.to_dict(), max_entries=2)
    for uid, sent_ns in (("new", 3), ("old", 1), ("mid", 2)):  # ran in another order than sent
        asyncio.run(service.report(uid, GroupLengths(300, [40, 50]), sent_ns=sent_ns))
    assert list(service.entries) == ["mid", "new"] and service.counts["evicted"] == 1


@pytest.mark.timeout(300)
def test_groups_never_trained_leave_by_ttl_and_by_size_bound():
    actor, feed, client = feed_and_client(max_entries=2)
    for uid in ("old", "mid", "new"):
        feed.report(uid, GroupLengths(300, [40, 50]))
    state = settle(actor, 3)
    assert (state["queue_depth"], state["evicted"]) == (2, 1)  # "old" left for the size bound
    plans = client.plans(request({"old": (300, [40, 50]), "new": (300, [40, 50])}), from_rollout=["old|300", "new|300"])
    assert set(plans.values()) == {expected((300, [40, 50]))}
    m = client.metrics(reset=True)
    assert (m["planner/evicted"], m["planner/missing"], m["planner/plans_from_rollout"]) == (1, 1, 1)
    assert m["planner/queue_depth"] == 1  # "mid": reported, not trained yet

    ttl_actor, ttl_feed, ttl_client = feed_and_client(ttl_s=0.5)
    ttl_feed.report("stale", GroupLengths(300, [40, 50]))
    assert settle(ttl_actor, 1)["queue_depth"] == 1
    time.sleep(1.0)
    ttl_client.plans(request({"stale": (300, [40, 50])}), from_rollout=["stale|300"])
    m = ttl_client.metrics()
    assert (m["planner/evicted"], m["planner/missing"], m["planner/queue_depth"]) == (1, 1, 0)


@pytest.mark.timeout(300)
def test_a_planner_restarted_mid_run_loses_its_groups_to_counted_in_process_plans():
    actor, feed, client = feed_and_client()
    feed.report("before", GroupLengths(*PROMPT_HEAVY))
    first = settle(actor, 1)["instance"]
    assert client.plans(request({"before": PROMPT_HEAVY}), ["before|131072"])["before|131072"] == expected(PROMPT_HEAVY)
    feed.report("lost", GroupLengths(*RESPONSE_HEAVY))
    settle(actor, 2)
    ray.kill(actor, no_restart=False)  # Ray restarts it: same name and handle, no entries
    deadline = time.monotonic() + ACTOR_START_TIMEOUT_S
    while True:
        try:
            if ray.get(actor.state.remote(), timeout=30)["instance"] != first:
                break
        except ray.exceptions.RayError:
            pass
        assert time.monotonic() < deadline, "the planner actor did not come back"
        time.sleep(0.5)
    feed.report("after", GroupLengths(300, [40, 50]))
    settle(actor, 1)
    plans = client.plans(
        request({"lost": RESPONSE_HEAVY, "after": (300, [40, 50])}), from_rollout=["lost|512", "after|300"]
    )
    assert plans == {"lost|512": expected(RESPONSE_HEAVY), "after|300": expected((300, [40, 50]))}
    m = client.metrics()
    assert m["planner/restarts"] == 1 and m["planner/missing"] == 1
    assert (m["planner/plans_from_rollout"], m["planner/plans_in_process"]) == (2, 1)


@pytest.mark.timeout(300)
def test_a_dead_planner_slows_neither_the_feed_nor_the_trainer(caplog):
    actor, feed, client = feed_and_client()
    feed.report("a", GroupLengths(*PROMPT_HEAVY))
    settle(actor, 1)
    ray.kill(actor, no_restart=True)
    start = time.perf_counter()
    feed.report("b", GroupLengths(*RESPONSE_HEAVY))  # fire and forget into a dead actor: no error, no wait
    with caplog.at_level(logging.WARNING, logger="augtree_verl.planner.client"):
        plans = client.plans(request({"a": PROMPT_HEAVY, "b": RESPONSE_HEAVY}), ["a|131072", "b|512"])
    assert plans == {"a|131072": expected(PROMPT_HEAVY), "b|512": expected(RESPONSE_HEAVY)}
    m = client.metrics()
    assert m["planner/unreachable"] == 1 and m["planner/plans_in_process"] == 2
    assert "did not answer" in caplog.text
    assert time.perf_counter() - start < client.timeout_s  # a dead actor answers with an error at once

    absent = PlannerFeed(f"absent-{uuid.uuid4().hex[:8]}")
    assert not absent.report("x", GroupLengths(10, [5])) and not absent.report("y", GroupLengths(10, [5]))
    assert absent.not_sent == 2


@pytest.mark.timeout(300)
def test_a_group_larger_than_any_plan_allows_gets_the_one_device_plan(caplog):
    actor, feed, client = feed_and_client()
    feed.report("huge", GroupLengths(*TOO_LARGE))
    settle(actor, 1)
    with pytest.raises(ValueError, match="no plan fits in memory"):
        expected(TOO_LARGE)
    with caplog.at_level(logging.WARNING, logger="augtree_verl.planner.client"):
        plans = client.plans(request({"huge": TOO_LARGE, "ok": (300, [40])}), ["huge|4000000", "ok|300"])
    assert plans == {"huge|4000000": Plan(), "ok|300": expected((300, [40]))}
    m = client.metrics()
    assert m["planner/unplannable"] == 1 and m["planner/plans_in_process"] == 2
    assert "tree 'huge|4000000' (group 'huge') gets the one-device plan" in caplog.text


@pytest.mark.timeout(300)
def test_bad_reports_are_dropped_and_counted_bad_requests_name_the_tree():
    actor, feed, client = feed_and_client()
    ray.get(
        [
            actor.report.remote("z", (0, [5])),  # not a GroupLengths: nothing checked it
            actor.report.remote("y", None),
            actor.report.remote("", GroupLengths(10, [5])),
            actor.report.remote("x", [10, [5, -1]]),
        ],
        timeout=30,
    )
    state = settle(actor, 4)
    assert (state["rejected"], state["queue_depth"]) == (4, 0)
    client.plans({"w|10": ("w", GroupLengths(10, [5]))}, ["w|10"])
    assert client.metrics()["planner/rejected"] == 4
    with pytest.raises(ValueError, match=r"tree 'b\|10' \(group 'b'\): response_lens\[1\] must be a positive int"):
        trees = [Tree(uid="a", prompt_len=10, response_lens=(5,)), Tree(uid="b", prompt_len=10, response_lens=(5, 0))]
        client.plans({t.tree_id: (t.uid, t.lengths) for t in trees})
    with pytest.raises(ValueError, match=r"tree 'a\|10': expected \(uid, GroupLengths\)"):
        client.plans({"a|10": ("a", 10, [5])})
    with pytest.raises(ValueError, match="several trees of one group"):
        client.plans({"a|10": ("a", GroupLengths(10, [5])), "a|11": ("a", GroupLengths(11, [5]))}, ["a|10", "a|11"])


@pytest.mark.timeout(300)
def test_client_refuses_an_actor_with_another_configuration():
    name, _ = started_service()
    client = PlannerClient(name, degrees=(1, 2), profile=PROFILE, timeout_s=30.0)
    with pytest.raises(ValueError, match="plans would differ"):
        client.plans({"a|10": ("a", GroupLengths(10, [5]))}, ["a|10"])


@pytest.mark.timeout(300)
def test_client_refuses_an_actor_planning_with_another_profile():
    name, _ = started_service(profile=dataclasses.replace(PROFILE, num_layers=2))
    with pytest.raises(ValueError, match="a different profile.*plans would differ"):
        PlannerClient(name, degrees=DEGREES, profile=PROFILE, timeout_s=30.0).plans(
            {"a|10": ("a", GroupLengths(10, [5]))}, ["a|10"]
        )


@pytest.mark.timeout(300)
def test_client_refuses_an_actor_that_forces_another_primitive():
    name, _ = started_service(force_primitive="move_q")
    with pytest.raises(ValueError, match="force_primitive='move_q'.*plans would differ"):
        PlannerClient(name, degrees=DEGREES, profile=PROFILE, timeout_s=30.0).plans(
            {"a|10": ("a", GroupLengths(10, [5]))}, ["a|10"]
        )
    # the same forced primitive on both sides: the actor's plan is taken
    feed, client = (
        PlannerFeed(name),
        PlannerClient(name, degrees=DEGREES, profile=PROFILE, timeout_s=30.0, force_primitive="move_q"),
    )
    feed.report("b", GroupLengths(*PROMPT_HEAVY))
    settle(ray.get_actor(name), 1)
    plans = client.plans({"b|x": ("b", GroupLengths(*PROMPT_HEAVY))}, ["b|x"])
    assert plans["b|x"] == plan_tree(*PROMPT_HEAVY, degrees=DEGREES, force_primitive="move_q")
    assert client.metrics()["planner/plans_from_rollout"] == 1.0


@pytest.mark.timeout(300)
def test_the_later_sent_of_two_reports_wins_whatever_order_they_run_in():
    """An async actor runs calls in no guaranteed order, even from one caller: the report sent later wins."""
    actor, _, client = feed_and_client()
    ray.get(actor.report.remote("late", GroupLengths(*RESPONSE_HEAVY), 2), timeout=30)  # sent later, ran first
    ray.get(actor.report.remote("late", GroupLengths(*PROMPT_HEAVY), 1), timeout=30)  # sent earlier, ran last
    plans = client.plans(request({"late": RESPONSE_HEAVY}), from_rollout=request({"late": RESPONSE_HEAVY}))
    assert plans[f"late|{RESPONSE_HEAVY[0]}"] == expected(RESPONSE_HEAVY)
    m = client.metrics()
    assert (m["planner/plans_from_rollout"], m["planner/mismatched"], m["planner/reported_twice"]) == (1, 0, 1)
