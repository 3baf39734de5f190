"""Owned slots and snapshots: reading what a workload holds, writing what the policy wants, and
undoing it exactly. Pure.

Called by the rollout planner (`core.rollout`) to decide what is in sync, and by the workload
adapter, which hands every freshly read object to `build_update` and patches the difference.

Vocabulary:

* an **owned slot** is one place the policy decides, named by a string: `env:NAME` (an env
  var of the vLLM container), `kv:KEY` / `kv:kv_connector_extra_config.KEY` (a key of the JSON
  of `--kv-transfer-config`), `flag:NAME` (a mooncake_master flag in the container args),
  `doc:NAME` (a key of a config file in a ConfigMap: the master's, or a workload's connector
  settings file), `volume:NAME` (a pod volume), `mount:NAME` (a volumeMount of the vLLM
  container) and `annotation` (the
  `moonlease.io/config-hash` annotation of the pod template). Nothing else is ever written,
  except our bookkeeping in the workload's own metadata (label and annotations below), which
  does not change the pod template.
* a slot's value is *wrapped*: `{"v": value}` when present, `None` when absent, so "the key was
  absent" is a value that can be restored.
* a **snapshot** (`{"place": container or ConfigMap key, "slots": {slot: wrapped}}`) records
  what slots held. Structural slots (`has:args`, `has:env`, `has:annotations`, `has:kvextra`,
  `kvarg`, `doctext`, `has:data`, `has:metaannotations`, `has:metalabels`, `has:volumes`,
  `has:volumeMounts`) record the shape around
  them — whether a list or map existed, the verbatim `--kv-transfer-config` tokens or config file
  text — so that a restore is exact, not merely equivalent.

Each workload we change keeps two snapshots in its metadata annotations:
`moonlease.io/original` (before the policy first changed it: what deletion restores) and
`moonlease.io/rollback` (before the current rollout attempt changed it: what a rollback restores;
an attempt that never completed keeps the snapshot of the one before it, so a rollback always
returns to the last configuration that was rolled out completely). Both are written in the same
patch as the change itself, so no crash can separate a change from the means to undo it.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from moonlease_operator.api import GROUP
from moonlease_operator.core.changes import ChangeAction, JsonObj, WorkloadChange, Wrapped
from moonlease_operator.core.command_line import KV_TRANSFER_CONFIG_OPTIONS
from moonlease_operator.core.workload_args import (
    EXTRA_CONFIG_KEY,
    find_container,
    find_flag,
    find_option,
    flag_value,
    format_doc,
    kv_doc,
    option_tokens,
    parse_doc,
    replace_tokens,
    set_kv_doc,
)

CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
POLICY_LABEL = f"{GROUP}/policy"
ORIGINAL_ANNOTATION = f"{GROUP}/original"
ROLLBACK_ANNOTATION = f"{GROUP}/rollback"

_WORKLOAD_SHAPE = ("has:args", "has:env", "has:annotations", "has:kvextra", "kvarg", "has:volumes",
                   "has:volumeMounts")
_CONFIG_MAP_SHAPE = ("doctext", "has:data")
_METADATA_SHAPE = ("has:metaannotations", "has:metalabels")
_TRUTHY = {"true": True, "1": True, "yes": True, "t": True, "false": False, "0": False, "no": False, "f": False}


def build_update(obj: Mapping[str, Any], change: WorkloadChange) -> JsonObj | None:
    """The object after `change`, or None when it needs no change (the test of "in sync").

    Idempotent: applying a change to its own result gives None, so a retried write (after a
    409 or a 5xx whose effect is unknown) is computed again from a fresh read, never doubled.
    """
    match change.action:
        case ChangeAction.APPLY:
            return _apply(obj, change)
        case ChangeAction.ROLLBACK:
            return _rollback(obj, change)
        case ChangeAction.RELEASE:
            return _release(obj)
        case ChangeAction.FORGET:
            return _release(obj, restore=False)


def needs_update(obj: Mapping[str, Any], change: WorkloadChange) -> bool:
    """Whether `change` would alter `obj`: `build_update(obj, change) is not None`, without
    building the new object (the planner asks this for every workload on every reconcile)."""
    match change.action:
        case ChangeAction.APPLY:
            return not _apply_in_sync(obj, change, _apply_targets(obj, change))
        case ChangeAction.ROLLBACK:
            return _rollback_snapshot(obj, change) is not None
        case ChangeAction.RELEASE:
            return _release(obj) is not None
        case ChangeAction.FORGET:
            return _release(obj, restore=False) is not None


def describe_update(obj: Mapping[str, Any], change: WorkloadChange) -> list[str]:
    """Human lines for what `change` would alter, e.g. `--eviction_ratio: 0.05 -> 0.1`."""
    return [f"{_slot_label(slot)}: {_render(slot, current)} -> {_render(slot, value)}"
            for slot, current, value in _differences(obj, change)]


def differing_slots(obj: Mapping[str, Any], change: WorkloadChange) -> list[str]:
    """The owned slots `change` would alter in `obj`, sorted (`env:NAME`, `volume:NAME`, ...)."""
    return [slot for slot, _, _ in _differences(obj, change)]


def _differences(obj: Mapping[str, Any], change: WorkloadChange) -> list[tuple[str, Wrapped, Wrapped]]:
    result = []
    for slot, value in sorted(_targets_of(obj, change).items()):
        current = read_slot(obj, change.place, slot)
        if not _slot_equal(slot, current, value):
            result.append((slot, current, value))
    return result


def _targets_of(obj: Mapping[str, Any], change: WorkloadChange) -> dict[str, Wrapped]:
    if change.action is ChangeAction.FORGET:
        return {}
    if change.action is ChangeAction.APPLY:
        return _apply_targets(obj, change)
    snapshot = _load(obj, ROLLBACK_ANNOTATION if change.action is ChangeAction.ROLLBACK else ORIGINAL_ANNOTATION)
    return {} if snapshot is None else {s: v for s, v in snapshot["slots"].items() if _is_value_slot(s)}


def _apply_targets(obj: Mapping[str, Any], change: WorkloadChange) -> dict[str, Wrapped]:
    targets = dict(change.desired)
    original = _load(obj, ORIGINAL_ANNOTATION)
    # A setting the policy no longer declares goes back to what it was before the policy.
    for slot, value in (original or {}).get("slots", {}).items():
        if _is_value_slot(slot) and slot != "annotation" and slot not in targets:
            targets[slot] = value
    return targets


def _apply_in_sync(obj: Mapping[str, Any], change: WorkloadChange, targets: Mapping[str, Wrapped]) -> bool:
    if not all(_slot_equal(s, read_slot(obj, change.place, s), v) for s, v in targets.items()):
        return False
    return not change.require_annotation or read_slot(obj, change.place, "annotation") == {"v": change.config_hash}


def _apply(obj: Mapping[str, Any], change: WorkloadChange) -> JsonObj | None:
    place = change.place
    targets = _apply_targets(obj, change)
    if _apply_in_sync(obj, change, targets):
        return None
    shape = _CONFIG_MAP_SHAPE if obj.get("kind") == "ConfigMap" else _WORKLOAD_SHAPE
    touched = set(targets) | ({"annotation"} if change.config_hash and shape is _WORKLOAD_SHAPE else set())
    current = {s: read_slot(obj, place, s) for s in (*touched, *shape, *_METADATA_SHAPE)}

    original = _load(obj, ORIGINAL_ANNOTATION) or {"place": place, "slots": {}}
    for slot, value in current.items():
        original["slots"].setdefault(slot, value)
    rollback = _load(obj, ROLLBACK_ANNOTATION)
    earlier = None if rollback is None else rollback.get("revision")
    if rollback is not None and isinstance(earlier, int) and (
            earlier == change.revision or earlier > (change.applied_revision or 0)):
        # Same attempt, or one that never completed: its snapshot is still the last stable state.
        for slot, value in current.items():
            if slot not in _METADATA_SHAPE:
                rollback["slots"].setdefault(slot, value)
    else:
        rollback = {"place": place, "slots": {s: v for s, v in current.items() if s not in _METADATA_SHAPE}}
    rollback["revision"] = change.revision

    new = copy.deepcopy(dict(obj))
    for slot, value in sorted(targets.items()):
        _write_slot(new, place, slot, value)
    if "annotation" in touched:
        _write_slot(new, place, "annotation", {"v": change.config_hash})
    meta = new.setdefault("metadata", {})
    meta.setdefault("labels", {})[POLICY_LABEL] = policy_label_value(change.policy)
    annotations = meta.setdefault("annotations", {})
    annotations[ORIGINAL_ANNOTATION] = _dump(original)
    annotations[ROLLBACK_ANNOTATION] = _dump(rollback)
    return new


def _rollback_snapshot(obj: Mapping[str, Any], change: WorkloadChange) -> dict[str, Any] | None:
    """The snapshot a rollback would restore, or None when there is nothing to restore."""
    snapshot = _load(obj, ROLLBACK_ANNOTATION)
    if snapshot is None or snapshot.get("revision") != change.revision:
        return None  # not changed by this attempt
    if all(_slot_equal(s, read_slot(obj, snapshot.get("place"), s), v)
           for s, v in snapshot["slots"].items() if _is_value_slot(s)):
        return None
    return snapshot


def _rollback(obj: Mapping[str, Any], change: WorkloadChange) -> JsonObj | None:
    snapshot = _rollback_snapshot(obj, change)
    if snapshot is None:
        return None
    new = copy.deepcopy(dict(obj))
    _restore(new, snapshot)
    return new


def _release(obj: Mapping[str, Any], *, restore: bool = True) -> JsonObj | None:
    """Our bookkeeping dropped and, with `restore`, the original snapshot back."""
    original = _load(obj, ORIGINAL_ANNOTATION)
    new = copy.deepcopy(dict(obj))
    if original is not None and restore:
        _restore(new, original)
    meta = new.setdefault("metadata", {})
    for key in (ORIGINAL_ANNOTATION, ROLLBACK_ANNOTATION):
        (meta.get("annotations") or {}).pop(key, None)
    (meta.get("labels") or {}).pop(POLICY_LABEL, None)
    slots = (original or {}).get("slots", {})
    for key, slot in (("annotations", "has:metaannotations"), ("labels", "has:metalabels")):
        if key in meta and not meta[key] and slots.get(slot, {"v": True}) == {"v": False}:
            del meta[key]
    return None if new == obj else new


def _restore(obj: JsonObj, snapshot: Mapping[str, Any]) -> None:
    place, slots = snapshot.get("place"), snapshot["slots"]
    for slot, value in sorted(slots.items()):
        if _is_value_slot(slot):
            _write_slot(obj, place, slot, value)
    for slot in ("has:kvextra", "kvarg", "has:args", "has:env", "has:annotations", "doctext", "has:data",
                 "has:volumes", "has:volumeMounts"):
        if slot in slots:
            _finish_shape(obj, place, slot, slots[slot])


# --------------------------------------------------------------------------------------------
# Bookkeeping annotations
# --------------------------------------------------------------------------------------------

def load_snapshot(obj: Mapping[str, Any], annotation: str) -> dict[str, Any] | None:
    """The snapshot kept in `annotation` (`ORIGINAL_ANNOTATION`, `ROLLBACK_ANNOTATION`), if any."""
    return _load(obj, annotation)


def _load(obj: Mapping[str, Any], annotation: str) -> dict[str, Any] | None:
    raw = ((obj.get("metadata") or {}).get("annotations") or {}).get(annotation)
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("slots"), dict) else None


def _dump(snapshot: Mapping[str, Any]) -> str:
    return json.dumps(snapshot, sort_keys=True, separators=(",", ":"))


def policy_label_value(policy: str) -> str:
    """The `moonlease.io/policy` label value naming a policy: always a valid label value (at most
    63 characters, alphanumeric at both ends). A policy name is a DNS subdomain of up to 253
    characters: a longer one becomes a prefix plus 8 hex digits of its SHA-256."""
    if len(policy) <= 63:
        return policy
    prefix = policy[:54].rstrip("-.")
    return f"{prefix}-{hashlib.sha256(policy.encode()).hexdigest()[:8]}"


def managed_by(obj: Mapping[str, Any]) -> str | None:
    """The policy label value the workload carries, if any (`policy_label_value` of its policy)."""
    return ((obj.get("metadata") or {}).get("labels") or {}).get(POLICY_LABEL)


def rollback_revision(obj: Mapping[str, Any]) -> int | None:
    """The rollout attempt the workload's rollback snapshot belongs to, if any."""
    snapshot = _load(obj, ROLLBACK_ANNOTATION)
    revision = None if snapshot is None else snapshot.get("revision")
    return revision if isinstance(revision, int) else None


