"""Per-engine evict on a store several engines share is warned about (`core.shared_store_evict`).

Measured on a 4 prefill + 1 decode fleet (docs/benchmarks.md), evict removes what the other
engines continue and load; the operator counts the policy's engines and warns, never refuses.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest

from moonlease_operator.api import ConditionStatus
from moonlease_operator.core.shared_store_evict import (
    engine_count,
    set_shared_store_evict_condition,
    shared_store_evict_warning,
)

pytestmark = pytest.mark.unit

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def workload(name: str, replicas: int | None, kind: str = "Deployment") -> dict[str, Any]:
    spec: dict[str, Any] = {} if replicas is None else {"replicas": replicas}
    return {"kind": kind, "metadata": {"name": name}, "spec": spec}


def test_engines_are_the_replicas_with_the_api_default() -> None:
    assert engine_count(workload("a", 4)) == 4
    assert engine_count(workload("a", None)) == 1  # the API server's default
    assert engine_count(workload("a", 0)) == 0


@pytest.mark.parametrize(("evict", "workloads", "warned"), [
    (False, [workload("prefill", 4), workload("decode", 1)], False),  # evict off: nothing to say
    (True, [workload("solo", 1)], False),  # one engine writes the store: what evict was made for
    (True, [workload("solo", None)], False),
    (True, [workload("solo", 1), workload("scaled-down", 0)], False),
    (True, [workload("prefill", 2)], True),  # two replicas are two engines
    (True, [workload("prefill", 1), workload("decode", 1, kind="StatefulSet")], True),
])
def test_warned_only_with_evict_on_and_more_than_one_engine(evict: bool, workloads: list[dict[str, Any]],
                                                            warned: bool) -> None:
    assert (shared_store_evict_warning(evict, workloads, listed=5) is not None) is warned


def test_the_message_counts_and_names_the_engines_and_says_what_to_do() -> None:
    message = shared_store_evict_warning(True, [workload("prefill", 4), workload("decode", 1, "StatefulSet")],
                                         listed=5)
    assert message is not None
    assert "5 vLLM engines share the store (Deployment/prefill 4, StatefulSet/decode 1)" in message
    assert "turn evict off" in message and "docs/benchmarks.md" in message
    many = shared_store_evict_warning(True, [workload(f"w{i}", 1) for i in range(8)], listed=5)
    assert many is not None and "Deployment/w4 1 and 3 more workloads" in many and "w5" not in many


def test_the_condition_is_set_once_cleared_and_absent_for_a_policy_that_never_warned() -> None:
    assert set_shared_store_evict_condition([], None, generation=1, now=T0) == ([], None)
    message = shared_store_evict_warning(True, [workload("prefill", 2)], listed=5)
    conditions, note = set_shared_store_evict_condition([], message, generation=2, now=T0)
    [condition] = conditions
    assert condition.type == "EvictOnSharedStore" and condition.status is ConditionStatus.TRUE
    assert condition.reason == "EvictOnSharedStore" and condition.observed_generation == 2
    assert note is not None and note.type == "Warning" and note.message == message
    later = T0 + datetime.timedelta(minutes=1)
    again, note = set_shared_store_evict_condition(conditions, message, generation=2, now=later)
    assert note is None and again[0].last_transition_time == T0  # a standing warning: no new event
    cleared, note = set_shared_store_evict_condition(again, None, generation=3, now=later)
    assert note is None and cleared[0].status is ConditionStatus.FALSE and cleared[0].reason == "AsExpected"
    assert cleared[0].last_transition_time == later


def on_fleet_order(obj: dict[str, Any], url: str | None, container: str = "vllm") -> dict[str, Any]:
    """`obj` whose vLLM container passes our connector a fleet order service (or none)."""
    extra = {"mooncake_fleet_order_url": url} if url else {}
    kv = json.dumps({"kv_connector": "MooncakeStoreConnector", "kv_connector_module_path": "moonlease_connector",
                     "kv_connector_extra_config": extra})
    obj["spec"]["template"] = {"spec": {"containers": [
        {"name": "sidecar", "args": []},
        {"name": container, "args": ["serve", "m", "--kv-transfer-config", kv]}]}}
    return obj


def test_engines_that_all_order_keys_on_one_fleet_order_service_are_not_warned_about() -> None:
    url = "http://fleet-order:8790"
    both = [on_fleet_order(workload("prefill", 4), url), on_fleet_order(workload("decode", 1), url)]
    assert shared_store_evict_warning(True, both, listed=5, containers=["vllm", "vllm"]) is None
    # The first container is the sidecar: without the container's name the URL is not found.
    assert shared_store_evict_warning(True, both, listed=5) is not None

    one_alone = [on_fleet_order(workload("prefill", 4), url), on_fleet_order(workload("decode", 1), None)]
    message = shared_store_evict_warning(True, one_alone, listed=5, containers=["vllm", "vllm"])
    assert message is not None
    assert "each engine without a fleet order service (Deployment/decode)" in message
    assert "Give every engine the fleet order service (mooncake_fleet_order_url" in message

    split = [on_fleet_order(workload("prefill", 4), url), on_fleet_order(workload("decode", 1), "http://other:8790")]
    message = shared_store_evict_warning(True, split, listed=5, containers=["vllm", "vllm"])
    assert message is not None and "name 2 different fleet order services" in message
    # A workload scaled to zero runs no engine: its settings do not count.
    idle = [on_fleet_order(workload("prefill", 4), url), on_fleet_order(workload("old", 0), None)]
    assert shared_store_evict_warning(True, idle, listed=5, containers=["vllm", "vllm"]) is None
