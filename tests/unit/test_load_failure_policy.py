"""Which vLLM workloads fail a request when a store load fails (`core.load_failure_policy`).

vLLM 0.32/0.33 route every load failure a connector can report (invalid block ids, failed
receiving requests) through `kv_load_failure_policy`; under `fail` the request ends with
`finish_reason "error"`, so the operator warns about workloads that do not set `recompute`.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest

from moonlease_operator.api import ConditionStatus
from moonlease_operator.core.load_failure_policy import (
    LINE_TO_ADD,
    load_failure_policy,
    load_failure_warning,
    set_load_failure_condition,
)

pytestmark = pytest.mark.unit

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def workload(container: dict[str, Any], name: str = "llama") -> dict[str, Any]:
    return {"kind": "Deployment", "metadata": {"name": name},
            "spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": "vllm:1", **container}]}}}}


def with_doc(doc: dict[str, Any], *, equals: bool = False) -> dict[str, Any]:
    text = json.dumps(doc)
    return workload({"args": ["serve", "m", *([f"--kv-transfer-config={text}"] if equals
                                               else ["--kv-transfer-config", text])]})


@pytest.mark.parametrize(("obj", "expected"), [
    (workload({"args": ["serve", "m"]}), None),  # no --kv-transfer-config at all
    (with_doc({"kv_connector": "MooncakeStoreConnector"}), None),
    (with_doc({"kv_load_failure_policy": "recompute"}), "recompute"),
    (with_doc({"kv_load_failure_policy": "fail"}, equals=True), "fail"),
    # In a shell script: the vLLM command's own words count, the last option wins.
    (workload({"command": ["/bin/sh", "-c"], "args": [
        "echo '{\"kv_load_failure_policy\": \"recompute\"}' && exec vllm serve m --kv-transfer-config "
        "'{\"kv_load_failure_policy\": \"fail\"}'"]}), "fail"),
    (workload({"args": ["serve", "m", "--kv-transfer-config", json.dumps({"kv_load_failure_policy": "fail"}),
                        "--kv-transfer-config", json.dumps({"kv_load_failure_policy": "recompute"})]}), "recompute"),
])
def test_the_policy_is_read_as_vllm_starts(obj: dict[str, Any], expected: str | None) -> None:
    assert load_failure_policy(obj, None) == expected


def test_only_recompute_is_not_warned_about() -> None:
    assert load_failure_warning(with_doc({"kv_load_failure_policy": "recompute"}), None) is None
    unset = load_failure_warning(workload({"args": ["serve", "m"]}, name="decode"), None)
    assert unset is not None and "Deployment/decode" in unset and "does not set" in unset
    assert LINE_TO_ADD in unset and "--kv-transfer-config" in unset and "finish_reason error" in unset
    failing = load_failure_warning(with_doc({"kv_load_failure_policy": "fail"}), None)
    assert failing is not None and "sets kv_load_failure_policy 'fail'" in failing
    assert LINE_TO_ADD == '"kv_load_failure_policy": "recompute"'


def test_the_condition_is_set_listed_and_cleared_and_its_event_posted_once() -> None:
    warnings = [f"w{i} does not set it" for i in range(7)]
    conditions, note = set_load_failure_condition([], warnings, listed=5, generation=3, now=T0)
    [condition] = conditions
    assert condition.type == "LoadFailuresFailRequests" and condition.status is ConditionStatus.TRUE
    assert condition.reason == "LoadFailurePolicyFail" and condition.observed_generation == 3
    assert "w4 does not set it" in condition.message and "w5" not in condition.message
    assert condition.message.endswith("; and 2 more")
    assert note is not None and note.type == "Warning" and note.message == condition.message
    # The same warnings again: no new event, the transition time kept.
    later = T0 + datetime.timedelta(minutes=1)
    again, note = set_load_failure_condition(conditions, warnings, listed=5, generation=3, now=later)
    assert note is None and again[0].last_transition_time == T0
    # Another workload joins the first five: a new event.
    changed, note = set_load_failure_condition(again, ["x does not set it", *warnings], listed=5, generation=3,
                                               now=later)
    assert note is not None and "x does not set it" in note.message
    # Fixed everywhere: False, no event; a policy that never warned has no such condition.
    cleared, note = set_load_failure_condition(changed, [], listed=5, generation=4, now=later)
    assert note is None and cleared[0].status is ConditionStatus.FALSE and cleared[0].reason == "AsExpected"
    assert set_load_failure_condition([], [], listed=5, generation=1, now=T0) == ([], None)
