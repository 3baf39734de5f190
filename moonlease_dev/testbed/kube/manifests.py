"""Minimal valid manifests for tests and the demo. Pure functions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

JsonObj = dict[str, Any]


def namespace_manifest(name: str) -> JsonObj:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def _workload(kind: str, name: str, namespace: str, replicas: int, containers: Sequence[Mapping[str, Any]] | None,
              labels: Mapping[str, str] | None) -> JsonObj:
    selector = {"app.kubernetes.io/name": name}
    pod_labels = {**selector, **(labels or {})}
    return {
        "apiVersion": "apps/v1", "kind": kind,
        "metadata": {"name": name, "namespace": namespace, "labels": dict(pod_labels)},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {"containers": [dict(c) for c in containers] if containers else
                         [{"name": "main", "image": "registry.local/app:1"}]},
            },
        },
    }


def deployment_manifest(name: str, *, namespace: str = "default", replicas: int = 2,
                        containers: Sequence[Mapping[str, Any]] | None = None,
                        labels: Mapping[str, str] | None = None) -> JsonObj:
    """A minimal valid apps/v1 Deployment (selector = app.kubernetes.io/name=<name>)."""
    return _workload("Deployment", name, namespace, replicas, containers, labels)


def statefulset_manifest(name: str, *, namespace: str = "default", replicas: int = 2,
                         containers: Sequence[Mapping[str, Any]] | None = None,
                         labels: Mapping[str, str] | None = None) -> JsonObj:
    """A minimal valid apps/v1 StatefulSet."""
    obj = _workload("StatefulSet", name, namespace, replicas, containers, labels)
    obj["spec"]["serviceName"] = name
    return obj

