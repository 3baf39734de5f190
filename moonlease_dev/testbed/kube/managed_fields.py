"""Field managers (`metadata.managedFields`) and server-side apply, as the API server keeps them.
Pure: objects and manager entries in, objects, entries or conflicts out.

A field set is a set of paths in the `fieldsV1` vocabulary: `f:<name>` a map field,
`k:{"name":"web"}` an element of a list keyed by its merge keys, `v:"x"` a member of a set-like
list (finalizers). Lists are keyed as the types declare them: a CRD schema's
`x-kubernetes-list-type`/`x-kubernetes-list-map-keys`; for the built-in kinds the patch-merge keys
(`patches.STRATEGIC_MERGE_KEYS`), `ownerReferences` by uid, `finalizers` as a set; any other list
is atomic (one leaf). Server-set metadata, apiVersion/kind, and status (except on /status) are
never owned.

Updates (create, PUT, merge/JSON/strategic patch) give the writer the fields it changed and take
them from every other manager; fields removed leave every manager. An apply (`apply_config`)
merges the applied configuration into the live object, conflicts where another manager owns a
field the configuration sets to a different value (409 unless forced, which moves ownership),
and removes the fields this manager applied before and no longer does, unless another owns them.
The manager `kubectl` takes fields from `kubectl-client-side-apply` that its last-applied
annotation names without a conflict (how a client-side applied object moves to server-side apply).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from moonlease_dev.testbed.kube.patches import STRATEGIC_MERGE_KEYS, _list_key

JsonObj = dict[str, Any]
Path = tuple[str, ...]

_MISSING = object()
#: Metadata the server sets: nobody manages it.
_SERVER_METADATA = frozenset({"name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                              "managedFields", "deletionTimestamp", "deletionGracePeriodSeconds", "selfLink",
                              "generateName"})


def _child_schema(schema: Mapping[str, Any] | None, name: str) -> Mapping[str, Any] | None:
    if schema is None:
        return None
    found = (schema.get("properties") or {}).get(name)
    if found is None and isinstance(schema.get("additionalProperties"), Mapping):
        found = schema["additionalProperties"]
    return found


def _list_type(name: str, items: list[Any], schema: Mapping[str, Any] | None) -> tuple[str, tuple[str, ...]]:
    """("map", keys) | ("set", ()) | ("atomic", ()) for the list at field `name`."""
    if schema is not None:
        kind = schema.get("x-kubernetes-list-type", "atomic")
        if kind == "map":
            return "map", tuple(schema.get("x-kubernetes-list-map-keys") or ())
        return ("set", ()) if kind == "set" else ("atomic", ())
    if name == "finalizers":
        return "set", ()
    if name == "ownerReferences":
        return "map", ("uid",)
    if name in STRATEGIC_MERGE_KEYS and all(isinstance(i, Mapping) for i in items):
        return "map", (_list_key(name, items, []),)
    return "atomic", ()


def _item_key(item: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    return "k:" + json.dumps({k: item.get(k) for k in keys}, separators=(",", ":"))


def _fields(value: Any, schema: Mapping[str, Any] | None, prefix: Path, out: set[Path]) -> None:
    if not isinstance(value, Mapping):
        out.add(prefix)
        return
    if not value and prefix:
        out.add(prefix)
    for name, sub in value.items():
        path = (*prefix, f"f:{name}")
        sub_schema = _child_schema(schema, name)
        if isinstance(sub, list):
            kind, keys = _list_type(name, sub, sub_schema)
            if kind == "map" and keys:
                for item in sub:
                    item_path = (*path, _item_key(item, keys))
                    out.add(item_path)
                    _fields(item, _child_schema_items(sub_schema), item_path, out)
            elif kind == "set":
                out.update((*path, "v:" + json.dumps(item, separators=(",", ":"))) for item in sub)
            else:
                out.add(path)
        elif isinstance(sub, Mapping) and sub:
            _fields(sub, sub_schema, path, out)
        else:
            out.add(path)


def _child_schema_items(schema: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    return schema.get("items") if schema is not None else None


def field_set(obj: Mapping[str, Any], schema: Mapping[str, Any] | None = None, *,
              subresource: str | None = None, has_status: bool = True) -> set[Path]:
    """The paths of `obj` a manager can own (see the module docstring)."""
    out: set[Path] = set()
    for name, value in obj.items():
        if name in ("apiVersion", "kind"):
            continue
        if subresource == "status" and name != "status":
            continue
        if subresource != "status" and name == "status" and has_status:
            continue
        if name == "metadata" and isinstance(value, Mapping):
            kept = {k: v for k, v in value.items() if k not in _SERVER_METADATA}
            if kept:
                _fields(kept, None, ("f:metadata",), out)
            continue
        _fields({name: value}, schema, (), out)
    return out


def value_at(obj: Any, path: Path) -> Any:
    """The value a path names in `obj` (a sentinel when absent)."""
    current = obj
    for segment in path:
        kind, _, rest = segment.partition(":")
        if kind == "f":
            if not isinstance(current, Mapping) or rest not in current:
                return _MISSING
            current = current[rest]
        elif kind == "k":
            wanted = json.loads(rest)
            if not isinstance(current, list):
                return _MISSING
            current = next((i for i in current if isinstance(i, Mapping)
                            and all(i.get(k) == v for k, v in wanted.items())), _MISSING)
            if current is _MISSING:
                return _MISSING
        elif kind == "v":
            member = json.loads(rest)
            return member if isinstance(current, list) and member in current else _MISSING
    return current


def _remove_at(obj: Any, path: Path) -> None:
    """Delete what a path names, in place (nothing when absent)."""
    parent = value_at(obj, path[:-1]) if len(path) > 1 else obj
    kind, _, rest = path[-1].partition(":")
    if kind == "f" and isinstance(parent, dict):
        parent.pop(rest, None)
    elif kind == "k" and isinstance(parent, list):
        wanted = json.loads(rest)
        parent[:] = [i for i in parent if not (isinstance(i, Mapping) and all(i.get(k) == v for k, v in wanted.items()))]
    elif kind == "v" and isinstance(parent, list):
        member = json.loads(rest)
        parent[:] = [i for i in parent if i != member]


def to_fields_v1(paths: Iterable[Path]) -> JsonObj:
    """A field set as the `fieldsV1` tree (list elements carry `"."`, as the API server writes them)."""
    tree: JsonObj = {}
    for path in sorted(paths):
        node = tree
        for segment in path:
            node = node.setdefault(segment, {})
        if path[-1].startswith("k:"):
            node["."] = {}
    return tree


def from_fields_v1(tree: Mapping[str, Any], prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    for segment, sub in tree.items():
        if segment == ".":
            out.add(prefix)
            continue
        path = (*prefix, segment)
        if isinstance(sub, Mapping) and sub:
            out |= from_fields_v1(sub, path)
        else:
            out.add(path)
    return out


def path_text(path: Path) -> str:
    """How the API server prints a path: `.spec.template.spec.containers[name="web"].image`."""
    text = ""
    for segment in path:
        kind, _, rest = segment.partition(":")
        if kind == "f":
            text += f".{rest}"
        elif kind == "k":
            text += "[" + ",".join(f"{k}={json.dumps(v)}" for k, v in json.loads(rest).items()) + "]"
        else:
            text += f"[={rest}]"
    return text


@dataclass(frozen=True)
class Conflict:
    entry: Mapping[str, Any]
    path: Path

    def manager_text(self) -> str:
        text = json.dumps(self.entry.get("manager", ""))
        if self.entry.get("subresource"):
            text += f" with subresource {json.dumps(self.entry['subresource'])}"
        if self.entry.get("operation") == "Update":
            text += f" using {self.entry.get('apiVersion', '')}"
        return text


class ApplyConflicts(Exception):
    """Other managers own fields the applied configuration sets differently (a 409)."""

    def __init__(self, conflicts: list[Conflict]) -> None:
        self.conflicts = conflicts
        super().__init__(self.message)

    @property
    def message(self) -> str:
        count = len(self.conflicts)
        if count == 1:
            only = self.conflicts[0]
            text = f"conflict with {only.manager_text()}: {path_text(only.path)}"
        else:
            by_manager: dict[str, list[Path]] = {}
            for conflict in self.conflicts:
                by_manager.setdefault(conflict.manager_text(), []).append(conflict.path)
            lines = []
            for manager in sorted(by_manager):
                lines.append(f"conflicts with {manager}:")
                lines += [f"- {path_text(p)}" for p in by_manager[manager]]
            text = "\n".join(lines)
        return f"Apply failed with {count} conflict{'s' if count != 1 else ''}: {text}"

    def causes(self) -> list[JsonObj]:
        return [{"reason": "FieldManagerConflict", "message": f"conflict with {c.manager_text()}",
                 "field": path_text(c.path)} for c in self.conflicts]


def _entry_paths(entry: Mapping[str, Any]) -> set[Path]:
    return from_fields_v1(entry.get("fieldsV1") or {})


def _entry(manager: str, operation: str, api_version: str, now: str, paths: set[Path],
           subresource: str | None) -> JsonObj:
    entry: JsonObj = {"manager": manager, "operation": operation, "apiVersion": api_version, "time": now,
                      "fieldsType": "FieldsV1", "fieldsV1": to_fields_v1(paths)}
    if subresource:
        entry["subresource"] = subresource
    return entry


def _same_entry(entry: Mapping[str, Any], manager: str, operation: str, subresource: str | None) -> bool:
    return (entry.get("manager") == manager and entry.get("operation") == operation
            and (entry.get("subresource") or None) == subresource)


def _replace_entries(entries: list[Mapping[str, Any]], owned: list[set[Path]], mine: JsonObj | None,
                     manager: str, operation: str, subresource: str | None) -> list[JsonObj]:
    """The entries with their new field sets, empty ones dropped, `mine` in place of the writer's."""
    result: list[JsonObj] = []
    placed = False
    for entry, paths in zip(entries, owned, strict=True):
        if _same_entry(entry, manager, operation, subresource):
            if mine is not None and not placed:
                result.append(mine)
                placed = True
            continue
        if paths:
            result.append({**copy.deepcopy(dict(entry)), "fieldsV1": to_fields_v1(paths)})
    if mine is not None and not placed:
        result.append(mine)
    return result


