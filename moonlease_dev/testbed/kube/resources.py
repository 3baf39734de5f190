"""The resource types the local API server serves: their addresses and discovery information.

Pure data (no I/O); `ResourceType.ref` builds a kmock resource reference for the emulator.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import kmock

from moonlease_dev.testbed.kube.validation import NameRule

@dataclass(frozen=True)
class ResourceType:
    """What the API server knows about one resource: its address and discovery information."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: frozenset[str] = frozenset()
    short_names: tuple[str, ...] = ()
    singular: str = ""
    custom: bool = False  # defined by a CRD: merge/JSON patches only, schema applies
    name_rule: NameRule = NameRule.DNS1123_SUBDOMAIN
    #: Field selector labels besides metadata.name and metadata.namespace (the real server
    #: refuses any other with 400 "field label not supported").
    field_labels: frozenset[str] = frozenset()

    @property
    def unconditional_update(self) -> bool:
        """Whether a PUT may omit metadata.resourceVersion: built-in kinds yes, custom resources
        no (their strategy's AllowUnconditionalUpdate is false)."""
        return not self.custom

    @property
    def qualified_kind(self) -> str:
        """How Status messages name the kind: `Deployment.apps`, `Pod`."""
        return f"{self.kind}.{self.group}" if self.group else self.kind

    @property
    def supported_field_labels(self) -> frozenset[str]:
        return frozenset({"metadata.name", "metadata.namespace"}) | self.field_labels

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @functools.cached_property
    def ref(self) -> kmock.resource:
        # Cached: building a kmock.resource is slow (a Protocol isinstance check), and the
        # simulator compares refs for every object on every tick.
        return kmock.resource(self.group, self.version, self.plural)

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        """The URL path of a collection, an object or a subresource."""
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{name}"
            if subresource:
                base += f"/{subresource}"
        return base


VERBS = ("create", "delete", "get", "list", "patch", "update", "watch")

NAMESPACES = ResourceType("", "v1", "namespaces", "Namespace", False, frozenset({"status"}), ("ns",),
                          name_rule=NameRule.DNS1123_LABEL, field_labels=frozenset({"status.phase"}))
CRDS = ResourceType("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
                    False, frozenset({"status"}), ("crd", "crds"))
EVENTS = ResourceType("", "v1", "events", "Event", True, short_names=("ev",), field_labels=frozenset({
    "involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
    "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason",
    "reportingComponent", "source", "type"}))
CONFIGMAPS = ResourceType("", "v1", "configmaps", "ConfigMap", True, short_names=("cm",))
SECRETS = ResourceType("", "v1", "secrets", "Secret", True, field_labels=frozenset({"type"}))
SERVICES = ResourceType("", "v1", "services", "Service", True, frozenset({"status"}), ("svc",),
                        name_rule=NameRule.DNS1035_LABEL)
PODS = ResourceType("", "v1", "pods", "Pod", True, frozenset({"status"}), ("po",), field_labels=frozenset({
    "spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName", "spec.hostNetwork",
    "status.phase", "status.podIP", "status.podIPs", "status.nominatedNodeName"}))
DEPLOYMENTS = ResourceType("apps", "v1", "deployments", "Deployment", True,
                           frozenset({"status", "scale"}), ("deploy",))
REPLICASETS = ResourceType("apps", "v1", "replicasets", "ReplicaSet", True, frozenset({"status", "scale"}), ("rs",))
STATEFULSETS = ResourceType("apps", "v1", "statefulsets", "StatefulSet", True,
                            frozenset({"status", "scale"}), ("sts",))
LEASES = ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True)
SERVICEACCOUNTS = ResourceType("", "v1", "serviceaccounts", "ServiceAccount", True, short_names=("sa",))
PODDISRUPTIONBUDGETS = ResourceType("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True,
                                    frozenset({"status"}), ("pdb",))
_RBAC = "rbac.authorization.k8s.io"
ROLES = ResourceType(_RBAC, "v1", "roles", "Role", True, name_rule=NameRule.PATH_SEGMENT)
ROLEBINDINGS = ResourceType(_RBAC, "v1", "rolebindings", "RoleBinding", True, name_rule=NameRule.PATH_SEGMENT)
CLUSTERROLES = ResourceType(_RBAC, "v1", "clusterroles", "ClusterRole", False, name_rule=NameRule.PATH_SEGMENT)
CLUSTERROLEBINDINGS = ResourceType(_RBAC, "v1", "clusterrolebindings", "ClusterRoleBinding", False,
                                   name_rule=NameRule.PATH_SEGMENT)

#: Served from the start: what kopf scans (namespaces, CRDs, events), what the operator touches,
#: and the kinds the Helm chart installs (Secrets hold Helm's releases).
BUILTIN_RESOURCES: tuple[ResourceType, ...] = (
    NAMESPACES, CRDS, EVENTS, CONFIGMAPS, SECRETS, SERVICES, PODS, DEPLOYMENTS, REPLICASETS, STATEFULSETS, LEASES,
    SERVICEACCOUNTS, PODDISRUPTIONBUDGETS, ROLES, ROLEBINDINGS, CLUSTERROLES, CLUSTERROLEBINDINGS,
)

