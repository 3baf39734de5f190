"""Whether a workload's rollout is complete, still going, or failed. Pure.

Complete means what `kubectl rollout status` means — the controller has observed the latest
generation and every replica is updated, ready and available — and, when pods are given, that
enough Ready pods carry the pod template's configuration hash: what was rolled out is what the
pods run (KServe #5987 shipped configs no pod ever ran). Failed means the Deployment reports
ProgressDeadlineExceeded, or a pod of the current template cannot start (CrashLoopBackOff,
image pull or config errors). Pods of an older template do not count either way: after a
rollback, the crashing pods of the abandoned template are not the rollback's failure.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moonlease_operator.api import LabelSelector
from moonlease_operator.core.pod_set import PodSet
from moonlease_operator.core.slots import CONFIG_HASH_ANNOTATION, same_flag_value, template_config_hash
from moonlease_operator.core.workload_args import find_container, flag_value

FAILING_REASONS = frozenset({
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})


class Health(str, enum.Enum):
    PROGRESSING = "Progressing"
    COMPLETE = "Complete"
    FAILED = "Failed"


@dataclass(frozen=True)
class WorkloadHealth:
    health: Health
    message: str
    generation: int | None = None
    replicas: int | None = None
    updated: int | None = None
    ready: int | None = None


def evaluate_health(obj: Mapping[str, Any], pods: Sequence[Mapping[str, Any]] | PodSet | None) -> WorkloadHealth:
    """The health of one Deployment or StatefulSet; `pods` (None: not looked at) are the pods
    of its namespace, of which those matching its selector are considered (a `PodSet` finds
    them through its label index: same answer)."""
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    status = obj.get("status") or {}
    generation = meta.get("generation")
    replicas = int(spec.get("replicas", 1))
    updated, ready = int(status.get("updatedReplicas", 0)), int(status.get("readyReplicas", 0))
    counts = {"generation": generation, "replicas": replicas, "updated": updated, "ready": ready}

    if int(status.get("observedGeneration", 0)) < int(generation or 1):
        return WorkloadHealth(Health.PROGRESSING, "waiting for the controller to observe the change", **counts)
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    progressing = conditions.get("Progressing") or {}
    if progressing.get("reason") == "ProgressDeadlineExceeded":
        return WorkloadHealth(Health.FAILED, f"rollout failed: {progressing.get('message', 'deadline exceeded')}",
                              **counts)
    current = [p for p in _own_pods(obj, pods or ()) if _pod_hash(p) == template_config_hash(obj)]
    for pod in current:
        reason = _failing_reason(pod)
        if reason is not None:
            return WorkloadHealth(Health.FAILED, f"pod {pod['metadata']['name']}: {reason}", **counts)

    if obj.get("kind") == "StatefulSet":
        done = (updated == replicas and ready == replicas
                and status.get("currentRevision") == status.get("updateRevision"))
    else:
        done = (updated == replicas and int(status.get("replicas", 0)) == replicas
                and int(status.get("availableReplicas", 0)) == replicas)
    if not done:
        return WorkloadHealth(Health.PROGRESSING, f"{updated}/{replicas} updated, {ready}/{replicas} ready", **counts)
    if pods is not None and template_config_hash(obj) is not None:
        running = sum(1 for p in current if _pod_ready(p))
        if running < replicas:
            return WorkloadHealth(Health.PROGRESSING,
                                  f"{running}/{replicas} ready pods run configuration {template_config_hash(obj)}",
                                  **counts)
    return WorkloadHealth(Health.COMPLETE, f"{replicas}/{replicas} updated and ready", **counts)


def evaluate_master_pod(pod: Mapping[str, Any], container: str | None,
                        flags: Mapping[str, str | None]) -> str | None:
    """None when the pod's running spec carries every flag as the policy spells it (`--name=value`,
    read as Mooncake reads it; a value None: the flag absent); otherwise which flags differ."""
    tokens = master_tokens(pod.get("spec") or {}, container)
    wrong = [f"--{name}={flag_value(tokens, name)} (wants {'it absent' if value is None else value})"
             for name, value in sorted(flags.items()) if not same_flag_value(flag_value(tokens, name), value)]
    if not wrong:
        return None
    return f"pod {(pod.get('metadata') or {}).get('name')}: runs {', '.join(wrong)}"


def master_tokens(pod_spec: Mapping[str, Any], container: str | None) -> list[str]:
    """The command line of the master container in a pod spec (a pod's, or a template's)."""
    found = find_container({"spec": {"template": {"spec": pod_spec}}}, container) or {}
    return [*(found.get("command") or []), *(found.get("args") or [])]


def restored_master_flags(obj: Mapping[str, Any], container: str | None, names: Iterable[str]) -> dict[str, str | None]:
    """The values the master's restored pod template gives the flags a policy set (None: absent),
    which its running pods must carry once a rollback is done."""
    template = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    tokens = master_tokens(template, container)
    return {name: flag_value(tokens, name) for name in names}


def current_ready_pods(obj: Mapping[str, Any], pods: Sequence[Mapping[str, Any]] | PodSet) -> list[Mapping[str, Any]]:
    """The workload's Ready pods of its current pod template (the ones a stage verifies)."""
    return [p for p in _own_pods(obj, pods) if _pod_hash(p) == template_config_hash(obj) and _pod_ready(p)]


def _own_pods(obj: Mapping[str, Any], pods: Sequence[Mapping[str, Any]] | PodSet) -> list[Mapping[str, Any]]:
    raw = (obj.get("spec") or {}).get("selector") or {}
    try:
        selector = LabelSelector.model_validate(raw)
    except ValueError:
        return []
    namespace = (obj.get("metadata") or {}).get("namespace")
    if isinstance(pods, PodSet):
        return [p for p in pods.selected(namespace, selector)
                if not (p.get("metadata") or {}).get("deletionTimestamp")]
    return [p for p in pods
            if (p.get("metadata") or {}).get("namespace", namespace) == namespace
            and not (p.get("metadata") or {}).get("deletionTimestamp")
            and selector.matches((p.get("metadata") or {}).get("labels") or {})]


def _pod_hash(pod: Mapping[str, Any]) -> str | None:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(CONFIG_HASH_ANNOTATION)


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _failing_reason(pod: Mapping[str, Any]) -> str | None:
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        reason = ((container.get("state") or {}).get("waiting") or {}).get("reason")
        if reason in FAILING_REASONS:
            return str(reason)
    return None
