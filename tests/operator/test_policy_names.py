"""A policy's name becomes the `moonlease.io/policy` label value on every workload it manages;
the API server refuses label values over 63 characters (422 on every patch, as the local API
server's label validation showed), so a longer name is hash-truncated into a valid value
(issue 15) and such a policy works like any other."""

from __future__ import annotations

import pytest

from moonlease_dev.testbed.kube import LocalApiServer
from moonlease_operator.core.slots import POLICY_LABEL, policy_label_value
from moonlease_operator.runner import OperatorThread
from tests.fixtures.kube import FAST_OPTIONS
from tests.operator.fleet import WORKLOADS, as_left_by_users, create_fleet, phase, policy, workload

pytestmark = pytest.mark.operator

LONG_NAME = "a-policy-whose-name-is-longer-than-sixty-three-characters-so-long"


async def test_a_policy_named_longer_than_a_label_value_rolls_out_and_gives_back(kube: LocalApiServer) -> None:
    originals = await create_fleet(kube)
    assert len(LONG_NAME) > 63
    label = policy_label_value(LONG_NAME)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        await kube.create(policy(LONG_NAME))
        await kube.wait_for(lambda: phase(kube, LONG_NAME) == "Ready", timeout=15, what="phase Ready")
        for name in WORKLOADS:
            assert workload(kube, name)["metadata"]["labels"][POLICY_LABEL] == label
        await kube.delete("mlp", "default", LONG_NAME)
        await kube.wait_for(lambda: kube.get("mlp", "default", LONG_NAME) is None, timeout=15, what="released")
    for name in ("llama-prefill", "llama-decode"):  # found again by the truncated label, and given back
        assert as_left_by_users(workload(kube, name)) == as_left_by_users(originals[name])
    refused = [e for e in kube.emulator.errors if getattr(e, "status", None) == 422]
    assert refused == []  # the operator never sent the API server a label it must refuse
