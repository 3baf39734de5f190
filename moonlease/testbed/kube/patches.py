"""JSON merge patch (RFC 7386) and Kubernetes' strategic merge patch. Pure functions."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

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
STRATEGIC_MERGE_KEYS: Mapping[str, str] = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "env": "name", "ports": "containerPort", "volumes": "name", "volumeMounts": "mountPath",
    "volumeDevices": "devicePath", "imagePullSecrets": "name", "conditions": "type",
    "hostAliases": "ip", "resourceClaims": "name",
}


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Kubernetes' strategic merge patch for the built-in kinds, as far as tests need it.

    Like a merge patch, except that lists in `STRATEGIC_MERGE_KEYS` merge element-wise by their
    key, `$patch: delete` removes an element, `$patch: replace` replaces a map or list, and the
    `$setElementOrder/*` and `$retainKeys` hints are ignored. Other lists are replaced (atomic).
    """
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and key in STRATEGIC_MERGE_KEYS and isinstance(result.get(key), list):
            result[key] = _merge_keyed_list(result[key], value, STRATEGIC_MERGE_KEYS[key])
        elif isinstance(value, list):
            result[key] = [_strip_directives(v) for v in value if not _is_delete(v)]
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    return result


def _is_delete(item: Any) -> bool:
    return isinstance(item, Mapping) and item.get("$patch") == "delete"


def _strip_directives(item: Any) -> Any:
    if isinstance(item, Mapping):
        return strategic_merge_patch({}, item)
    return copy.deepcopy(item)


def _merge_keyed_list(current: list[Any], patch: list[Any], key: str) -> list[Any]:
    if any(isinstance(item, Mapping) and item.get("$patch") == "replace" for item in patch):
        return [_strip_directives(i) for i in patch if not (isinstance(i, Mapping) and "$patch" in i)]
    result = [copy.deepcopy(item) for item in current]
    for item in patch:
        if not isinstance(item, Mapping) or key not in item:
            result.append(copy.deepcopy(item))
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

