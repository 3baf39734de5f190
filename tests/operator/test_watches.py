"""The operator at rest and across broken watches (issue 16): it reconciles from watch caches,
so a policy at rest costs no request at all, and a watch that the server ends with 410 Gone
lists again without missing a change made while it was away."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import pytest

from moonlease.testbed.kube import LocalApiServer
from moonlease_operator.runner import OperatorThread
from tests.fixtures.kube import FAST_OPTIONS
from tests.operator.fleet import NS, WORKLOADS, create_fleet, phase, policy, workload

pytestmark = pytest.mark.operator
WAIT = 15.0
AGENT = "moonlease-operator/"


async def edit_master_eviction_ratio(kube: LocalApiServer, ratio: str) -> None:
    """A user's edit of the master's `--eviction_ratio` (drift the policy repairs)."""
    master = copy.deepcopy(workload(kube, "mooncake-master"))
    containers = master["spec"]["template"]["spec"]["containers"]
    containers[0]["args"] = [a for a in containers[0]["args"] if not a.startswith("--eviction_ratio=")] + [
        f"--eviction_ratio={ratio}"]
    await kube.patch(WORKLOADS["mooncake-master"], NS, "mooncake-master",
                     {"spec": {"template": {"spec": {"containers": containers}}}})


async def test_a_policy_at_rest_sends_no_request_over_a_minute_of_reconcile_intervals(kube: LocalApiServer) -> None:
    """With a reconcile interval of 0.05 s, 3 s is sixty intervals — five minutes of the default
    5 s — in which the polling design listed policies, Deployments and StatefulSets each time.
    Now the operator sends nothing: the traffic counter sees no request from it (its watches,
    opened earlier, stay open and quiet)."""
    await create_fleet(kube)
    options = dataclasses.replace(FAST_OPTIONS, reconcile_interval=0.05, resync_interval=600.0)
    async with OperatorThread(connection=kube.connection_info(), options=options):
        await kube.create(policy())
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
        await asyncio.sleep(0.5)  # the last status write's own watch event comes back
        mark, traffic = len(kube.api_calls()), kube.traffic.snapshot()
        await asyncio.sleep(3.0)
        calls = [(c.verb, c.rbac_resource) for c in kube.api_calls()[mark:] if c.user_agent.startswith(AGENT)]
        assert calls == []
        assert not [key for key in kube.traffic.since(traffic).requests if key[0] == "list"]
        assert kube.emulator.open_watches >= 4  # Deployments, StatefulSets, two ConfigMap caches (+ kopf's)

        # And an edit of a workload wakes the policy at once, without waiting for the resync.
        await edit_master_eviction_ratio(kube, "0.3")
        await kube.wait_for(lambda: "--eviction_ratio=0.1" in workload(kube, "mooncake-master")["spec"]["template"]
                            ["spec"]["containers"][0]["args"], timeout=WAIT, what="the drift repaired (woken by the watch)")
        assert not [c for c in kube.api_calls()[mark:] if c.user_agent.startswith(AGENT) and c.verb == "list"]


async def test_a_watch_ended_with_410_gone_lists_again_and_misses_no_change(kube: LocalApiServer) -> None:
    """The Deployment watches are cut and cannot come back for a while; meanwhile someone
    edits the master and the server compacts its history, so resuming answers 410 Gone. The
    cache lists again, sees the edit and wakes the policy, which repairs it."""
    await create_fleet(kube)
    options = dataclasses.replace(FAST_OPTIONS, resync_interval=600.0)
    async with OperatorThread(connection=kube.connection_info(), options=options):
        await kube.create(policy())
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
        blocked = kube.inject_failures("deployments", None, None, status=503, count=10**6, verbs=("watch",))
        assert kube.close_watches("deployments") >= 1
        await kube.wait_for(lambda: blocked.fired >= 1, timeout=WAIT, what="a refused watch")
        await edit_master_eviction_ratio(kube, "0.3")
        kube.compact()
        blocked.remaining = 0  # the watches may come back now: from a forgotten resourceVersion
        await kube.wait_for(lambda: any(plural == "deployments" for plural, _ in kube.emulator.expired_watches()),
                            timeout=WAIT, what="a watch answered 410 Gone")
        await kube.wait_for(lambda: "--eviction_ratio=0.1" in workload(kube, "mooncake-master")["spec"]["template"]
                            ["spec"]["containers"][0]["args"], timeout=WAIT, what="the missed edit repaired")
