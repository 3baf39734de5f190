"""Kubernetes I/O of the rollout: read what the planner needs, write what it decided. Not pure.

`fetch_observed` lists what it may list (one LIST per kind): policies, Deployments and
StatefulSets of the namespace, and the namespace's pods only while a stage is being verified.
ConfigMaps are read by name, concurrently (least privilege: `get`, never `list`, on
ConfigMaps): the master's when it has one and the settings ConfigMap of each vLLM workload of
the policy.

`apply_change` writes one `WorkloadChange`: it asks the pure `build_update` for the new object,
sends the difference guarded by the object's resourceVersion — a strategic merge patch for
Deployments and StatefulSets (element by element: the cached copy it starts from is trimmed,
`core.kept_fields`), a JSON merge patch for ConfigMaps — and on a 409
reads the object again and asks again (never re-sending a stale decision). Retried writes are
idempotent because `build_update` is.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moonlease_operator.adapters.kube import ApiError, KubeClient
from moonlease_operator.api import API_VERSION, GROUP, KIND, PLURAL, VERSION, PolicyStatus
from moonlease_operator.core.status import dump_status
from moonlease_operator.core.changes import WorkloadChange
from moonlease_operator.core.merge_patches import build_merge_patch, build_strategic_merge_patch
from moonlease_operator.core.slots import build_update
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.fleet import WORKLOAD_KINDS
from moonlease_operator.core.rollout import (
    FetchPlan,
    Observed,
    settings_config_maps_to_read,
)
from moonlease_operator.core.write_failures import WriteFailure

_PREFIXES: Mapping[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Pod": ("/api/v1", "pods"),
    "Event": ("/api/v1", "events"),
    KIND: (f"/apis/{GROUP}/{VERSION}", PLURAL),
}
CONFLICT_ATTEMPTS = 8


def object_path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    prefix, plural = _PREFIXES[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name is not None:
        path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
    return path


async def fetch_observed(client: KubeClient, namespace: str, plan: FetchPlan, *,
                         policies: list[dict[str, Any]] | None = None) -> Observed:
    """Everything `plan_reconcile` looks at, in a handful of requests (see the module doc);
    `policies`: the namespace's policies when the caller has just listed them."""
    kinds = WORKLOAD_KINDS if policies is not None else (KIND, *WORKLOAD_KINDS)
    lists = [client.list(object_path(kind, namespace)) for kind in kinds]
    if plan.pods:
        lists.append(client.list(object_path("Pod", namespace)))
    answers = list(await asyncio.gather(*lists))
    if policies is None:
        policies = answers.pop(0)
    workloads = {(kind, obj["metadata"]["name"]): _with_kind(obj, kind)
                 for kind, items in zip(WORKLOAD_KINDS, answers, strict=False) for obj in items}
    names = (*plan.config_maps, *(settings_config_maps_to_read(plan.spec, workloads) if plan.spec else ()))
    config_maps = await fetch_config_maps(client, namespace, names)
    pods = answers[len(WORKLOAD_KINDS)] if plan.pods else None
    return Observed(workloads=workloads, config_maps=config_maps, policies=policies, pods=pods)


