"""Watch-backed caches of the objects the operator reads (issue 16). Not pure.

One `ObjectCache` per kind (and label selector): it LISTs once — paginated, label-selected
where a selector applies — then WATCHes from the list's resourceVersion with bookmarks, and
resumes from the last resourceVersion it saw when a stream ends. A watch answered `410 Gone`
(the server forgot that far back) lists again and compares: every object that changed or
vanished meanwhile is reported like a watch event, so nothing is missed. Reconciles read these
caches instead of the API server; at rest the operator sends no request but its open watches.

Objects are kept trimmed to what the planner reads (`core.kept_fields.trim_object`): without
`metadata.managedFields`, kubectl's last-applied annotation, and (workloads, pods) the container
fields and env vars the planner never reads — most of a real object's size. A listing is
trimmed page by page, as it arrives. `on_change(kind, old, new)` is called for every change
after the first listing (the caller maps it to the policies it concerns and wakes them). A cache made with `indexed=True`
also keeps a label index per namespace (`core.label_index`), current with every change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from moonlease_operator.adapters.kube import ApiError, KubeClient
from moonlease_operator.core.kept_fields import LAST_APPLIED, trim_object
from moonlease_operator.core.label_index import LabelIndex

__all__ = ["LAST_APPLIED", "ObjectCache", "collection_path", "is_older", "trim_object"]

logger = logging.getLogger(__name__)

JsonObj = dict[str, Any]
Key = tuple[str, str]  # (namespace, name)
OnChange = Callable[[str, JsonObj | None, JsonObj | None], None]

_COLLECTIONS: Mapping[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Pod": ("/api/v1", "pods"),
}


def collection_path(kind: str, namespace: str | None) -> str:
    """The collection URL of `kind` in `namespace`, or across the cluster (None)."""
    prefix, plural = _COLLECTIONS[kind]
    return f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"


class ObjectCache:
    """The objects of one kind in the served namespaces (all of them: `namespaces` empty),
    optionally only those matching `label_selector`, kept current by a watch."""

    def __init__(self, client: Callable[[], KubeClient], kind: str, namespaces: Sequence[str] = (), *,
                 label_selector: str | None = None, on_change: OnChange | None = None,
                 watch_timeout: float = 300.0, error_delay: float = 1.0, page_size: int = 500,
                 on_unauthorized: Callable[[], Awaitable[None]] | None = None, indexed: bool = False) -> None:
        self.kind, self.label_selector = kind, label_selector
        self._client, self._scopes = client, tuple(namespaces) or (None,)
        self._on_change, self._on_unauthorized = on_change, on_unauthorized
        self._watch_timeout, self._error_delay, self._page_size = watch_timeout, error_delay, page_size
        self._objects: dict[str | None, dict[str, dict[str, JsonObj]]] = {scope: {} for scope in self._scopes}
        self._synced: dict[str | None, asyncio.Event] = {scope: asyncio.Event() for scope in self._scopes}
        self._tasks: list[asyncio.Task[None]] = []
        self._indexes: dict[str, LabelIndex] | None = {} if indexed else None
        self.relists = 0
        """Listings after the first one (a watch answered 410 Gone)."""

    # ---- reading ----------------------------------------------------------------------------

    def in_namespace(self, namespace: str) -> dict[str, JsonObj]:
        """name -> object, of one namespace (a live view: do not change it)."""
        scope = namespace if namespace in self._objects else None
        return self._objects.get(scope, {}).get(namespace, {})

    def get(self, namespace: str, name: str) -> JsonObj | None:
        return self.in_namespace(namespace).get(name)

    def index(self, namespace: str) -> LabelIndex | None:
        """The label index of one namespace (a live view: do not change it); None unless `indexed`."""
        if self._indexes is None:
            return None
        return self._indexes.setdefault(namespace, LabelIndex())

    @property
    def synced(self) -> bool:
        return all(event.is_set() for event in self._synced.values())

    # ---- running ----------------------------------------------------------------------------

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._run(scope), name=f"moonlease-watch-{self.kind}-{scope or 'all'}")
                           for scope in self._scopes]

    async def wait_synced(self) -> None:
        """Until the first listing of every namespace arrived."""
        await asyncio.gather(*(event.wait() for event in self._synced.values()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    async def _run(self, scope: str | None) -> None:
        version: str | None = None
        while True:
            try:
                if version is None:
                    version = await self._relist(scope)
                version = await self._watch(scope, version)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an outage: resume from where we were, a little later
                if isinstance(exc, ApiError) and exc.status == 410:
                    version = None
                if isinstance(exc, ApiError) and exc.status == 401 and self._on_unauthorized is not None:
                    await self._on_unauthorized()  # a rotated token: log in again
                logger.warning("Watching %s (%s) failed, resuming in %ss: %s", self.kind, scope or "all namespaces",
                               self._error_delay, exc)
                await asyncio.sleep(self._error_delay)

    async def _relist(self, scope: str | None) -> str | None:
        """List (paginated) and replace the scope's objects, reporting what changed since the
        last listing or watch event (nothing on the first listing)."""
        first = not self._synced[scope].is_set()
        if not first:
            self.relists += 1
        items, version = await self._client().list_with_version(
            collection_path(self.kind, scope), label_selector=self.label_selector, page_size=self._page_size,
            keep=lambda item: trim_object(item, self.kind))
        fresh: dict[str, dict[str, JsonObj]] = {}
        for obj in items:
            meta = obj["metadata"]
            fresh.setdefault(meta.get("namespace", scope or ""), {})[meta["name"]] = obj
        old = self._objects[scope]
        self._objects[scope] = fresh
        if self._indexes is not None:
            for namespace in set(old) | set(fresh):
                index = self._indexes[namespace] = LabelIndex()
                for name, obj in fresh.get(namespace, {}).items():
                    index.put(name, _labels(obj))
        if not first and self._on_change is not None:
            for namespace in set(old) | set(fresh):
                before, after = old.get(namespace, {}), fresh.get(namespace, {})
                for name in set(before) | set(after):
                    was, now = before.get(name), after.get(name)
                    if was is None or now is None or _version(was) != _version(now):
                        self._on_change(self.kind, was, now)
        self._synced[scope].set()
        return version

    async def _watch(self, scope: str | None, version: str | None) -> str | None:
        """Follow one watch stream; returns the resourceVersion to resume from (None: list again)."""
        params = {"allowWatchBookmarks": "true", "timeoutSeconds": str(int(self._watch_timeout))}
        if version:
            params["resourceVersion"] = version
        if self.label_selector:
            params["labelSelector"] = self.label_selector
        async for event in self._client().watch(collection_path(self.kind, scope), params,
                                                read_timeout=self._watch_timeout + 30):
            kind, raw = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if raw.get("code") == 410:
                    return None  # 410 Gone: list again (and report what changed meanwhile)
                raise ApiError(int(raw.get("code") or 0), str(raw.get("reason") or "Error"), str(raw.get("message")))
            version = ((raw.get("metadata") or {}).get("resourceVersion")) or version
            if kind == "BOOKMARK":
                continue
            self._apply(scope, kind, raw)
        return version

    def record_written(self, raw: JsonObj) -> None:
        """An object as the API server answered our own write: kept now (the watch event of
        that write follows with the same resourceVersion). No change is reported: the writer
        knows."""
        meta = raw.get("metadata") or {}
        namespace = meta.get("namespace", "")
        scope = namespace if namespace in self._objects else None
        if scope in self._objects and _matches(raw, self.label_selector):
            objects = self._objects[scope].setdefault(namespace, {})
            if not is_older(raw, objects.get(meta.get("name", ""))):
                objects[meta["name"]] = trim_object(raw, self.kind)
                self._index_put(namespace, meta["name"], objects[meta["name"]])

    def _apply(self, scope: str | None, kind: str | None, raw: JsonObj) -> None:
        obj = trim_object(raw, self.kind)
        meta = obj["metadata"]
        namespace, name = meta.get("namespace", scope or ""), meta["name"]
        objects = self._objects[scope].setdefault(namespace, {})
        old = objects.get(name)
        if kind != "DELETED" and is_older(obj, old):
            return  # our own write's answer got here first: this event is older still
        if kind == "DELETED":
            objects.pop(name, None)
            new = None
            if (index := self.index(namespace)) is not None:
                index.remove(name)
        else:
            objects[name] = obj
            new = obj
            self._index_put(namespace, name, obj)
        if self._on_change is not None:
            self._on_change(self.kind, old, new)


    def _index_put(self, namespace: str, name: str, obj: JsonObj) -> None:
        if (index := self.index(namespace)) is not None:
            index.put(name, _labels(obj))


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _version(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("resourceVersion")


def is_older(obj: Mapping[str, Any], than: Mapping[str, Any] | None) -> bool:
    """Whether `obj` is an older version than `than`. resourceVersions are opaque to clients;
    where both are decimal (etcd's revisions, the local API server's) a lower one is older,
    otherwise nothing is taken as older."""
    if than is None:
        return False
    mine, theirs = _version(obj) or "", _version(than) or ""
    return mine.isdigit() and theirs.isdigit() and int(mine) < int(theirs)


def _matches(obj: Mapping[str, Any], selector: str | None) -> bool:
    """Whether the object matches a cache's selector (only the `key` and `key=value` forms the
    operator uses)."""
    if not selector:
        return True
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in selector.split(","):
        key, _, value = term.partition("=")
        if key not in labels or (value and labels[key] != value):
            return False
    return True