def template_config_hash(obj: Mapping[str, Any]) -> str | None:
    """The pod template's configuration-hash annotation."""
    template = (obj.get("spec") or {}).get("template") or {}
    return ((template.get("metadata") or {}).get("annotations") or {}).get(CONFIG_HASH_ANNOTATION)


# --------------------------------------------------------------------------------------------
# Slots: reading and writing
# --------------------------------------------------------------------------------------------

def _is_value_slot(slot: str) -> bool:
    return slot == "annotation" or slot.split(":", 1)[0] in ("env", "kv", "flag", "doc", "volume", "mount")


def read_slot(obj: Mapping[str, Any], place: str | None, slot: str) -> Wrapped:
    """What `slot` holds in `obj` now (wrapped; None when absent)."""
    kind, _, key = slot.partition(":")
    if obj.get("kind") == "ConfigMap":
        data = obj.get("data")
        text = (data or {}).get(place or "")
        match slot:
            case "doctext":
                return None if text is None else {"v": text}
            case "has:data":
                return {"v": data is not None}
            case "has:metaannotations" | "has:metalabels":
                return _read_meta_shape(obj, slot)
        doc = parse_doc(place, text)
        return {"v": doc[key]} if kind == "doc" and isinstance(doc, dict) and key in doc else None
    template = (obj.get("spec") or {}).get("template") or {}
    container = find_container(obj, place) or {}
    match kind:
        case "annotation":
            annotations = (template.get("metadata") or {}).get("annotations") or {}
            return {"v": annotations[CONFIG_HASH_ANNOTATION]} if CONFIG_HASH_ANNOTATION in annotations else None
        case "env":
            entry = next((e for e in container.get("env") or [] if e.get("name") == key), None)
            return None if entry is None else {"v": entry}
        case "volume":
            entry = next((v for v in (template.get("spec") or {}).get("volumes") or [] if v.get("name") == key), None)
            return None if entry is None else {"v": entry}
        case "mount":
            entry = next((m for m in container.get("volumeMounts") or [] if m.get("name") == key), None)
            return None if entry is None else {"v": entry}
        case "kv":
            doc = kv_doc(container)
            if doc is None:
                return None
            parent, _, leaf = key.rpartition(".")
            node = doc.get(parent) if parent else doc
            return {"v": node[leaf]} if isinstance(node, dict) and leaf in node else None
        case "flag":
            hit = find_flag(container, key)
            return None if hit is None else {"v": list(option_tokens(container, hit))}
        case "kvarg":
            hit = find_option(container, KV_TRANSFER_CONFIG_OPTIONS)
            return None if hit is None else {"v": list(option_tokens(container, hit))}
        case "has":
            match key:
                case "args" | "env" | "volumeMounts":
                    return {"v": key in container}
                case "volumes":
                    return {"v": "volumes" in (template.get("spec") or {})}
                case "annotations":
                    return {"v": "annotations" in (template.get("metadata") or {})}
                case "kvextra":
                    return {"v": EXTRA_CONFIG_KEY in (kv_doc(container) or {})}
                case "metaannotations" | "metalabels":
                    return _read_meta_shape(obj, slot)
    raise ValueError(f"unknown slot {slot!r}")