def record_update(entries: list[Mapping[str, Any]], manager: str, old: Mapping[str, Any] | None,
                  new: Mapping[str, Any], *, schema: Mapping[str, Any] | None, api_version: str, now: str,
                  subresource: str | None = None, has_status: bool = True) -> list[JsonObj]:
    """The managed fields after an update by `manager` (see the module docstring)."""
    scope = "status" if subresource == "status" else None  # a /scale write changes the object's spec
    old_set = field_set(old, schema, subresource=scope, has_status=has_status) if old else set()
    new_set = field_set(new, schema, subresource=scope, has_status=has_status)
    removed = old_set - new_set
    changed = {p for p in new_set if p not in old_set
               or (not p[-1].startswith("k:") and value_at(old, p) != value_at(new, p))}
    owned = [(_entry_paths(e) - changed - removed) for e in entries]
    mine_before = next((paths for e, paths in zip(entries, [_entry_paths(e) for e in entries], strict=True)
                        if _same_entry(e, manager, "Update", subresource)), set())
    mine_paths = (mine_before - removed) | changed
    mine = _entry(manager, "Update", api_version, now, mine_paths, subresource) if mine_paths else None
    return _replace_entries(entries, owned, mine, manager, "Update", subresource)


def _merge(live: Any, applied: Any, name: str, schema: Mapping[str, Any] | None) -> Any:
    if isinstance(applied, Mapping):
        result = dict(live) if isinstance(live, Mapping) else {}
        for key, value in applied.items():
            if value is None:
                result.pop(key, None)
            else:
                result[key] = _merge(result.get(key), value, key, _child_schema(schema, key))
        return result
    if isinstance(applied, list) and isinstance(live, list):
        kind, keys = _list_type(name, applied, schema)
        if kind == "set":
            return [json.loads(i) for i in dict.fromkeys(json.dumps(i, sort_keys=True) for i in [*live, *applied])]
        if kind == "map" and keys:
            items = [copy.deepcopy(i) for i in live]
            for item in applied:
                index = next((n for n, old in enumerate(items) if isinstance(old, Mapping)
                              and all(old.get(k) == item.get(k) for k in keys)), None)
                merged = _merge(items[index] if index is not None else None, item, name,
                                _child_schema_items(schema))
                if index is None:
                    items.append(merged)
                else:
                    items[index] = merged
            return items
    return copy.deepcopy(applied)


