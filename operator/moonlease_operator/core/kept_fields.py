"""What the operator's watch caches keep of each object: only what the planner reads (issue 16).
Pure: functions of plain dicts.

5,000 Deployments of a realistic size (about 7 KiB of JSON, 42 KiB as Python objects) do not fit
a 256 MiB operator whole. The planner reads of a workload its metadata (labels, annotations,
generation, resourceVersion), `spec.replicas`/`selector`, its status, and of the pod template:
its metadata, volumes and, per container, the name, image, command, args, volumeMounts and the
env vars of Moonlease, Mooncake and vLLM's Mooncake store (`KEPT_ENV_PREFIXES`). Everything else
(kubectl's last-applied annotation, resources, probes, ports, other env vars) is dropped as each
object arrives, and of `managedFields` a workload or ConfigMap keeps only each entry's manager,
operation, time and the top two levels of its fields (`core.conflicts.prune_managed_fields`:
enough to name another writer that keeps reverting the operator's changes); a pod keeps none.

Writes stay exact because workloads are patched with a strategic merge patch
(`merge_patches.build_strategic_merge_patch`): containers, env vars, volumes and mounts are patched
element by element, so what the cache dropped is never part of a patch. Pods are only read
(health, the settings endpoint), never written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moonlease_operator.core.conflicts import prune_managed_fields

JsonObj = dict[str, Any]
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
#: Env vars the planner reads (the connector's settings file and port, the selective-lease
#: switch, Mooncake's config path): any other is dropped from the cached copy.
KEPT_ENV_PREFIXES = ("MOONLEASE_", "VLLM_MOONCAKE_", "MOONCAKE_")
KEPT_CONTAINER_FIELDS = ("name", "image", "command", "args", "env", "volumeMounts")
KEPT_POD_STATUS_FIELDS = ("phase", "podIP", "conditions", "containerStatuses")


def trim_metadata(meta: Mapping[str, Any], *, writers: bool = False) -> JsonObj:
    """Metadata without kubectl's last-applied copy of the object, and without `managedFields`
    — or, `writers`, with only who wrote which part of it (`prune_managed_fields`)."""
    kept = {k: v for k, v in meta.items() if k != "managedFields"}
    if writers and meta.get("managedFields"):
        kept["managedFields"] = prune_managed_fields(meta["managedFields"])
    annotations = kept.get("annotations")
    if annotations and LAST_APPLIED in annotations:
        kept["annotations"] = {k: v for k, v in annotations.items() if k != LAST_APPLIED}
    return kept


def trim_container(container: Mapping[str, Any]) -> JsonObj:
    """A container as the planner reads it; an `env` it had stays a list (maybe empty), so that
    the shape the undo records (`has:env`) is the real one."""
    kept = {k: container[k] for k in KEPT_CONTAINER_FIELDS if k in container}
    if "env" in kept:
        kept["env"] = [e for e in kept["env"] or [] if str((e or {}).get("name", "")).startswith(KEPT_ENV_PREFIXES)]
    return kept


def trim_pod_spec(spec: Mapping[str, Any]) -> JsonObj:
    kept = dict(spec)
    for field in ("containers", "initContainers"):
        if isinstance(spec.get(field), list):
            kept[field] = [trim_container(c) for c in spec[field]]
    return kept


def trim_workload(obj: Mapping[str, Any], kind: str) -> JsonObj:
    """A Deployment or StatefulSet as the cache keeps it (see the module docstring)."""
    kept = {**obj, "kind": kind, "metadata": trim_metadata(obj.get("metadata") or {}, writers=True)}
    spec = obj.get("spec") or {}
    template = spec.get("template")
    if isinstance(template, Mapping) and isinstance(template.get("spec"), Mapping):
        kept["spec"] = {**spec, "template": {**template, "spec": trim_pod_spec(template["spec"])}}
    return kept


def trim_pod(obj: Mapping[str, Any]) -> JsonObj:
    """A pod as the cache keeps it: metadata, containers and volumes (by name), and the status
    the health check and the settings scrape read."""
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    return {
        "kind": "Pod", "metadata": trim_metadata(obj.get("metadata") or {}),
        "spec": {"containers": [trim_container(c) for c in spec.get("containers") or []],
                 "volumes": [{"name": v.get("name")} for v in spec.get("volumes") or [] if isinstance(v, Mapping)]},
        "status": {k: status[k] for k in KEPT_POD_STATUS_FIELDS if k in status},
    }


def trim_object(obj: Mapping[str, Any], kind: str) -> JsonObj:
    """The object of `kind` as the caches keep it: workloads and pods trimmed to what the
    planner reads, anything else (ConfigMaps) without its bookkeeping metadata."""
    if kind in ("Deployment", "StatefulSet"):
        return trim_workload(obj, kind)
    if kind == "Pod":
        return trim_pod(obj)
    return {**obj, "kind": kind, "metadata": trim_metadata(obj.get("metadata") or {}, writers=True)}
