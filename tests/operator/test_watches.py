"""The operator at rest and across broken watches (issue 16): it reconciles from watch caches,
so a policy at rest costs no request at all, and a watch that the server ends with 410 Gone
lists again without missing a change made while it was away."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import pytest

from moonlease_dev.testbed.kube import LocalApiServer, deployment_manifest
from moonlease_operator.adapters.kube import KubeClient
from moonlease_operator.adapters.watch_cache import ObjectCache
from moonlease_operator.api import LabelSelector
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
        # Each workload's settings ConfigMap was created without reading it first (the caches
        # say it is not there; one that exists would answer 409 and be read then).
        ours = [c for c in kube.api_calls() if c.user_agent.startswith(AGENT) and c.resource == "configmaps"]
        assert [c for c in ours if c.verb == "create"]  # (a create names no object in its path)
        assert not [c for c in ours if c.verb == "get" and (c.name or "").endswith("-moonlease")]
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


async def test_the_workload_caches_label_index_follows_every_change_and_a_410_relist(kube: LocalApiServer) -> None:
    """The label index the planner selects through (`core.label_index`) stays what the cache
    holds: after creations, relabels and deletions arriving by watch, our own writes' answers,
    and a relist after 410 Gone that finds changes made while the watch was away."""
    client = KubeClient(kube.connection_info())
    cache = ObjectCache(lambda: client, "Deployment", (), indexed=True, error_delay=0.05)
    selector = LabelSelector(match_labels={"tier": "decode"})

    def consistent() -> bool:
        index = cache.index(NS)
        held = {name for name, obj in cache.in_namespace(NS).items()
                if (obj["metadata"].get("labels") or {}).get("tier") == "decode"}
        return index is not None and len(index) == len(cache.in_namespace(NS)) and index.candidates(selector) == held

    for i in range(6):
        await kube.create(deployment_manifest(f"w{i}", labels={"tier": "decode" if i % 2 else "prefill"}))
    cache.start()
    try:
        await asyncio.wait_for(cache.wait_synced(), WAIT)
        assert consistent() and cache.index(NS).candidates(selector) == {"w1", "w3", "w5"}  # type: ignore[union-attr]
        await kube.patch("deployments", NS, "w0", {"metadata": {"labels": {"tier": "decode"}}})
        await kube.patch("deployments", NS, "w1", {"metadata": {"labels": {"tier": None}}})
        await kube.delete("deployments", NS, "w3")
        await kube.wait_for(lambda: consistent() and cache.index(NS).candidates(selector) == {"w0", "w5"},  # type: ignore[union-attr]
                            timeout=WAIT, what="the index after watch events")
        answer = await kube.patch("deployments", NS, "w2", {"metadata": {"labels": {"tier": "decode"}}})
        cache.record_written({**answer, "kind": "Deployment"})  # our own write, before its event
        assert consistent() and "w2" in cache.index(NS).candidates(selector)  # type: ignore[operator,union-attr]

        blocked = kube.inject_failures("deployments", None, None, status=503, count=10**6, verbs=("watch",))
        assert kube.close_watches("deployments") >= 1
        await kube.wait_for(lambda: blocked.fired >= 1, timeout=WAIT, what="a refused watch")
        await kube.patch("deployments", NS, "w4", {"metadata": {"labels": {"tier": "decode"}}})
        await kube.delete("deployments", NS, "w5")
        kube.compact()
        blocked.remaining = 0
        await kube.wait_for(lambda: cache.relists >= 1, timeout=WAIT, what="a relist after 410 Gone")
        await kube.wait_for(lambda: consistent() and cache.index(NS).candidates(selector) == {"w0", "w2", "w4"},  # type: ignore[union-attr]
                            timeout=WAIT, what="the index after the relist")
    finally:
        await cache.stop()
        await client.close()
