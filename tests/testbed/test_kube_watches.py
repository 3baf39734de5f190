"""Watch semantics of the local API server, over HTTP: resuming from a resourceVersion, bookmarks,
410 Gone for a forgotten resourceVersion, selector transitions, server-side timeouts — and kopf
itself resuming a watch dropped with 410 Gone without missing the change made meanwhile."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import aiohttp
import kopf
import pytest

from moonlease_dev.testbed.kube import CONFIGMAPS, DEPLOYMENTS, LocalApiServer, deployment_manifest, local_api_server

pytestmark = pytest.mark.operator

DEPLOYS = "/apis/apps/v1/namespaces/default/deployments"


async def watch(kube: LocalApiServer, path: str, params: dict[str, str], *, until: int,
                timeout: float = 10.0) -> list[dict[str, Any]]:
    """Read watch events until `until` have come or the server ends the stream."""
    events: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:
        async with session.get(kube.url + path, params={"watch": "true", **params}) as rsp:
            assert rsp.status == 200

            async def read() -> None:
                async for line in rsp.content:
                    if line.strip():
                        events.append(json.loads(line))
                        if len(events) >= until:
                            return

            await asyncio.wait_for(read(), timeout)
    return events


def summary(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["type"], e["object"].get("metadata", {}).get("name", "")) for e in events]


async def test_a_watch_from_a_version_gets_only_later_changes(kube_manual: LocalApiServer) -> None:
    await kube_manual.create(deployment_manifest("old"))
    since = str(kube_manual.emulator.resource_version)
    await kube_manual.create(deployment_manifest("new"))
    await kube_manual.patch(DEPLOYMENTS, "default", "old", {"spec": {"replicas": 3}})
    await kube_manual.delete(DEPLOYMENTS, "default", "new")
    events = await watch(kube_manual, DEPLOYS, {"resourceVersion": since}, until=3)
    assert summary(events) == [("ADDED", "new"), ("MODIFIED", "old"), ("DELETED", "new")]
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(versions) and versions[0] > int(since)

    # Without a resourceVersion (or "0"): the current state first, as synthetic ADDED events.
    assert summary(await watch(kube_manual, DEPLOYS, {"resourceVersion": "0"}, until=1)) == [("ADDED", "old")]


async def test_a_forgotten_version_answers_410_gone(kube_manual: LocalApiServer) -> None:
    await kube_manual.create(deployment_manifest("web"))
    since = str(kube_manual.emulator.resource_version)
    await kube_manual.patch(DEPLOYMENTS, "default", "web", {"spec": {"replicas": 3}})
    kube_manual.compact()
    events = await watch(kube_manual, DEPLOYS, {"resourceVersion": since}, until=2)
    assert len(events) == 1 and events[0]["type"] == "ERROR"  # and the server ends the stream
    status = events[0]["object"]
    assert (status["kind"], status["code"], status["reason"]) == ("Status", 410, "Expired")
    assert status["message"].startswith(f"too old resource version: {since}")
    assert kube_manual.emulator.expired_watches() == [("deployments", int(since))]
    # The version compacted at is still good: nothing after it was forgotten.
    now = str(kube_manual.emulator.resource_version)
    await kube_manual.create(deployment_manifest("next"))
    assert summary(await watch(kube_manual, DEPLOYS, {"resourceVersion": now}, until=1)) == [("ADDED", "next")]


async def test_a_bounded_history_forgets_old_versions() -> None:
    async with local_api_server(simulate=False, watch_history=3) as kube:
        await kube.create(deployment_manifest("web"))
        since = str(kube.emulator.resource_version)
        for replicas in range(3, 7):  # four changes: one more than the history holds
            await kube.patch(DEPLOYMENTS, "default", "web", {"spec": {"replicas": replicas}})
        events = await watch(kube, DEPLOYS, {"resourceVersion": since}, until=1)
        assert events[0]["type"] == "ERROR" and events[0]["object"]["code"] == 410
        recent = str(int(since) + 1)
        assert summary(await watch(kube, DEPLOYS, {"resourceVersion": recent}, until=3)) == [("MODIFIED", "web")] * 3


async def test_bookmarks_and_timeouts() -> None:
    async with local_api_server(simulate=False, bookmark_interval=0.2) as kube:
        await kube.create(deployment_manifest("web"))
        await kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "other"}})
        since = str(kube.emulator.resource_version)
        events = await watch(kube, DEPLOYS, {"resourceVersion": since, "allowWatchBookmarks": "true"}, until=1)
        bookmark = events[0]
        assert bookmark["type"] == "BOOKMARK" and bookmark["object"]["kind"] == "Deployment"
        assert bookmark["object"]["metadata"] == {"resourceVersion": since}
        # No bookmarks unless asked for; timeoutSeconds ends the stream.
        assert await watch(kube, DEPLOYS, {"resourceVersion": since, "timeoutSeconds": "1"}, until=1) == []
        # sendInitialEvents: the state, then a bookmark that marks its end.
        events = await watch(kube, DEPLOYS, {"sendInitialEvents": "true", "allowWatchBookmarks": "true",
                                             "resourceVersionMatch": "NotOlderThan"}, until=2)
        assert summary(events)[0] == ("ADDED", "web") and events[1]["type"] == "BOOKMARK"
        assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


async def test_selector_transitions_are_added_and_deleted(kube_manual: LocalApiServer) -> None:
    await kube_manual.create(deployment_manifest("web", labels={"tier": "web"}))
    await kube_manual.create(deployment_manifest("db", labels={"tier": "db"}))
    since = str(kube_manual.emulator.resource_version)
    await kube_manual.patch(DEPLOYMENTS, "default", "web", {"metadata": {"labels": {"tier": "db"}}})
    await kube_manual.patch(DEPLOYMENTS, "default", "db", {"metadata": {"labels": {"tier": "web"}}})
    await kube_manual.patch(DEPLOYMENTS, "default", "db", {"spec": {"replicas": 4}})
    events = await watch(kube_manual, DEPLOYS, {"resourceVersion": since, "labelSelector": "tier=web"}, until=3)
    assert summary(events) == [("DELETED", "web"), ("ADDED", "db"), ("MODIFIED", "db")]


async def test_closed_watches_end_and_resume(kube_manual: LocalApiServer) -> None:
    since = str(kube_manual.emulator.resource_version)
    task = asyncio.create_task(watch(kube_manual, DEPLOYS, {"resourceVersion": since}, until=5))
    await kube_manual.wait_for(lambda: kube_manual.emulator.open_watches == 1, what="the watch open")
    assert kube_manual.close_watches(DEPLOYMENTS) == 1
    assert await asyncio.wait_for(task, 5) == []
    await kube_manual.create(deployment_manifest("web"))
    assert summary(await watch(kube_manual, DEPLOYS, {"resourceVersion": since}, until=1)) == [("ADDED", "web")]


# ---- kopf against a watch that expires ---------------------------------------------------------------------

class KopfRecorder:
    """A minimal kopf operator in a thread of its own: an event handler recording every
    ConfigMap body it is given (kopf's own watch and re-list machinery, nothing of ours)."""

    def __init__(self, kube: LocalApiServer) -> None:
        self.kube = kube
        self.seen: list[tuple[str | None, str, dict[str, str]]] = []
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kopf-recorder", daemon=True)

    def _run(self) -> None:
        registry = kopf.OperatorRegistry()
        connection = self.kube.connection_info()

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return connection

        @kopf.on.event("", "v1", "configmaps", registry=registry)
        def record(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
            self.seen.append((event.get("type"), body["metadata"]["name"], dict(body.get("data") or {})))

        settings = kopf.OperatorSettings()
        settings.posting.enabled = False
        asyncio.run(kopf.operator(registry=registry, settings=settings, namespaces=["default"], standalone=True,
                                  stop_flag=self.stop, ready_flag=self.ready))

    async def __aenter__(self) -> KopfRecorder:
        self.thread.start()
        await asyncio.to_thread(self.ready.wait, 15)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        await asyncio.to_thread(self.thread.join, 15)

    def saw(self, name: str, data: dict[str, str]) -> bool:
        return any(n == name and d == data for _, n, d in self.seen)


async def test_kopf_resumes_a_watch_dropped_with_410_without_missing_a_change(kube: LocalApiServer) -> None:
    await kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "watched"}, "data": {"v": "1"}})
    async with KopfRecorder(kube) as kopf_side:
        await kube.wait_for(lambda: kopf_side.saw("watched", {"v": "1"}), timeout=15, what="kopf's first view")
        await kube.wait_for(lambda: kube.emulator.open_watches_of(CONFIGMAPS) == 1, timeout=15,
                            what="kopf's configmaps watch open")
        lists_before = sum(1 for c in kube.api_calls() if (c.verb, c.resource) == ("list", "configmaps"))

        # In one step of the server's loop, so kopf cannot reconnect in between: its watch ends,
        # the change happens, and the history that would let it resume is compacted away.
        closed = kube.close_watches(CONFIGMAPS)
        await kube.patch(CONFIGMAPS, "default", "watched", {"data": {"v": "2"}})
        kube.compact()
        assert closed == 1

        await kube.wait_for(lambda: kopf_side.saw("watched", {"v": "2"}), timeout=15,
                            what="kopf seeing the change made while its watch was down")
        assert [plural for plural, _ in kube.emulator.expired_watches()] == ["configmaps"]
        lists_after = sum(1 for c in kube.api_calls() if (c.verb, c.resource) == ("list", "configmaps"))
        assert lists_after == lists_before + 1  # kopf listed again after the 410, as it must

        # And it keeps watching from there: a later change arrives as a plain watch event.
        await kube.patch(CONFIGMAPS, "default", "watched", {"data": {"v": "3"}})
        await kube.wait_for(lambda: kopf_side.saw("watched", {"v": "3"}), timeout=15, what="the next change")
        assert ("MODIFIED", "watched", {"v": "3"}) in kopf_side.seen


async def test_watch_streams_count_in_the_traffic(kube_manual: LocalApiServer) -> None:
    await kube_manual.create(deployment_manifest("web"))
    before = kube_manual.traffic.snapshot()
    received = 0
    async with aiohttp.ClientSession() as session:
        async with session.get(kube_manual.url + DEPLOYS, params={"watch": "true", "timeoutSeconds": "1"}) as rsp:
            async for line in rsp.content:
                received += len(line)
    served = kube_manual.traffic.since(before)
    assert served.requests == {("watch", "deployments"): 1}
    assert served.bytes_served == {("watch", "deployments"): received} and received > 500
