import logging
import uuid

import pytest
import ray

from augtree_verl.planner import ClusterProfile, plan_tree
from augtree_verl.planner.service import PlannerClient, start_planner_service

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

DEGREES = (1, 2, 4, 8)
PROMPT_HEAVY = (131072, [256] * 8)      # MoveQ
RESPONSE_HEAVY = (512, [16384] * 8)     # TreeMoveKV
ACTOR_START_TIMEOUT_S = 60              # the actor imports torch on a shared 2-core machine


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def started_service(**kwargs):
    name = f"planner-{uuid.uuid4().hex[:8]}"
    actor = start_planner_service(name, degrees=DEGREES, **kwargs)
    ray.get(actor.config.remote(), timeout=ACTOR_START_TIMEOUT_S)
    return name, actor


def expected(group):
    return plan_tree(*group, degrees=DEGREES)


@pytest.mark.timeout(120)
def test_plans_arrive_from_the_actor():
    name, _ = started_service()
    client = PlannerClient(name, degrees=DEGREES, timeout_s=10.0)
    groups = {"a": PROMPT_HEAVY, "b": RESPONSE_HEAVY, "c": (300, [40, 50, 7])}
    client.submit(0, groups)
    plans = client.fetch(0, ["c", "a", "b"])
    assert list(plans) == ["c", "a", "b"]
    for gid, group in groups.items():
        assert plans[gid] == expected(group)
    m = client.metrics()
    assert m["planner/fallbacks"] == 0 and m["planner/plans"] == 3
    assert m["planner/plans_move_q"] >= 1 and m["planner/plans_tree_move_kv"] >= 1
    assert m["planner/solve_ms_mean"] > 0


@pytest.mark.timeout(120)
def test_two_steps_do_not_mix():
    name, _ = started_service()
    client = PlannerClient(name, degrees=DEGREES, timeout_s=10.0)
    client.submit(1, {"g": PROMPT_HEAVY})
    client.submit(2, {"g": RESPONSE_HEAVY})
    assert client.fetch(2, ["g"])["g"] == expected(RESPONSE_HEAVY)
    assert client.fetch(1, ["g"])["g"] == expected(PROMPT_HEAVY)
    assert expected(PROMPT_HEAVY) != expected(RESPONSE_HEAVY)
    assert client.metrics()["planner/fallbacks"] == 0


@pytest.mark.timeout(120)
def test_killed_actor_triggers_counted_fallback(caplog):
    name, actor = started_service()
    client = PlannerClient(name, degrees=DEGREES, timeout_s=5.0)
    client.submit(0, {"a": PROMPT_HEAVY})
    assert client.fetch(0, ["a"])["a"] == expected(PROMPT_HEAVY)
    ray.kill(actor)
    client.submit(1, {"a": RESPONSE_HEAVY, "b": PROMPT_HEAVY})
    with caplog.at_level(logging.WARNING, logger="augtree_verl.planner.service"):
        plans = client.fetch(1, ["a", "b"])
    assert plans == {"a": expected(RESPONSE_HEAVY), "b": expected(PROMPT_HEAVY)}
    assert client.metrics()["planner/fallbacks"] == 2
    assert "planning them in-process" in caplog.text


@pytest.mark.timeout(60)
def test_missing_actor_falls_back_without_waiting_for_it():
    client = PlannerClient(f"absent-{uuid.uuid4().hex[:8]}", degrees=DEGREES, timeout_s=1.0)
    client.submit(3, {"x": (300, [40, 50])})
    assert client.fetch(3, ["x"])["x"] == expected((300, [40, 50]))
    assert client.metrics()["planner/fallbacks"] == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("group, message", [
    ((0, [5]), "prompt_len must be a positive int, got 0"),
    ((10, [5, -2]), r"response_lens\[1\] must be a positive int, got -2"),
    ((10, [5, 0]), r"response_lens\[1\] must be a positive int, got 0"),
    ((10, []), "response_lens is empty"),
    ((10,), r"expected \(prompt_len, response_lens\), got \(10,\)"),
])
def test_bad_input_names_the_group(group, message):
    client = PlannerClient(f"absent-{uuid.uuid4().hex[:8]}", degrees=DEGREES)
    with pytest.raises(ValueError, match=f"group 'uid-7' of step 4: .*{message}"):
        client.submit(4, {"ok": (10, [5]), "uid-7": group})


@pytest.mark.timeout(60)
def test_fetch_of_unsubmitted_group_names_it():
    client = PlannerClient(f"absent-{uuid.uuid4().hex[:8]}", degrees=DEGREES)
    client.submit(0, {"a": (10, [5])})
    with pytest.raises(ValueError, match="group 'b' of step 0 was never submitted"):
        client.fetch(0, ["a", "b"])


@pytest.mark.timeout(120)
def test_client_refuses_an_actor_with_another_configuration():
    name, _ = started_service(profile=ClusterProfile.default())
    client = PlannerClient(name, degrees=(1, 2), timeout_s=10.0)
    with pytest.raises(ValueError, match="plans would differ"):
        client.submit(0, {"a": (10, [5])})