def _read_meta_shape(obj: Mapping[str, Any], slot: str) -> Wrapped:
    key = "annotations" if slot == "has:metaannotations" else "labels"
    return {"v": key in (obj.get("metadata") or {})}


def _write_slot(obj: JsonObj, place: str | None, slot: str, value: Wrapped) -> None:
    kind, _, key = slot.partition(":")
    if obj.get("kind") == "ConfigMap":
        data = obj.setdefault("data", {})
        doc = parse_doc(place, data.get(place or ""))
        doc = doc if isinstance(doc, dict) else {}
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = value["v"]
        data[place or ""] = format_doc(place, doc)
        return
    template = obj.setdefault("spec", {}).setdefault("template", {})
    if kind == "annotation":
        annotations = template.setdefault("metadata", {}).setdefault("annotations", {})
        if value is None:
            annotations.pop(CONFIG_HASH_ANNOTATION, None)
        else:
            annotations[CONFIG_HASH_ANNOTATION] = value["v"]
        return
    if kind == "volume":
        _write_named(template.setdefault("spec", {}), "volumes", key, value)
        return
    container = find_container(obj, place)
    if container is None:
        raise ValueError(f"container {place!r} not found")
    match kind:
        case "env":
            _write_named(container, "env", key, value)
        case "mount":
            _write_named(container, "volumeMounts", key, value)
        case "kv":
            doc = kv_doc(container) or {}
            parent, _, leaf = key.rpartition(".")
            if parent:
                if value is None and not isinstance(doc.get(parent), dict):
                    return
                node = doc.setdefault(parent, {})
            else:
                node = doc
            if value is None:
                node.pop(leaf, None)
            else:
                node[leaf] = copy.deepcopy(value["v"])
            set_kv_doc(container, doc)
        case "flag":
            hit = find_flag(container, key)
            replace_tokens(container, hit, None if value is None else list(value["v"]))
        case _:
            raise ValueError(f"not a value slot: {slot!r}")


