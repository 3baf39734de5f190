"""JSON merge patch (RFC 7386) and Kubernetes' strategic merge patch. Pure functions."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

#: The PATCH bodies the server reads, by media type: one table for the write path and for the
#: OpenAPI documents that tell clients what each kind's PATCH accepts.
PATCH_BODIES = {
    "application/apply-patch+yaml": "apply",
    "application/json-patch+json": "json",
    "application/merge-patch+json": "merge",
    "application/strategic-merge-patch+json": "strategic",
}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge recursively, null deletes, the rest replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


#: List fields that a strategic merge patch merges by key instead of replacing (k8s.io/api tags).
#: `ports` has two keys by context: a container's by `containerPort`, a Service's by `port`
#: (see `_list_key`).
STRATEGIC_MERGE_KEYS: Mapping[str, str] = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "env": "name", "ports": "containerPort", "volumes": "name", "volumeMounts": "mountPath",
    "volumeDevices": "devicePath", "imagePullSecrets": "name", "conditions": "type",
    "hostAliases": "ip", "resourceClaims": "name",
}

#: Lists of scalars that merge as sets (patchStrategy "merge" without a key): their union,
#: in order, and `$deleteFromPrimitiveList/<field>` removes values.
PRIMITIVE_MERGE_LISTS = frozenset({"finalizers"})

_DELETE = object()  # a map removed by `$patch: delete`


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Kubernetes' strategic merge patch for the built-in kinds.

    Like a merge patch, except: lists in `STRATEGIC_MERGE_KEYS` merge element-wise by their key
    (the current order kept, new elements appended; `$setElementOrder/<field>` then orders them
    as the client sent); `PRIMITIVE_MERGE_LISTS` merge as ordered sets
    (`$deleteFromPrimitiveList/<field>` removes values); `$patch: delete` removes a list element
    or a map; `$patch: replace` replaces a map or a list; `$retainKeys` drops the map's other
    keys. Directives never reach the stored object. Other lists are replaced (atomic).
    """
    merged = _merge_map(target, patch)
    return {} if merged is _DELETE else merged


def _merge_map(target: Any, patch: Any) -> Any:
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "delete":
        return _DELETE
    if patch.get("$patch") == "replace":
        return _strip_directives(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and key in PRIMITIVE_MERGE_LISTS:
            current = result.get(key)
            current = current if isinstance(current, list) else []
            result[key] = list(dict.fromkeys([*current, *value]))
        elif isinstance(value, list) and key in STRATEGIC_MERGE_KEYS and isinstance(result.get(key), list):
            result[key] = _merge_keyed_list(result[key], value, _list_key(key, result[key], value))
        elif isinstance(value, list):
            result[key] = [_strip_directives(v) for v in value if not _is_delete(v)]
        else:
            merged = _merge_map(result.get(key), value)
            if merged is _DELETE:
                result.pop(key, None)
            else:
                result[key] = merged
    for key, value in patch.items():
        field = key.partition("/")[2]
        if key.startswith("$deleteFromPrimitiveList/") and isinstance(result.get(field), list):
            result[field] = [v for v in result[field] if v not in (value or [])]
        elif key.startswith("$setElementOrder/") and isinstance(result.get(field), list) and field in STRATEGIC_MERGE_KEYS:
            result[field] = _ordered(result[field], value or [], _list_key(field, result[field], value or []))
    if isinstance(patch.get("$retainKeys"), list):
        result = {k: v for k, v in result.items() if k in patch["$retainKeys"]}
    return result


def _list_key(field: str, current: list[Any], patch: list[Any]) -> str:
    """The merge key of a list: a Service's `ports` merge by `port`, a container's by
    `containerPort` (the same field name, two types)."""
    if field == "ports" and any(isinstance(i, Mapping) and "port" in i and "containerPort" not in i
                                for i in [*current, *patch]):
        return "port"
    return STRATEGIC_MERGE_KEYS[field]


def _ordered(items: list[Any], order: list[Any], key: str) -> list[Any]:
    """`$setElementOrder`: the elements the client listed, in its order, then the others as they were."""
    rank = {entry.get(key): i for i, entry in enumerate(order) if isinstance(entry, Mapping)}
    listed = sorted((i for i in items if isinstance(i, Mapping) and i.get(key) in rank), key=lambda i: rank[i[key]])
    return listed + [i for i in items if not (isinstance(i, Mapping) and i.get(key) in rank)]


def _is_delete(item: Any) -> bool:
    return isinstance(item, Mapping) and item.get("$patch") == "delete"


def _strip_directives(item: Any) -> Any:
    """A value with every `$`-directive removed (what a replace or a new element stores)."""
    if isinstance(item, Mapping):
        return {k: _strip_directives(v) for k, v in item.items() if not k.startswith("$")}
    if isinstance(item, list):
        return [_strip_directives(v) for v in item if not _is_delete(v)]
    return copy.deepcopy(item)


def _merge_keyed_list(current: list[Any], patch: list[Any], key: str) -> list[Any]:
    if any(isinstance(item, Mapping) and item.get("$patch") == "replace" for item in patch):
        return [_strip_directives(i) for i in patch if not (isinstance(i, Mapping) and "$patch" in i)]
    result = [copy.deepcopy(item) for item in current]
    for item in patch:
        if not isinstance(item, Mapping) or key not in item:
            result.append(_strip_directives(item))
            continue
        index = next((i for i, old in enumerate(result)
                      if isinstance(old, Mapping) and old.get(key) == item[key]), None)
        if _is_delete(item):
            if index is not None:
                del result[index]
        elif index is None:
            result.append(_strip_directives(item))
        else:
            result[index] = strategic_merge_patch(result[index], item)
    return result
