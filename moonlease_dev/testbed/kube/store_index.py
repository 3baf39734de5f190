"""Indexes over the emulator's object store, so that no request scans every stored object.

Pure bookkeeping (no kmock, no I/O): the emulator calls `record` with every write it publishes
(the same place the watch cache learns of it), and asks for

- `keys(ref, namespace)`: every key of a type (and namespace) ever stored, live or deleted, in
  first-creation order — what a LIST at an older resourceVersion (a `continue` page) walks;
- `live_keys(ref, namespace, terms)`: the live keys a label selector can match, narrowed through
  the `key=value` / `key in (...)` terms (a superset: the caller still matches every term), in
  first-creation order — what a LIST or a watch's initial listing walks;
- `owned_by(uid)`: the live keys whose ownerReferences name `uid` — cascading deletion and the
  simulated controllers' pods.

At 5,000 Deployments with their pods, scanning the whole store per request cost the test bed
seconds per request (issue 16, `benchmarks/results/testbed_cost.md`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from moonlease_dev.testbed.kube.selectors import SelectorTerm

Key = tuple[Any, str | None, str]  # (resource reference, namespace or None, name)


class StoreIndex:
    """Keys by type and namespace, live keys by label, live keys by owner uid."""

    def __init__(self) -> None:
        self._order: dict[Key, int] = {}  # first-creation sequence of every key ever stored
        self._by_type: dict[Hashable, dict[Key, None]] = {}
        self._by_namespace: dict[tuple[Hashable, str | None], dict[Key, None]] = {}
        self._live: dict[Key, tuple[dict[str, str], frozenset[str]]] = {}  # labels, owner uids
        self._live_by_type: dict[Hashable, set[Key]] = {}
        self._live_by_namespace: dict[tuple[Hashable, str | None], set[Key]] = {}
        self._by_label: dict[tuple[Hashable, str, str], set[Key]] = {}
        self._by_owner: dict[str, set[Key]] = {}

    def record(self, key: Key, obj: Mapping[str, Any] | None) -> None:
        """The object at `key` is now `obj` (None: deleted)."""
        ref, namespace, _ = key
        if key not in self._order:
            self._order[key] = len(self._order)
            self._by_type.setdefault(ref, {})[key] = None
            self._by_namespace.setdefault((ref, namespace), {})[key] = None
        self._forget_live(key)
        if obj is None:
            return
        meta = obj.get("metadata") or {}
        labels = dict(meta.get("labels") or {})
        owners = frozenset(str(o.get("uid", "")) for o in meta.get("ownerReferences") or [] if o.get("uid"))
        self._live[key] = (labels, owners)
        self._live_by_type.setdefault(ref, set()).add(key)
        self._live_by_namespace.setdefault((ref, namespace), set()).add(key)
        for label, value in labels.items():
            self._by_label.setdefault((ref, label, str(value)), set()).add(key)
        for uid in owners:
            self._by_owner.setdefault(uid, set()).add(key)

    def _forget_live(self, key: Key) -> None:
        known = self._live.pop(key, None)
        if known is None:
            return
        ref, namespace, _ = key
        labels, owners = known
        self._live_by_type[ref].discard(key)
        self._live_by_namespace[(ref, namespace)].discard(key)
        for label, value in labels.items():
            self._discard(self._by_label, (ref, label, str(value)), key)
        for uid in owners:
            self._discard(self._by_owner, uid, key)

    @staticmethod
    def _discard(index: dict[Any, set[Key]], slot: Any, key: Key) -> None:
        keys = index.get(slot)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del index[slot]

    def keys(self, ref: Hashable, namespace: str | None = None) -> Iterable[Key]:
        """Every key of the type (in one namespace, if given) ever stored, creation order."""
        if namespace is None:
            return list(self._by_type.get(ref, {}))
        return list(self._by_namespace.get((ref, namespace), {}))

    def live_keys(self, ref: Hashable, namespace: str | None = None,
                  terms: Iterable[SelectorTerm] = ()) -> list[Key]:
        """Live keys that may match: narrowed by namespace and by the selector's equality and
        set-membership terms; creation order."""
        pool: set[Key] = (self._live_by_type.get(ref, set()) if namespace is None
                          else self._live_by_namespace.get((ref, namespace), set()))
        for term in terms:
            if term.op not in ("=", "in"):
                continue  # !=, notin, exists, !exists: matched by the caller
            matching: set[Key] = set()
            for value in term.values:
                matching |= self._by_label.get((ref, term.key, value), set())
            pool = pool & matching if len(matching) < len(pool) else matching & pool
            if not pool:
                break
        return sorted(pool, key=self._order.__getitem__)

    def owned_by(self, uid: str) -> list[Key]:
        """Live keys whose ownerReferences name `uid`, creation order."""
        return sorted(self._by_owner.get(uid, set()), key=self._order.__getitem__)

    def labels(self, key: Key) -> Mapping[str, str] | None:
        """The live object's labels as last recorded (None: not live)."""
        known = self._live.get(key)
        return None if known is None else known[0]