def _write_named(parent: JsonObj, field: str, name: str, value: Wrapped) -> None:
    """Set, replace or remove the entry called `name` of a list of named entries."""
    entries = parent.setdefault(field, [])
    index = next((i for i, e in enumerate(entries) if e.get("name") == name), None)
    if value is None:
        if index is not None:
            del entries[index]
    elif index is None:
        entries.append(copy.deepcopy(value["v"]))
    else:
        entries[index] = copy.deepcopy(value["v"])


def _finish_shape(obj: JsonObj, place: str | None, slot: str, original: Wrapped) -> None:
    """Make the shape around the restored values what it was (see the module docstring)."""
    if obj.get("kind") == "ConfigMap":
        data = obj.get("data") or {}
        if slot == "doctext":
            current = parse_doc(place, data.get(place or ""))
            if original is None and current in ({}, None):
                data.pop(place or "", None)
            elif original is not None and parse_doc(place, original["v"]) == current:
                data[place or ""] = original["v"]
        elif slot == "has:data" and original == {"v": False} and "data" in obj and not obj["data"]:
            del obj["data"]
        return
    container = find_container(obj, place)
    template = obj.get("spec", {}).get("template", {})
    match slot:
        case "has:kvextra" if container is not None:
            doc = kv_doc(container)
            if original == {"v": False} and doc is not None and doc.get(EXTRA_CONFIG_KEY) == {}:
                del doc[EXTRA_CONFIG_KEY]
                set_kv_doc(container, doc)
        case "kvarg" if container is not None:
            hit = find_option(container, KV_TRANSFER_CONFIG_OPTIONS)
            doc = kv_doc(container)
            if hit is None:
                return
            if original is None and doc == {}:
                replace_tokens(container, hit, None)
            elif original is not None and kv_doc({"args": original["v"]}) == doc:
                replace_tokens(container, hit, list(original["v"]))
        case "has:args" | "has:env" | "has:volumeMounts" if container is not None:
            key = slot.split(":")[1]
            if original == {"v": False} and key in container and not container[key]:
                del container[key]
        case "has:volumes":
            pod_spec = template.get("spec") or {}
            if original == {"v": False} and "volumes" in pod_spec and not pod_spec["volumes"]:
                del pod_spec["volumes"]
        case "has:annotations":
            meta = template.get("metadata") or {}
            if original == {"v": False} and "annotations" in meta and not meta["annotations"]:
                del meta["annotations"]


