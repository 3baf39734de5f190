"""Patches that turn an object as read into the object as wanted. Pure.

`adapters.workloads` sends them with a resourceVersion precondition: an RFC 7386 merge patch
(ConfigMaps, our metadata) or, for pod templates, a strategic merge patch that names list
elements by their merge key, so what the watch cache trimmed (`core.kept_fields`) is never
mentioned and stays on the server.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any, TypeGuard

from moonlease_operator.core.changes import JsonObj

_MISSING = object()


def build_merge_patch(old: Mapping[str, Any], new: Mapping[str, Any],
                      merge_keys: Mapping[str, str] | None = None) -> JsonObj:
    """The RFC 7386 merge patch that turns `old` into `new` (removed keys become null; lists
    are sent whole, which is safe because callers add a resourceVersion precondition).

    With `merge_keys` (list field -> the key its elements are matched by), the lists of those
    fields are patched element by element, as Kubernetes' strategic merge patch reads them: a
    changed element by its key, a removed one as `{key: ..., "$patch": "delete"}`, a list whose
    elements have no unique key replaced whole (`{"$patch": "replace"}`).

    A merge patch cannot set a value to null; nothing we write is null (JSON values with nulls
    live inside the --kv-transfer-config string, not in the object)."""
    keys = merge_keys or {}
    patch: JsonObj = {}
    for key in old:
        if key not in new:
            patch[key] = None
    for key, value in new.items():
        before = old.get(key) if key in old else _MISSING
        if before is not _MISSING and before == value:
            continue
        if isinstance(before, Mapping) and isinstance(value, Mapping):
            patch[key] = build_merge_patch(before, value, keys)
        elif key in keys and isinstance(value, list) and before is not _MISSING:
            merge_key = keys[key]
            patch[key] = (_keyed_list_patch(before, value, merge_key, keys)
                          if _keyed(before, merge_key) and _keyed(value, merge_key)
                          else [*copy.deepcopy(value), {"$patch": "replace"}])  # unkeyed: the list as a whole
        else:
            patch[key] = copy.deepcopy(value)
    return patch


#: The list fields of a pod template that Kubernetes' strategic merge patch merges element by
#: element, and the key it matches them by (`patchMergeKey` in k8s.io/api core/v1).
STRATEGIC_MERGE_KEYS: Mapping[str, str] = {
    "containers": "name", "initContainers": "name", "env": "name", "volumes": "name", "volumeMounts": "mountPath",
}


def build_strategic_merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> JsonObj:
    """The strategic merge patch (Deployments, StatefulSets) that turns `old` into `new` where
    they differ, and leaves alone what neither holds: `build_merge_patch` with the pod
    template's `STRATEGIC_MERGE_KEYS`.

    Why: the watch caches keep workloads trimmed to what the planner reads (a container's
    resources, probes and foreign env vars dropped: `core.kept_fields`); a merge patch of
    `spec.template.spec.containers` would send that trimmed list whole and delete the rest on
    the server. Element by element, what the cache dropped is never mentioned, so it stays."""
    return build_merge_patch(old, new, STRATEGIC_MERGE_KEYS)


def _keyed(items: Any, key: str) -> TypeGuard[list[Any]]:
    return isinstance(items, list) and all(isinstance(i, Mapping) and key in i for i in items) \
        and len({json.dumps(i[key], sort_keys=True) for i in items}) == len(items)


def _keyed_list_patch(old: list[Any], new: list[Any], key: str, merge_keys: Mapping[str, str]) -> list[Any]:
    before = {json.dumps(i[key], sort_keys=True): i for i in old}
    after = {json.dumps(i[key], sort_keys=True) for i in new}
    elements: list[Any] = []
    for item in new:
        was = before.get(json.dumps(item[key], sort_keys=True))
        if was is None:
            elements.append(copy.deepcopy(item))
        elif was != item:
            elements.append({key: copy.deepcopy(item[key]), **build_merge_patch(was, item, merge_keys)})
    elements += [{key: copy.deepcopy(i[key]), "$patch": "delete"} for k, i in before.items() if k not in after]
    return elements
