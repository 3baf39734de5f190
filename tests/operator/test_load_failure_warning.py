"""The operator warns about vLLM workloads whose failed store loads would fail requests: kopf
against the local API server.

A connector cannot make vLLM recompute a failed or late load (vLLM routes every reported load
failure through `kv_load_failure_policy`, and its default `fail` ends the request), so each
workload whose vLLM command does not set `recompute` is named — with the line to add — in the
policy's `LoadFailuresFailRequests` condition and a Warning event, posted once, and the
condition clears once the owner adds the line.
"""

from __future__ import annotations

import copy
import json

import pytest

from moonlease_dev.testbed.kube import LocalApiServer
from moonlease_operator.runner import OperatorThread
from tests.fixtures.kube import FAST_OPTIONS
from tests.operator.fleet import (
    NS,
    PREFILL,
    USER_KV_CONFIG,
    WORKLOADS,
    condition,
    create_fleet,
    let_reconcile,
    phase,
    policy,
    workload,
)

pytestmark = pytest.mark.operator

WAIT = 15.0
RECOMPUTE = {"kv_load_failure_policy": "recompute"}


def warnings(kube: LocalApiServer) -> list[dict]:
    return kube.events(NS, involved_name="fleet", reason="LoadFailurePolicyFail")


async def test_workloads_without_recompute_are_warned_about_once_until_the_line_is_added(
        kube: LocalApiServer) -> None:
    # The prefill Deployment sets recompute; the decode StatefulSet leaves vLLM's default.
    prefill = copy.deepcopy(PREFILL)
    container = prefill["spec"]["template"]["spec"]["containers"][0]
    container["args"][-1] = json.dumps({**USER_KV_CONFIG, **RECOMPUTE})
    await create_fleet(kube, prefill=prefill)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        await kube.create(policy())
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
        warned = condition(kube, "LoadFailuresFailRequests")
        assert warned["status"] == "True" and warned["reason"] == "LoadFailurePolicyFail"
        assert "StatefulSet/llama-decode does not set kv_load_failure_policy" in warned["message"]
        assert '"kv_load_failure_policy": "recompute"' in warned["message"]
        assert "llama-prefill" not in warned["message"]
        [event] = warnings(kube)
        assert event["type"] == "Warning" and event["message"] == warned["message"]
        await let_reconcile(3)
        assert len(warnings(kube)) == 1  # said once

        # The owner adds the line to the decode's --kv-transfer-config (the operator's own
        # entries kept): the condition clears, the rollout stays Ready.
        decode = workload(kube, "llama-decode")
        args = decode["spec"]["template"]["spec"]["containers"][0]["args"]
        at = args.index("--kv-transfer-config") + 1
        args[at] = json.dumps({**json.loads(args[at]), **RECOMPUTE})
        await kube.patch(WORKLOADS["llama-decode"], NS, "llama-decode",
                         {"spec": {"template": {"spec": {"containers": decode["spec"]["template"]["spec"]["containers"]}}}})
        await kube.wait_for(lambda: condition(kube, "LoadFailuresFailRequests").get("status") == "False",
                            timeout=WAIT, what="the warning cleared")
        assert condition(kube, "LoadFailuresFailRequests")["reason"] == "AsExpected"
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready again")
        assert len(warnings(kube)) == 1
