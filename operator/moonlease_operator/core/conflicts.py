"""Another writer reverting what the operator wrote (a GitOps tool re-applying its manifest every
few seconds: `kubectl replace`, Argo CD's `Replace=true`, a server-side apply that owns the
container's args): detected, backed off from, and said so. Pure.

Without this the two writers fight: every re-apply undoes the operator's change, the operator
puts it back, and each round is a rolling restart. A workload found *reverted* — out of sync
with the policy although its stage had been written (Progressing) or had finished (Succeeded,
Skipped) under the same configuration, and no write of it was refused — counts one revert of the
first field found changed. `reverts` of the same field in a row, each within the backoff of the
one before, and the operator stops writing that object for the backoff (`--conflict-backoff`,
doubled at each further backoff up to eight times), names the field and the field manager that
wrote it (`metadata.managedFields`, where the API server records it) in the `ConflictingWriter`
condition and a warning event, and leaves the object out (the rest of the policy carries on).
When the backoff is over it writes the object once more: if nothing reverts it within a backoff,
the conflict is over and forgotten; if something does, it backs off again, twice as long. So a
writer that never stops costs one rolling restart per backoff, not one every few seconds.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moonlease_operator.api import ConflictStatus
from moonlease_operator.core.slots import CONFIG_HASH_ANNOTATION

#: The field manager the operator's writes carry (`?fieldManager=`): never named as the conflicting writer.
FIELD_MANAGER = "moonlease-operator"
#: The conflicts a status keeps at most (those backing off first, then the latest).
MAX_RECORDS = 20
#: A backoff grows to at most this many times `ConflictSettings.backoff_seconds`.
MAX_BACKOFF_FACTOR = 8

WorkloadKey = tuple[str, str]


@dataclass(frozen=True)
class ConflictSettings:
    """`reverts`: reverts of one field in a row before the operator backs off (0: never);
    `backoff_seconds`: the first backoff, and how close two reverts must follow each other to
    count in a row (`--conflict-reverts`, `--conflict-backoff`)."""

    reverts: int = 3
    backoff_seconds: float = 300.0

    def __post_init__(self) -> None:
        if self.reverts < 0 or self.reverts == 1:
            raise ValueError(f"--conflict-reverts must be 0 (never back off) or 2 or more, not {self.reverts}")
        if not self.backoff_seconds > 0:
            raise ValueError(f"--conflict-backoff must be a positive number of seconds, not {self.backoff_seconds}")

    def backoff(self, backoffs: int) -> datetime.timedelta:
        """The length of the backoff taken after `backoffs` earlier ones in a row."""
        return datetime.timedelta(seconds=self.backoff_seconds * min(2 ** backoffs, MAX_BACKOFF_FACTOR))


@dataclass(frozen=True)
class Revert:
    """One object found reverted in this reconcile."""

    kind: str
    name: str
    field: str
    manager: str | None

    @property
    def key(self) -> WorkloadKey:
        return (self.kind, self.name)


@dataclass(frozen=True)
class ConflictDecision:
    """What `track_reverts` decided: the records to keep in the status, the objects to leave
    alone now (with why), and the events to post."""

    records: tuple[ConflictStatus, ...]
    held: Mapping[WorkloadKey, str] = field(default_factory=dict)
    started: tuple[ConflictStatus, ...] = ()
    """Records that began a backoff in this reconcile (each gets a warning event)."""
    retried: tuple[ConflictStatus, ...] = ()
    """Records whose backoff ended in this reconcile: the object is written once more."""


def field_path(kind: str, place: str | None, slot: str) -> str:
    """The Kubernetes field path of an owned slot (`core.slots`), as a person would look for it
    in the object: `spec.template.spec.volumes[name=moonlease-connector-settings]`."""
    what, _, key = slot.partition(":")
    if kind == "ConfigMap":
        return f"data[{place}]" + (f" ({key})" if what == "doc" else "")
    container = f"spec.template.spec.containers[name={place}]"
    match what:
        case "env":
            return f"{container}.env[name={key}]"
        case "flag":
            return f"{container}.args (--{key})"
        case "kv":
            return f"{container}.args (--kv-transfer-config {key})"
        case "volume":
            return f"spec.template.spec.volumes[name={key}]"
        case "mount":
            return f"{container}.volumeMounts[name={key}]"
    return f"spec.template.metadata.annotations[{CONFIG_HASH_ANNOTATION}]"


def _section(kind: str) -> tuple[str, ...]:
    """Where in `managedFields[].fieldsV1` the slots of `kind` live."""
    return ("f:data",) if kind == "ConfigMap" else ("f:spec", "f:template")


def last_writer(obj: Mapping[str, Any]) -> str | None:
    """The field manager other than the operator that last wrote the part of `obj` the
    operator writes (a workload's pod template, a ConfigMap's data), from
    `metadata.managedFields`: the latest entry (by time) whose fields cover it. None where the
    API server recorded no such entry."""
    section = _section(str(obj.get("kind")))
    best: tuple[str, str] | None = None
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if not isinstance(entry, Mapping) or entry.get("manager") in (None, "", FIELD_MANAGER):
            continue
        node: Any = entry.get("fieldsV1") or {}
        for step in section:
            node = node.get(step) if isinstance(node, Mapping) else None
        if node is None:
            continue
        when = str(entry.get("time") or "")
        if best is None or when >= best[0]:
            best = (when, str(entry["manager"]))
    return None if best is None else best[1]


def prune_managed_fields(entries: Any) -> list[dict[str, Any]]:
    """What the watch caches keep of `metadata.managedFields` (`core.kept_fields`): each
    entry's manager, operation and time, and of its fields only the two levels that say which
    part of the object it wrote (`f:spec` → `f:template`, `f:data`), enough for `last_writer`."""
    kept = []
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, Mapping):
            continue
        raw = entry.get("fieldsV1")
        fields: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        pruned: dict[str, dict[str, Any]] = {k: ({kk: {} for kk in v} if isinstance(v, Mapping) else {})
                                             for k, v in fields.items() if k in ("f:spec", "f:data")}
        kept.append({**{k: entry[k] for k in ("manager", "operation", "time") if k in entry}, "fieldsV1": pruned})
    return kept


def track_reverts(previous: Sequence[ConflictStatus], reverted: Iterable[Revert], *, now: datetime.datetime,
                  settings: ConflictSettings) -> ConflictDecision:
    """Count this reconcile's reverts against the records of the last status (see the module
    docstring). An object still backing off is held whether or not it was looked at."""
    if settings.reverts == 0:
        return ConflictDecision(records=())
    records = {(r.kind, r.name): r for r in previous}
    held: dict[WorkloadKey, str] = {}
    started: list[ConflictStatus] = []
    retried: list[ConflictStatus] = []
    seen: set[WorkloadKey] = set()
    for key, kept in records.items():
        if kept.backoff_until is not None and now < kept.backoff_until:
            held[key] = describe_conflict(kept)
    for revert in reverted:
        key = revert.key
        if key in held or key in seen:
            continue
        seen.add(key)
        found = records.get(key)
        if found is not None and found.backoff_until is not None:
            # The backoff is over: write once more, one revert short of the next backoff.
            record = found.model_copy(update={"backoff_until": None, "reverts": settings.reverts - 1,
                                               "field": revert.field[:1024], "manager": revert.manager,
                                               "last_reverted_at": now})
            retried.append(record)
        elif found is not None and found.field == revert.field[:1024] and \
                now - found.last_reverted_at <= settings.backoff(found.backoffs):
            record = found.model_copy(update={"reverts": found.reverts + 1, "manager": revert.manager,
                                              "last_reverted_at": now})
        else:
            record = ConflictStatus(kind=revert.kind, name=revert.name, field=revert.field[:1024],
                                    manager=revert.manager, reverts=1, last_reverted_at=now)
        if record.reverts >= settings.reverts:
            record = record.model_copy(update={"backoff_until": now + settings.backoff(record.backoffs),
                                               "backoffs": record.backoffs + 1})
            held[key] = describe_conflict(record)
            started.append(record)
        records[key] = record
    remaining = [r for key, r in records.items()
                 if key in held or key in seen or now - r.last_reverted_at <= settings.backoff(r.backoffs)]
    remaining.sort(key=lambda r: ((r.kind, r.name) not in held, -r.last_reverted_at.timestamp()))
    return ConflictDecision(records=tuple(remaining[:MAX_RECORDS]), held=held, started=tuple(started),
                            retried=tuple(retried))


def describe_conflict(record: ConflictStatus) -> str:
    """One line: what was reverted, by whom, how often, and until when the operator waits."""
    who = (f"field manager {record.manager!r}" if record.manager else
           "a writer the API server does not name (no metadata.managedFields)")
    until = "" if record.backoff_until is None else \
        f"; left alone until {record.backoff_until.strftime('%Y-%m-%dT%H:%M:%SZ')}, then written once more"
    return (f"{record.kind}/{record.name}: {record.field} reverted {record.reverts} times in a row by {who}"
            f"{until}")
