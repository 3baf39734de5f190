"""Deployments and StatefulSets as the API server admits them: the validation and defaulting of
the fields the operator, the chart and kubectl use, and the `scale` subresource's view. Pure.

Validation (422 lines as the API server words them): `spec.replicas` at least 0, a selector that
is set, not empty and matches the pod template's labels, at least one container, each with a
name and an image. Defaulting (apps/v1): `replicas` 1, `revisionHistoryLimit` 10; Deployments
`progressDeadlineSeconds` 600 and a RollingUpdate strategy of 25%/25%; StatefulSets
`podManagementPolicy` OrderedReady and a RollingUpdate strategy of partition 0. The pod
template's own defaults (imagePullPolicy, terminationMessagePath, ...) are left out: the
simulated controllers do not read them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from moonlease_dev.testbed.kube.selectors import match_label_selector, parse_label_selector
from moonlease_dev.testbed.kube.validation import ErrorType, FieldError

JsonObj = dict[str, Any]

WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet"})


def default_workload(obj: JsonObj) -> JsonObj:
    """Fill apps/v1's defaults for the fields left unset, in place (the emulator admits its own
    copy of every write; copying a workload again on each of the simulator's status writes
    would cost at fleet scale); returns `obj`."""
    result = obj
    spec = result.setdefault("spec", {})
    spec.setdefault("replicas", 1)
    spec.setdefault("revisionHistoryLimit", 10)
    if obj.get("kind") == "Deployment":
        spec.setdefault("progressDeadlineSeconds", 600)
        strategy = spec.setdefault("strategy", {})
        strategy.setdefault("type", "RollingUpdate")
        if strategy["type"] == "RollingUpdate":
            rolling = strategy.setdefault("rollingUpdate", {})
            rolling.setdefault("maxUnavailable", "25%")
            rolling.setdefault("maxSurge", "25%")
    else:
        spec.setdefault("podManagementPolicy", "OrderedReady")
        strategy = spec.setdefault("updateStrategy", {})
        strategy.setdefault("type", "RollingUpdate")
        if strategy["type"] == "RollingUpdate":
            strategy.setdefault("rollingUpdate", {}).setdefault("partition", 0)
    return result


def _selector_text(selector: Mapping[str, Any]) -> str:
    terms = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression.get("key"), expression.get("operator"), expression.get("values") or []
        match operator:
            case "In" | "NotIn":
                terms.append(f"{key} {operator.lower()} ({','.join(values)})")
            case "Exists":
                terms.append(str(key))
            case "DoesNotExist":
                terms.append(f"!{key}")
    return ",".join(terms)


def workload_errors(obj: Mapping[str, Any]) -> list[FieldError]:
    """What the API server refuses in a Deployment's or StatefulSet's spec."""
    spec = obj.get("spec") or {}
    problems = []
    replicas = spec.get("replicas")
    if not isinstance(replicas, int) or isinstance(replicas, bool):
        problems.append(FieldError("spec.replicas", ErrorType.INVALID, "must be an integer", replicas))
    elif replicas < 0:
        problems.append(FieldError("spec.replicas", ErrorType.INVALID, "must be greater than or equal to 0",
                                   replicas))
    selector = spec.get("selector")
    labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    if not isinstance(selector, Mapping):
        problems.append(FieldError("spec.selector", ErrorType.REQUIRED, ""))
    elif not selector.get("matchLabels") and not selector.get("matchExpressions"):
        problems.append(FieldError("spec.selector", ErrorType.INVALID,
                                   f"empty selector is invalid for {str(obj.get('kind', '')).lower()}", selector))
    else:
        try:
            matches = match_label_selector(parse_label_selector(_selector_text(selector)), labels)
        except ValueError:
            matches = False
        if not matches:
            problems.append(FieldError("spec.template.metadata.labels", ErrorType.INVALID,
                                       "`selector` does not match template `labels`", labels))
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or []
    if not containers:
        problems.append(FieldError("spec.template.spec.containers", ErrorType.REQUIRED, ""))
    for index, container in enumerate(containers):
        for key in ("name", "image"):
            if not container.get(key):
                problems.append(FieldError(f"spec.template.spec.containers[{index}].{key}", ErrorType.REQUIRED, ""))
    return problems


def scale_view(obj: Mapping[str, Any]) -> JsonObj:
    """The `autoscaling/v1 Scale` a workload's `/scale` subresource shows."""
    meta = obj.get("metadata") or {}
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    return {
        "kind": "Scale", "apiVersion": "autoscaling/v1",
        "metadata": {key: meta[key] for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                     if key in meta},
        "spec": {"replicas": spec.get("replicas", 1)},
        "status": {"replicas": status.get("replicas", 0),
                   "selector": _selector_text(spec.get("selector") or {})},
    }


def scaled(obj: Mapping[str, Any], scale: Mapping[str, Any]) -> JsonObj:
    """The workload with the replicas a written Scale asks for (the rest of the Scale is ignored,
    as the API server ignores it)."""
    result = copy.deepcopy(dict(obj))
    result.setdefault("spec", {})["replicas"] = (scale.get("spec") or {}).get("replicas")
    return result
