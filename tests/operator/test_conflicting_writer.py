"""A GitOps tool re-applying a Deployment every second (`kubectl replace`, Argo CD's
`Replace=true`) against the operator, with kopf against the local API server: the operator
counts the reverts, backs off instead of fighting (a bounded number of rolling restarts), says so
in the `ConflictingWriter` condition and a warning event naming the field and the field manager,
and recovers once the loop stops.

The local API server does not compute `metadata.managedFields` itself (yet): the loop's PUT
carries the entry a real API server records for such a replace (manager `argocd-controller`,
operation `Update`, the fields it sets), as a client may; the operator reads it as it would on a
real cluster."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import json
from typing import Any

import pytest
from moonlease_operator.runner import OperatorThread

from moonlease_dev.testbed.kube import DEPLOYMENTS, LocalApiServer
from tests.fixtures.kube import FAST_OPTIONS
from tests.operator.fleet import (
    NS,
    PREFILL,
    condition,
    configured,
    create_fleet,
    phase,
    policy,
    workload,
)

pytestmark = pytest.mark.operator

WAIT = 20.0
GITOPS = "argocd-controller"
OPTIONS = FAST_OPTIONS.__class__(**{**FAST_OPTIONS.__dict__, "conflict_reverts": 3, "conflict_backoff": 3.0})


def as_in_git() -> dict[str, Any]:
    """The prefill Deployment as the GitOps tool's repository has it (no Moonlease adoption),
    with the managedFields entry an API server records for the tool's replace."""
    body = copy.deepcopy(PREFILL)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body["metadata"]["managedFields"] = [{
        "manager": GITOPS, "operation": "Update", "apiVersion": "apps/v1", "time": now, "fieldsType": "FieldsV1",
        "fieldsV1": {"f:metadata": {"f:labels": {}}, "f:spec": {"f:replicas": {}, "f:selector": {},
                                                             "f:template": {"f:spec": {"f:containers": {}}}}}}]
    return body


async def replace_every_second(kube: LocalApiServer, stop: asyncio.Event) -> int:
    """The GitOps loop: PUT the repository's manifest every second until `stop`; how many times."""
    count = 0
    while not stop.is_set():
        await kube.emulator.replace_object(DEPLOYMENTS, NS, "llama-prefill", as_in_git())
        count += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)
    return count


def prefill_patches(kube: LocalApiServer, since: int) -> int:
    """The operator's PATCHes of the prefill Deployment (each one a rolling restart here: it
    puts back the settings volume, mount and --kv-transfer-config)."""
    return sum(1 for c in kube.api_calls()[since:] if c.verb == "patch" and c.resource == "deployments"
               and c.name == "llama-prefill" and c.user_agent.startswith("moonlease-operator/"))


def conflict_events(kube: LocalApiServer) -> list[dict[str, Any]]:
    return [e for e in kube.events(NS, involved_name="fleet") if e["reason"] == "ConflictingWriter"]


async def test_a_gitops_loop_is_backed_off_from_named_and_recovered_from(kube: LocalApiServer) -> None:
    await create_fleet(kube)
    async with OperatorThread(connection=kube.connection_info(), options=OPTIONS):
        await kube.create(policy())
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
        since = len(kube.api_calls())
        stop = asyncio.Event()
        loop = asyncio.create_task(replace_every_second(kube, stop))
        try:
            await kube.wait_for(lambda: condition(kube, "ConflictingWriter").get("status") == "True",
                                timeout=WAIT, what="the ConflictingWriter condition")
            message = condition(kube, "ConflictingWriter")["message"]
            assert "Deployment/llama-prefill" in message and f"field manager '{GITOPS}'" in message
            assert "spec.template.spec" in message and "reverted 3 times in a row" in message
            assert phase(kube) == "Degraded" and condition(kube, "Ready")["status"] == "False"
            await kube.wait_for(lambda: any(e["type"] == "Warning" for e in conflict_events(kube)), timeout=WAIT,
                                what="the ConflictingWriter warning")  # posted right after the status
            warning = next(e for e in conflict_events(kube) if e["type"] == "Warning")
            assert GITOPS in warning["message"] and "spec.template" in warning["message"]
            await asyncio.sleep(8)  # the loop goes on: the operator writes once per backoff (3 s, then 6 s)
        finally:
            stop.set()
            replaced = await loop
        patches = prefill_patches(kube, since)
        # Without the backoff every replace was undone at once (one patch per replace).
        # Without the backoff every replace was undone at once (one patch, one restart, per replace):
        # here two before the backoff, then one per backoff (a 409 against the loop may add a retry).
        assert 2 <= patches <= 6 and 2 * patches <= replaced, (patches, replaced)
        recorded = next(c for c in kube.get("mlp", NS, "fleet")["status"]["conflicts"] if c["name"] == "llama-prefill")
        assert recorded["manager"] == GITOPS and recorded["backoffs"] >= 1
        # The loop stopped: after the backoff the operator writes once more, and it stays.
        await kube.wait_for(lambda: phase(kube) == "Ready" and configured(workload(kube, "llama-prefill")
                                                                          ["spec"]["template"]),
                            timeout=WAIT + 30, what="Ready again once the loop stopped")
        await kube.wait_for(lambda: condition(kube, "ConflictingWriter").get("status") == "False",
                            timeout=WAIT, what="the condition cleared")
        assert json.dumps(workload(kube, "llama-prefill")["spec"]["template"]).count("moonlease-connector-settings")
