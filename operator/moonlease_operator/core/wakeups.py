"""When a policy reconciles (issue 16): which policies a watch event concerns, and how long a
policy rests when nothing wakes it. Pure.

The operator watches the workloads, their settings ConfigMaps and (while a stage is verified)
pods; each change wakes only the policies it concerns (`policies_concerned`). A policy's own
status write wakes nobody (`wakes_on_policy_change`): only what a person or another controller
changed does. Between events a policy rests: `reconcile_interval` while a stage is verified
(what the connectors report comes over HTTP, which no watch announces; a stage's timeout
counts), until its next A/B measurement, otherwise `resync_interval` (a safety net).
"""

from __future__ import annotations

import datetime

from collections.abc import Iterable, Mapping
from typing import Any

from moonlease_operator.api import Phase, PolicySpec, PolicyStatus, StagePhase
from moonlease_operator.core.connector_delivery import settings_config_map_name
from moonlease_operator.core.fleet import WorkloadIndex, WorkloadKey, managed_keys, resolve_fleet
from moonlease_operator.core.slots import managed_by, policy_label_value

_VERIFYING_STAGES = (StagePhase.PROGRESSING, StagePhase.ROLLING_BACK)
_MOVING = (Phase.PROGRESSING, Phase.ROLLING_BACK)


def policies_concerned(kind: str, objects: Iterable[Mapping[str, Any] | None],
                       specs: Mapping[str, PolicySpec | None]) -> set[str]:
    """The policies (by name, of the objects' namespace) that one change of a workload or
    ConfigMap concerns. `objects`: the object before and after the change (either may be None);
    for a ConfigMap also the workload its name makes it the settings file of, if any.
    `specs`: each policy's parsed spec (None: invalid, it covers only what carries its label).

    A policy is concerned when it names the object (master, named target, master ConfigMap,
    a target's settings ConfigMap), when one of its selectors matches the object's labels before
    or after (joining and leaving both matter), or when the object carries its label."""
    present = [o for o in objects if o is not None]
    concerned: set[str] = set()
    for name, spec in specs.items():
        label = policy_label_value(name)
        if any(managed_by(o) == label for o in present):
            concerned.add(name)
            continue
        if spec is not None and any(_covers(spec, o.get("kind") or kind, o) for o in present):
            concerned.add(name)
    return concerned


def _covers(spec: PolicySpec, kind: str, obj: Mapping[str, Any]) -> bool:
    name = (obj.get("metadata") or {}).get("name", "")
    if kind == "ConfigMap":
        if spec.master.config_map is not None and spec.master.config_map.name == name:
            return True
        return any(t.name is not None and settings_config_map_name(t.name) == name for t in spec.targets)
    # The same membership rule the planner uses (`resolve_fleet`), asked about this one object.
    key = (kind, name)
    return key in resolve_fleet(spec, {key: obj}).keys


def policies_sharing_workloads(name: str, versions: Iterable[PolicySpec | None], specs: Mapping[str, PolicySpec | None],
                               workloads: Mapping[WorkloadKey, Mapping[str, Any]],
                               index: WorkloadIndex | None = None) -> set[str]:
    """The other policies of the namespace (by name) that a creation, spec edit or deletion of
    policy `name` concerns: their claims on shared workloads may change (`core.fleet.evaluate_claims`
    looks only at a policy's own workloads, and who else covers or labels them). `versions`: the
    policy's parsed spec before and after (None: absent or invalid). `specs`: the others'.

    A policy is concerned when it covers a workload that `name` covered before or after the
    change, or that carries `name`'s label. The others are not: waking every policy of the
    namespace on each edit made one edit cost a full reconcile of every policy (issue 16)."""
    shared: set[WorkloadKey] = set(managed_keys(policy_label_value(name), workloads, index))
    for spec in versions:
        if spec is not None:
            shared |= resolve_fleet(spec, workloads, index).keys
    if not shared:
        return set()
    return {other for other, spec in specs.items()
            if other != name and spec is not None and not shared.isdisjoint(resolve_fleet(spec, workloads, index).keys)}


def settings_owner(config_map_name: str) -> str | None:
    """The workload whose settings file a ConfigMap of this name is (`<workload>-moonlease`)."""
    suffix = settings_config_map_name("")
    if config_map_name.endswith(suffix) and len(config_map_name) > len(suffix):
        return config_map_name[: -len(suffix)]
    return None


def is_verifying(status: PolicyStatus | Mapping[str, Any]) -> bool:
    """A stage (or its rollback) waits for the workloads' pods: pod changes matter now.
    Takes the model or the raw status (read on every pod event: no parsing)."""
    if isinstance(status, PolicyStatus):
        return any(s.phase in _VERIFYING_STAGES for s in status.stages)
    phases = {p.value for p in _VERIFYING_STAGES}
    return any((s or {}).get("phase") in phases for s in status.get("stages") or [])


def wakes_on_policy_change(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> bool:
    """Whether a change of the policy object calls for a reconcile: its creation or deletion, a
    spec edit (generation), labels or annotations (approvals, verbs, decisions) — not a status
    write, which is the operator's own (or kopf's finalizer bookkeeping, also in metadata)."""
    if old is None or new is None:
        return True
    before, after = old.get("metadata") or {}, new.get("metadata") or {}
    return any(before.get(field) != after.get(field)
               for field in ("generation", "annotations", "labels", "deletionTimestamp"))


def seconds_until_next_reconcile(status: PolicyStatus, *, ab_due_in: float | None, reconcile_interval: float,
                                 resync_interval: float, now: datetime.datetime | None = None) -> float:
    """How long a policy rests after a reconcile unless an event wakes it (see the module doc);
    with `now`, no longer than until the end of a backoff from a conflicting writer
    (`core.conflicts`: the object is written once more then, which no event announces)."""
    moving = is_verifying(status) or status.phase in _MOVING
    delay = reconcile_interval if moving and status.paused_at is None else resync_interval
    if ab_due_in is not None:
        delay = min(delay, ab_due_in)
    if now is not None:
        ends = [(c.backoff_until - now).total_seconds() for c in status.conflicts if c.backoff_until is not None]
        if ends:
            delay = min(delay, max(0.0, min(ends)) + 0.1)
    return delay