async def fetch_config_maps(client: KubeClient, namespace: str, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The named ConfigMaps that exist, read concurrently by name (a missing one is left out)."""
    unique = list(dict.fromkeys(names))

    async def one(name: str) -> dict[str, Any] | None:
        try:
            return _with_kind(await client.get(object_path("ConfigMap", namespace, name)), "ConfigMap")
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    found = await asyncio.gather(*(one(name) for name in unique))
    return {name: obj for name, obj in zip(unique, found, strict=True) if obj is not None}


def _with_kind(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    # List items carry no kind on every server (kmock's don't); the planner reads it.
    obj.setdefault("kind", kind)
    return obj


@dataclass
class ApplyReport:
    """What a batch of changes did: patched objects, vanished ones, conflicts met on the way."""

    patched: int = 0
    unchanged: int = 0
    vanished: int = 0
    conflicts: int = 0
    failures: list[WriteFailure] = field(default_factory=list)
    """Changes the API server refused (a 4xx other than 404/409): reported, never retried blindly."""
    written: list[dict[str, Any]] = field(default_factory=list)
    """The objects as the API server answered the writes (the caller's caches take them before
    the watch events arrive, so that the next plan does not start from what was just replaced)."""


async def apply_change(client: KubeClient, namespace: str, change: WorkloadChange,
                       current: Mapping[str, Any] | None, report: ApplyReport) -> None:
    """Write one change, re-reading and re-deciding on 409 (see the module docstring)."""
    path = object_path(change.kind, namespace, change.name)
    obj = current
    if obj is None and change.create_from is not None:
        # Not in the caller's view (the caches hold every settings ConfigMap the operator made):
        # create it at once instead of reading first; one that exists after all answers 409 and
        # is read and changed below. Saves a GET per workload on its first rollout.
        if (created := await _create(client, namespace, change)) is not None:
            report.patched += 1
            if created:
                report.written.append(_with_kind(created, change.kind))
            return
    for _ in range(CONFLICT_ATTEMPTS):
        if obj is None:
            try:
                obj = _with_kind(await client.get(path), change.kind)
            except ApiError as exc:
                if not exc.not_found:
                    raise
                if change.create_from is None:
                    report.vanished += 1
                    return
                if (created := await _create(client, namespace, change)) is not None:
                    report.patched += 1
                    if created:
                        report.written.append(_with_kind(created, change.kind))
                    return
                continue  # created by someone else meanwhile: read it and change it
        new = build_update(obj, change)
        if new is None:
            report.unchanged += 1
            return
        strategic = change.kind in WORKLOAD_KINDS
        patch = (build_strategic_merge_patch if strategic else build_merge_patch)(obj, new)
        patch.setdefault("metadata", {})["resourceVersion"] = obj["metadata"]["resourceVersion"]
        try:
            answer = await (client.strategic_merge_patch if strategic else client.merge_patch)(path, patch)
        except ApiError as exc:
            if exc.not_found:
                report.vanished += 1
                return
            if not exc.conflict:
                raise
            report.conflicts += 1
            obj = None  # someone else wrote it: read again, decide again
            continue
        report.patched += 1
        if isinstance(answer, dict):
            report.written.append(_with_kind(answer, change.kind))
        return
    raise ApiError(409, "Conflict", f"{change.kind}/{change.name}: still conflicting after {CONFLICT_ATTEMPTS} tries")


async def _create(client: KubeClient, namespace: str, change: WorkloadChange) -> dict[str, Any] | None:
    """Create the object a change needs, already changed: the server's answer ({} if none);
    None if it exists after all (409)."""
    assert change.create_from is not None
    new = build_update(change.create_from, change) or dict(change.create_from)
    try:
        answer = await client.create(object_path(change.kind, namespace), new)
    except ApiError as exc:
        if exc.conflict or exc.status == 409:
            return None
        raise
    return answer if isinstance(answer, dict) else {}


async def apply_changes(client: KubeClient, namespace: str, changes: Sequence[WorkloadChange],
                        lookup: Callable[[WorkloadChange], Mapping[str, Any] | None], *,
                        concurrency: int = 8) -> ApplyReport:
    """Apply the planner's changes: the ConfigMaps first (a master's file before its restart),
    then the workloads; each group up to `concurrency` at a time. The first error is raised after
    the rest of its group ran (a ConfigMap's error before any workload is written)."""
    report = ApplyReport()
    refused_maps = set()
    gate = asyncio.Semaphore(concurrency)

    async def one_map(change: WorkloadChange) -> None:
        async with gate:
            if not await _apply_or_record(client, namespace, change, lookup(change), report):
                refused_maps.add(change.name)

    results = await asyncio.gather(*(one_map(c) for c in changes if c.kind == "ConfigMap"), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]

    async def one(change: WorkloadChange) -> None:
        if refused_maps and change.require_annotation:
            return  # a master restart without the config file it was meant to read
        async with gate:
            await _apply_or_record(client, namespace, change, lookup(change), report)

    results = await asyncio.gather(*(one(c) for c in changes if c.kind != "ConfigMap"), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    return report


async def _apply_or_record(client: KubeClient, namespace: str, change: WorkloadChange,
                           current: Mapping[str, Any] | None, report: ApplyReport) -> bool:
    """`apply_change`, with a refusal (4xx) recorded in the report instead of raised."""
    try:
        await apply_change(client, namespace, change, current, report)
    except ApiError as exc:
        if not 400 <= exc.status < 500 or exc.status in (401, 404, 409):
            raise
        report.failures.append(WriteFailure(change.kind, change.name, exc.status, exc.reason, exc.message))
        return False
    return True


async def apply_status(client: KubeClient, namespace: str, name: str, status: PolicyStatus,
                       resource_version: str | None) -> str | None:
    """Merge-patch the policy's status subresource with the whole status (stale fields nulled),
    guarded by the resourceVersion the plan was made from: a 409 means another writer (a second
    replica, a spec edit) got there first, and the caller re-reads and re-plans. Returns the new
    resourceVersion."""
    patch: dict[str, Any] = {"status": dump_status(status)}
    if resource_version is not None:
        patch["metadata"] = {"resourceVersion": resource_version}
    answer = await client.merge_patch(object_path(KIND, namespace, name, "status"), patch)
    return ((answer or {}).get("metadata") or {}).get("resourceVersion")


async def post_event(client: KubeClient, policy: Mapping[str, Any], note: EventNote, *,
                     component: str, now: datetime.datetime) -> None:
    """A core/v1 Event about the policy (posted synchronously: it must precede what it announces)."""
    meta = policy.get("metadata") or {}
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta.get('name', 'policy')}.", "namespace": meta.get("namespace")},
        "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta.get("name"),
                           "namespace": meta.get("namespace"), "uid": meta.get("uid"),
                           "resourceVersion": meta.get("resourceVersion")},
        "type": note.type, "reason": note.reason, "message": note.message[:1024],
        "source": {"component": component}, "reportingComponent": component, "reportingInstance": component,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }
    await client.create(object_path("Event", meta.get("namespace") or "default"), body)
