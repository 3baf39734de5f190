"""GitOps tools writing what the operator writes, with kopf against the local API server, each
through the API as such a tool does, under its own field manager (the server records
`metadata.managedFields` as a real one would):

* re-applying a Deployment every second (`kubectl replace`, Argo CD's `Replace=true`: a PUT with
  `?fieldManager=`): the operator counts the reverts, backs off instead of fighting (a bounded
  number of rolling restarts), says so in the `ConflictingWriter` condition and a warning event
  naming the field and the field manager, and recovers once the loop stops;
* owning a workload's connector-settings ConfigMap (a server-side apply of the repository's
  copy, forced, every second, as Argo CD or Flux do): the operator names the ConfigMap's field
  and the tool's field manager the same way and leaves the workload alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from moonlease_operator.core.connector_delivery import settings_config_map_name
from moonlease_operator.runner import OperatorThread

from moonlease_settings.settings_file import SETTINGS_FILE_NAME
from moonlease_dev.testbed.kube import CONFIGMAPS, LocalApiServer
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
DEPLOYMENT_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/llama-prefill"


async def every_second(write: Callable[[], Awaitable[Any]], stop: asyncio.Event) -> int:
    """The GitOps loop: `write` every second until `stop`; how many times."""
    count = 0
    while not stop.is_set():
        await write()
        count += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)
    return count


async def send(kube: LocalApiServer, method: str, path: str, body: dict[str, Any], *, manager: str,
               content_type: str = "application/json", **params: str) -> dict[str, Any]:
    """One write of the GitOps tool over HTTP, under its field manager."""
    async with aiohttp.ClientSession() as session, session.request(
            method, kube.url + path, data=json.dumps(body), params={"fieldManager": manager, **params},
            headers={"Content-Type": content_type}) as response:
        answer = await response.json()
        assert response.status == 200, answer
        return answer


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
        # The repository's manifest (no Moonlease adoption), replaced unconditionally (no resourceVersion).
        loop = asyncio.create_task(every_second(
            lambda: send(kube, "PUT", DEPLOYMENT_PATH, copy.deepcopy(PREFILL), manager=GITOPS), stop))
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
            # Backing off, the operator leaves the tool's last replace in place: the server recorded
            # it as an Update by the tool's manager, of the pod template the operator had written.
            owners = {e["manager"]: e for e in workload(kube, "llama-prefill")["metadata"]["managedFields"]}
            assert owners[GITOPS]["operation"] == "Update" and "f:template" in owners[GITOPS]["fieldsV1"]["f:spec"]
            await asyncio.sleep(8)  # the loop goes on: the operator writes once per backoff (3 s, then 6 s)
        finally:
            stop.set()
            replaced = await loop
        patches = prefill_patches(kube, since)
        # Without the backoff every replace was undone at once (one patch, one restart, per replace):
        # here two before the backoff, then one per backoff (3 s, then 6 s), and a 409 against the loop
        # may add a retry to each (6 or 7 patches against 11 replaces on a loaded two-core machine);
        # without it about one per replace (11 or more over this time).
        assert 2 <= patches <= 8 and patches < replaced, (patches, replaced)
        recorded = next(c for c in kube.get("mlp", NS, "fleet")["status"]["conflicts"] if c["name"] == "llama-prefill")
        assert recorded["manager"] == GITOPS and recorded["backoffs"] >= 1
        # The loop stopped: after the backoff the operator writes once more, and it stays.
        await kube.wait_for(lambda: phase(kube) == "Ready" and configured(workload(kube, "llama-prefill")
                                                                          ["spec"]["template"]),
                            timeout=WAIT + 30, what="Ready again once the loop stopped")
        await kube.wait_for(lambda: condition(kube, "ConflictingWriter").get("status") == "False",
                            timeout=WAIT, what="the condition cleared")
        assert json.dumps(workload(kube, "llama-prefill")["spec"]["template"]).count("moonlease-connector-settings")



async def test_a_gitops_tool_owning_a_settings_config_map_is_named_and_backed_off_from(kube: LocalApiServer) -> None:
    """The tool's repository holds the prefill's settings ConfigMap as it was before the policy
    (leaseAll) and applies it server-side, forced, every second: each apply takes the data back
    from the operator's field manager. After three reverts in a row the operator leaves the
    prefill alone and names the ConfigMap's field and the tool's manager (condition and event)."""
    gitops = "flux"
    name = settings_config_map_name("llama-prefill")
    await create_fleet(kube)
    async with OperatorThread(connection=kube.connection_info(), options=OPTIONS):
        await kube.create(policy())
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
        settings = json.loads(kube.get(CONFIGMAPS, NS, name)["data"][SETTINGS_FILE_NAME])
        assert settings["mooncake_lease_mode"] == "selective"
        in_git = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": NS},
                  "data": {SETTINGS_FILE_NAME: json.dumps({**settings, "mooncake_lease_mode": "leaseAll"})}}
        stop = asyncio.Event()
        loop = asyncio.create_task(every_second(
            lambda: send(kube, "PATCH", f"/api/v1/namespaces/{NS}/configmaps/{name}", in_git, manager=gitops,
                         content_type="application/apply-patch+yaml", force="true"), stop))
        try:
            await kube.wait_for(lambda: condition(kube, "ConflictingWriter").get("status") == "True",
                                timeout=WAIT, what="the ConflictingWriter condition")
            message = condition(kube, "ConflictingWriter")["message"]
            assert f"ConfigMap/{name} data[{SETTINGS_FILE_NAME}] (mooncake_lease_mode)" in message, message
            assert f"field manager '{gitops}'" in message and "reverted 3 times in a row" in message, message
            await kube.wait_for(lambda: any(e["type"] == "Warning" for e in conflict_events(kube)), timeout=WAIT,
                                what="the ConflictingWriter warning")
            warning = next(e for e in conflict_events(kube) if e["type"] == "Warning")
            assert gitops in warning["message"] and f"ConfigMap/{name}" in warning["message"], warning["message"]
            # The tool's apply owns the data, as an Apply entry of its manager.
            owners = {(e["manager"], e["operation"]): e["fieldsV1"]
                      for e in kube.get(CONFIGMAPS, NS, name)["metadata"]["managedFields"]}
            assert f"f:{SETTINGS_FILE_NAME}" in owners[(gitops, "Apply")]["f:data"], owners
        finally:
            stop.set()
            await loop
        recorded = next(c for c in kube.get("mlp", NS, "fleet")["status"]["conflicts"] if c["name"] == "llama-prefill")
        assert recorded["manager"] == gitops and recorded["field"].startswith(f"ConfigMap/{name} "), recorded
