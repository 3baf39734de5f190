"""The pods one reconcile read, indexed by namespace and label, so that finding a workload's
pods costs what it finds (issue 16). Pure: a data structure, no I/O.

A verifying reconcile asks for the pods of every target (its health, then the Ready pods whose
connectors it checks). Scanning all the namespace's pods for each target is O(targets x pods):
for a policy over 100 targets in a namespace of 5,000 workloads, half a million selector matches
per reconcile. The index narrows each selector to its candidates (`LabelIndex.candidates`, the
same index the workload caches keep); every candidate is still matched by the selector itself,
so the index narrows the scan and never changes its answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from moonlease_operator.api import LabelSelector
from moonlease_operator.core.label_index import LabelIndex


class PodSet:
    """Pods by namespace and name, with a label index per namespace; iteration keeps the
    order the pods were given in."""

    def __init__(self, pods: Iterable[Mapping[str, Any]], index: LabelIndex | None = None) -> None:
        """`index`: a label index the caller already keeps of these pods (the pod cache's, of
        one namespace). Used only when it agrees with every pod given (same labels; the cache
        may have moved on since the pods were read); otherwise one is built here."""
        self._pods: list[Mapping[str, Any]] = list(pods)
        self._by_namespace: dict[str | None, dict[str, int]] = {}
        agrees = index is not None
        for position, pod in enumerate(self._pods):
            meta = pod.get("metadata") or {}
            namespace, name = meta.get("namespace"), str(meta.get("name", position))
            self._by_namespace.setdefault(namespace, {})[name] = position
            if agrees and index is not None and (index.labels_of(name) != (meta.get("labels") or {})
                           or len(self._by_namespace) > 1):
                agrees = False
        self._index: dict[str | None, LabelIndex] = {}
        for namespace, names in self._by_namespace.items():
            if agrees and index is not None:
                self._index[namespace] = index
                continue
            built = self._index[namespace] = LabelIndex()
            for name, position in names.items():
                built.put(name, (self._pods[position].get("metadata") or {}).get("labels") or {})

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        return iter(self._pods)

    def __len__(self) -> int:
        return len(self._pods)

    def selected(self, namespace: str | None, selector: LabelSelector) -> list[Mapping[str, Any]]:
        """The pods of `namespace` (and those naming no namespace, which count as in it) that
        `selector` selects, in the order given."""
        positions: list[int] = []
        for ns in {namespace, None}:
            names = self._by_namespace.get(ns)
            if not names:
                continue
            candidates = self._index[ns].candidates(selector)
            chosen = names if candidates is None else {n: names[n] for n in candidates if n in names}
            positions += [p for p in chosen.values()
                          if selector.matches((self._pods[p].get("metadata") or {}).get("labels") or {})]
        return [self._pods[p] for p in sorted(positions)]
