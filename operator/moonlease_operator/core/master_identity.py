"""Which object is the Mooncake master: one answer for every path that writes. Pure.

Restarting the master empties the store, so every path that may restore or roll back an
object — the rollout, the release of a workload no longer covered (`spec.master.name` renamed),
the deletion of a policy whose spec is valid or not — asks here, and treats a master as a
master (approval, `MasterRestart` warning) whatever the spec now says.

An object is the master when the spec names it (the workload or its config ConfigMap), when the
last status listed it as the master, or when the object itself says so: a workload whose pod
template runs `mooncake_master`, or whose original snapshot holds master flags (`flag:` slots);
a ConfigMap the policy labelled that is not a target's settings ConfigMap (only the master's
file is ever labelled otherwise). `status.targets` alone cannot answer: it lists only the
targets that need attention, so it is empty for a policy at rest.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from moonlease_operator.api import PolicySpec, PolicySpecError, PolicyStatus, StageName
from moonlease_operator.core.connector_delivery import SETTINGS_CONFIG_MAP_LABEL
from moonlease_operator.core.slots import ORIGINAL_ANNOTATION, load_snapshot
from moonlease_operator.core.command_line import runs_mooncake_master

ObjectRef = tuple[str, str]  # (kind, name)


def declared_master(spec: PolicySpec | PolicySpecError, previous: PolicyStatus) -> frozenset[ObjectRef]:
    """The master workload and its ConfigMap as the spec names them (a valid spec), and the
    master the last status listed (kept for a rename or a spec no longer valid)."""
    refs = {(t.kind.value, t.name) for t in previous.targets if t.role is StageName.MASTER}
    if isinstance(spec, PolicySpec):
        refs.add((spec.master.kind.value, spec.master.name))
        if spec.master.config_map is not None:
            refs.add(("ConfigMap", spec.master.config_map.name))
    return frozenset(refs)


def is_master_object(obj: Mapping[str, Any], declared: Collection[ObjectRef] = ()) -> bool:
    """Whether `obj` (a workload or ConfigMap the policy changed) is the master or its file."""
    meta = obj.get("metadata") or {}
    ref = (str(obj.get("kind")), str(meta.get("name")))
    if ref in declared:
        return True
    if ref[0] == "ConfigMap":
        return (meta.get("labels") or {}).get(SETTINGS_CONFIG_MAP_LABEL) != "true"
    containers = (((obj.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
    if any(runs_mooncake_master(c) for c in containers if isinstance(c, Mapping)):
        return True
    original = load_snapshot(obj, ORIGINAL_ANNOTATION) or {}
    return any(str(slot).startswith("flag:") for slot in original.get("slots", {}))
