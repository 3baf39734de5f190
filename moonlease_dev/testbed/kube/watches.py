"""Watch semantics: the recent history of changes per resource type (the API server's watch
cache), open watches with their filters, and what a watch resumed from a resourceVersion gets.

- Every write appends an event `(resourceVersion, type, object, previous object)` to its
  type's history, which keeps the last `capacity` events. A watch from resourceVersion R gets
  the events after R from the history, then live ones; if events after R were already
  forgotten (capacity, or `compact()` — etcd's compaction), it gets `410 Gone` (an `ERROR`
  event with reason `Expired`), and the client must list again.
- A watch with a label or field selector sees an object that starts matching as `ADDED` and one
  that stops matching as `DELETED`, as the real watch cache sends them.
- `close_all()` ends the open watches (as an API server restart or a load balancer would);
  clients resume from their last resourceVersion.

Not pure (asyncio queues), but free of HTTP: the emulator feeds it and serves what it returns.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kmock

from moonlease_dev.testbed.kube.selectors import FieldTerm, SelectorTerm, match_field_selector, match_label_selector

JsonObj = dict[str, Any]

#: Events each resource type's history keeps (the real watch cache keeps 100 at least and grows
#: with load; what matters here is that it is finite).
DEFAULT_WATCH_HISTORY = 1000


@dataclass(frozen=True)
class Change:
    """One write as the watch cache remembers it."""

    revision: int
    type: str  # ADDED, MODIFIED, DELETED
    obj: JsonObj
    previous: JsonObj | None  # the object before a MODIFIED, for selector transitions


@dataclass(frozen=True)
class WatchFilter:
    """What one watch asked for: a namespace, a name (a watch on one object), selectors."""

    namespace: str | None
    name: str | None = None
    labels: Sequence[SelectorTerm] = ()
    fields: Sequence[FieldTerm] = ()

    def matches(self, obj: Mapping[str, Any] | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata", {})
        return ((self.namespace is None or meta.get("namespace") == self.namespace)
                and (self.name is None or meta.get("name") == self.name)
                and match_label_selector(self.labels, meta.get("labels") or {})
                and match_field_selector(self.fields, obj))

    def event_for(self, change: Change) -> JsonObj | None:
        """The event this watch gets for a change, if any (selector transitions included)."""
        now = self.matches(change.obj)
        if change.type != "MODIFIED":
            return {"type": change.type, "object": change.obj} if now else None
        before = self.matches(change.previous)
        if now and before:
            return {"type": "MODIFIED", "object": change.obj}
        if now:
            return {"type": "ADDED", "object": change.obj}
        if before:
            return {"type": "DELETED", "object": change.obj}
        return None


@dataclass(eq=False)
class OpenWatch:
    """One open watch stream: its filter and the queue of events not yet written (None ends it)."""

    ref: kmock.resource
    filter: WatchFilter
    queue: asyncio.Queue[JsonObj | None] = field(default_factory=asyncio.Queue)


class WatchCache:
    """Histories per resource type, the compaction horizon, and the open watches."""

    def __init__(self, capacity: int = DEFAULT_WATCH_HISTORY) -> None:
        self.capacity = capacity
        self._history: dict[kmock.resource, collections.deque[Change]] = {}
        self._forgotten: dict[kmock.resource, int] = {}  # per type: newest revision no longer replayable
        self._compacted = 0  # compact(): everything at or below is forgotten, for every type
        self._open: set[OpenWatch] = set()
        #: resourceVersions that watches asked for and got 410 Gone, oldest first.
        self.expired: list[tuple[kmock.resource, int]] = []

    def horizon(self, ref: kmock.resource) -> int:
        """Watches from a resourceVersion below this get 410 Gone."""
        return max(self._compacted, self._forgotten.get(ref, 0))

    def record(self, ref: kmock.resource, change: Change) -> None:
        """Remember a write and hand it to every open watch of its type that it concerns.
        Synchronous: nothing else runs between the write and its delivery to the queues.
        Not copied: the emulator never changes a stored version in place (every write stores a
        new one), and what reads a change only serialises it; two deep copies per write were
        most of the cost of a write at fleet scale."""
        history = self._history.setdefault(ref, collections.deque())
        history.append(change)
        while len(history) > self.capacity:
            self._forgotten[ref] = history.popleft().revision
        for watch in self._open:
            if watch.ref == ref and (event := watch.filter.event_for(change)) is not None:
                watch.queue.put_nowait(event)

    def replay(self, ref: kmock.resource, since: int, watch_filter: WatchFilter) -> list[JsonObj] | None:
        """The events after `since` a new watch gets first, or None when they are forgotten."""
        if since < self.horizon(ref):
            self.expired.append((ref, since))
            return None
        return [event for change in self._history.get(ref, ()) if change.revision > since
                if (event := watch_filter.event_for(change)) is not None]

    def open(self, ref: kmock.resource, watch_filter: WatchFilter) -> OpenWatch:
        watch = OpenWatch(ref, watch_filter)
        self._open.add(watch)
        return watch

    def close(self, watch: OpenWatch) -> None:
        self._open.discard(watch)

    def close_all(self, ref: kmock.resource | None = None) -> int:
        """End the open watches (of one type, or all); returns how many were open."""
        closing = [w for w in self._open if ref is None or w.ref == ref]
        for watch in closing:
            self._open.discard(watch)
            watch.queue.put_nowait(None)
        return len(closing)

    @property
    def open_count(self) -> int:
        return len(self._open)

    def open_count_of(self, ref: kmock.resource) -> int:
        return sum(1 for watch in self._open if watch.ref == ref)

    def compact(self, revision: int) -> None:
        """Forget every change at or below `revision` (etcd compaction)."""
        self._compacted = max(self._compacted, revision)
        for history in self._history.values():
            while history and history[0].revision <= revision:
                history.popleft()
