"""kopf's peering resources, which the operator's replicas use to elect the one that acts. Pure.

kopf ships no CRDs; its documentation gives these two (cluster-wide and per namespace). Every
replica writes a keep-alive with its priority into the peering object's `status`; a replica that
sees a live peer with a higher priority pauses (its daemons stop) until that peer's keep-alive
expires. `moonlease operator --peering NAME` gives each replica a random priority, so exactly
one acts (see `moonlease_operator.runner.choose_priority`). The chart installs the CRDs
(`charts/moonlease/crds/kopf-peerings.yaml`, checked against `build_peering_crds` by a unit
test) and the peering object(s).
"""

from __future__ import annotations

from typing import Any

PEERING_GROUP = "kopf.dev"
PEERING_VERSION = "v1"


def _peering_crd(kind: str, plural: str, scope: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{PEERING_GROUP}"},
        "spec": {
            "scope": scope,
            "group": PEERING_GROUP,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [{
                "name": PEERING_VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
                    "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}},
            }],
        },
    }


def build_peering_crds() -> list[dict[str, Any]]:
    """ClusterKopfPeering (an operator watching every namespace) and KopfPeering (one per
    watched namespace). No status subresource: kopf patches `status` on the object itself."""
    return [_peering_crd("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
            _peering_crd("KopfPeering", "kopfpeerings", "Namespaced")]


def build_peering_object(name: str, namespace: str | None = None) -> dict[str, Any]:
    """The peering object the replicas share: cluster-wide, or in one watched namespace."""
    kind = "ClusterKopfPeering" if namespace is None else "KopfPeering"
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    return {"apiVersion": f"{PEERING_GROUP}/{PEERING_VERSION}", "kind": kind, "metadata": meta}