CLIENT_SIDE_APPLY = "kubectl-client-side-apply"
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def _upgradable(entries: list[Mapping[str, Any]], live: Mapping[str, Any] | None,
                schema: Mapping[str, Any] | None, has_status: bool) -> set[Path]:
    """The fields `kubectl apply --server-side` may take from `kubectl apply` without a conflict,
    as the API server allows it: those of the last client-side applied configuration that its
    manager still owns (none without the annotation)."""
    text = (((live or {}).get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    try:
        last = json.loads(text) if text else None
    except ValueError:
        last = None
    if not isinstance(last, Mapping):
        return set()
    csa = set().union(*(_entry_paths(e) for e in entries if _same_entry(e, CLIENT_SIDE_APPLY, "Update", None)))
    return field_set(last, schema, has_status=has_status) & csa


def apply_config(entries: list[Mapping[str, Any]], manager: str, live: Mapping[str, Any] | None,
                 applied: Mapping[str, Any], *, schema: Mapping[str, Any] | None, api_version: str, now: str,
                 force: bool = False, has_status: bool = True) -> tuple[JsonObj, list[JsonObj]]:
    """Server-side apply of `applied` by `manager`: the merged object and its managed fields;
    raises `ApplyConflicts` (see the module docstring)."""
    applied_set = field_set(applied, schema, has_status=has_status)
    owned = [_entry_paths(e) for e in entries]
    conflicts = []
    for entry, paths in zip(entries, owned, strict=True):
        if _same_entry(entry, manager, "Apply", None):
            continue
        for path in sorted(paths & applied_set):
            if path[-1].startswith("k:"):
                continue  # list elements are shared; their fields may conflict
            if live is not None and value_at(live, path) not in (_MISSING, value_at(applied, path)):
                conflicts.append(Conflict(entry, path))
                if force:
                    paths.discard(path)
    if conflicts and not force:
        if not (manager == "kubectl" and all(c.path in _upgradable(entries, live, schema, has_status) for c in conflicts)):
            raise ApplyConflicts(conflicts)
        for conflict in conflicts:  # kubectl's first server-side apply takes over from its client side
            for entry, paths in zip(entries, owned, strict=True):
                if entry is conflict.entry:
                    paths.discard(conflict.path)
    previous = next((paths for e, paths in zip(entries, owned, strict=True) if _same_entry(e, manager, "Apply", None)),
                    set())
    merged = _merge(copy.deepcopy(dict(live or {})), applied, "", schema)
    others = [paths for e, paths in zip(entries, owned, strict=True) if not _same_entry(e, manager, "Apply", None)]
    for path in sorted(previous - applied_set, key=len, reverse=True):
        if not any(any(p[:len(path)] == path for p in paths) for paths in others):
            _remove_at(merged, path)
    mine = _entry(manager, "Apply", api_version, now, applied_set, None)
    return merged, _replace_entries(entries, owned, mine, manager, "Apply", None)