def _slot_equal(slot: str, a: Wrapped, b: Wrapped) -> bool:
    if a is None or b is None:
        return a is b
    kind = slot.split(":", 1)[0]
    if kind == "flag":
        return _same_scalar(flag_value(a["v"], slot[5:]), flag_value(b["v"], slot[5:]))
    if kind == "doc":
        return _same_scalar(a["v"], b["v"])
    return bool(a["v"] == b["v"])


def same_flag_value(a: Any, b: Any) -> bool:
    """Whether two flag values are equal as Mooncake reads them (`0.10` is `0.1`, `True` is `true`)."""
    return _same_scalar(a, b)


def _same_scalar(a: Any, b: Any) -> bool:
    """Equal as Mooncake reads them: `0.10` is `0.1`, `True` is `true`."""
    if a is None or b is None:
        return a is b
    sa, sb = str(a).strip().lower(), str(b).strip().lower()
    if sa in _TRUTHY and sb in _TRUTHY and not (isinstance(a, (int, float)) and not isinstance(a, bool)):
        return _TRUTHY[sa] == _TRUTHY[sb]
    try:
        return float(sa) == float(sb)
    except ValueError:
        return sa == sb


def _slot_label(slot: str) -> str:
    kind, _, key = slot.partition(":")
    return {"flag": f"--{key}", "env": f"env {key}", "kv": f"kv-transfer-config {key}",
            "doc": f"config file {key}", "volume": f"volume {key}",
            "mount": f"volumeMount {key}"}.get(kind, CONFIG_HASH_ANNOTATION)


def _render(slot: str, value: Wrapped) -> str:
    if value is None:
        return "(unset)"
    if slot.startswith("flag:"):
        return str(flag_value(value["v"], slot[5:]))
    if slot.startswith("env:"):
        entry = value["v"]
        return str(entry.get("value", "(valueFrom)"))
    return json.dumps(value["v"])
