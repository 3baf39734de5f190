"""A policy's name becomes a label value on every workload it manages, so the operator refuses
names the API server would refuse as label values (over 63 characters) instead of patching the
workloads forever against 422 answers (found by the local API server's label validation)."""

from __future__ import annotations

import pytest

from moonlease.testbed.kube import LocalApiServer
from moonlease_operator.api.policy import policy_name_problems
from moonlease_operator.runner import OperatorThread
from tests.fixtures.kube import FAST_OPTIONS
from tests.operator.fleet import WORKLOADS, as_left_by_users, condition, create_fleet, phase, policy, workload

pytestmark = pytest.mark.operator

LONG_NAME = "a-policy-whose-name-is-longer-than-sixty-three-characters-so-long"


def test_the_name_rule() -> None:
    assert policy_name_problems("p" * 63) == []
    assert "no more than 63 characters" in policy_name_problems("p" * 64)[0]


async def test_a_policy_named_longer_than_a_label_value_is_refused_and_touches_nothing(
        kube: LocalApiServer) -> None:
    originals = await create_fleet(kube)
    assert len(LONG_NAME) > 63
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        await kube.create(policy(LONG_NAME))
        await kube.wait_for(lambda: phase(kube, LONG_NAME) == "Invalid", timeout=15, what="phase Invalid")
    invalid = condition(kube, "Invalid", LONG_NAME)
    assert invalid["status"] == "True" and "no more than 63 characters" in invalid["message"]
    for name in WORKLOADS:
        assert as_left_by_users(workload(kube, name)) == as_left_by_users(originals[name])
    refused = [e for e in kube.emulator.errors if getattr(e, "status", None) == 422]
    assert refused == []  # the operator never sent the API server a label it must refuse
