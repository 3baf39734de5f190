"""A local Kubernetes API server for tests and the demo: kmock's emulator made as strict as a real
API server where kopf and the operator depend on it, plus a simulator that plays the
Deployment/StatefulSet controllers.

Not pure: it serves HTTP on 127.0.0.1 from the caller's event loop. Callers are the pytest
fixtures (`tests/fixtures/kube.py`), `moonlease demo` and the benchmarks. Outside pytest::

    async with local_api_server() as kube:                 # CRDs + backbone, simulator ticking
        await kube.create(deployment_manifest("llama-decode", namespace="default"))
        async with OperatorThread(connection=kube.connection_info()):  # moonlease_operator.runner
            await kube.create(policy)                       # kopf handles it over HTTP
            await kube.wait_for(lambda: kube.get("mlp", "default", "fleet").get("status"))

Synchronous programs use `LocalApiServerThread` instead (the server in a thread of its own).

Modules, one concept each: `resources` (the served types), `patches`, `selectors`, `schemas`,
`validation`, `pagination`, `store_index`, `tables`, `openapi`, `openapi_protobuf` (the v2 document
as gnostic's protobuf), `wire` (protobuf's wire format, written), `protobuf` (request bodies, read),
`workloads`, `replicasets`, `cel` (pure helpers; none touches kmock's internals), `errors` (Status
bodies), `watches` (the watch cache), `calls` (request log, traffic), `faults` (injected
failures), `dispatch` (the reaction that serves a request, as kmock picks it, in time
independent of the server's age), `emulator` (the API server: what it emulates is listed there), `simulator` (the
workload controllers), `manifests`, `server` (the façade). Everything is re-exported here.
"""

from moonlease_dev.testbed.kube.calls import ApiCall, Traffic
from moonlease_dev.testbed.kube.emulator import ApiServerEmulator
from moonlease_dev.testbed.kube.faults import InjectedFault
from moonlease_dev.testbed.kube.manifests import deployment_manifest, namespace_manifest, statefulset_manifest
from moonlease_dev.testbed.kube.pagination import ContinueToken, decode_continue
from moonlease_dev.testbed.kube.patches import STRATEGIC_MERGE_KEYS, merge_patch, strategic_merge_patch
from moonlease_dev.testbed.kube.resources import (
    BUILTIN_RESOURCES,
    CLUSTERROLEBINDINGS,
    CLUSTERROLES,
    CONFIGMAPS,
    CRDS,
    DEPLOYMENTS,
    EVENTS,
    LEASES,
    NAMESPACES,
    PODDISRUPTIONBUDGETS,
    PODS,
    REPLICASETS,
    ROLEBINDINGS,
    ROLES,
    SECRETS,
    SERVICEACCOUNTS,
    SERVICES,
    STATEFULSETS,
    ResourceType,
)
from moonlease_dev.testbed.kube.schemas import apply_schema_defaults, prune_unknown_fields, schema_errors
from moonlease_dev.testbed.kube.selectors import (
    FieldTerm,
    SelectorTerm,
    match_field_selector,
    match_label_selector,
    parse_field_selector,
    parse_label_selector,
)
from moonlease_dev.testbed.kube.server import LocalApiServer, LocalApiServerThread, default_crds, local_api_server
from moonlease_dev.testbed.kube.simulator import (
    RolloutBehaviour,
    RolloutSimulator,
    WorkloadRollout,
    is_rollout_complete,
    template_revision,
)
from moonlease_dev.testbed.kube.timestamps import now_rfc3339
from moonlease_dev.testbed.kube.validation import MAX_ANNOTATIONS_BYTES, MAX_OBJECT_BYTES, MAX_REQUEST_BODY_BYTES, NameRule

__all__ = [
    "BUILTIN_RESOURCES", "CLUSTERROLEBINDINGS", "CLUSTERROLES", "CONFIGMAPS", "CRDS", "DEPLOYMENTS", "EVENTS", "LEASES", "MAX_ANNOTATIONS_BYTES",
    "MAX_OBJECT_BYTES", "MAX_REQUEST_BODY_BYTES", "NAMESPACES", "PODDISRUPTIONBUDGETS", "PODS", "REPLICASETS", "ROLEBINDINGS", "ROLES", "SECRETS",
    "SERVICEACCOUNTS", "SERVICES", "STATEFULSETS",
    "STRATEGIC_MERGE_KEYS", "ApiCall", "ApiServerEmulator", "ContinueToken", "FieldTerm", "InjectedFault",
    "LocalApiServer", "LocalApiServerThread", "NameRule", "ResourceType", "RolloutBehaviour", "RolloutSimulator",
    "SelectorTerm", "Traffic", "WorkloadRollout", "apply_schema_defaults", "decode_continue", "default_crds",
    "deployment_manifest", "is_rollout_complete", "local_api_server", "match_field_selector",
    "match_label_selector", "merge_patch", "namespace_manifest", "now_rfc3339", "parse_field_selector",
    "parse_label_selector", "prune_unknown_fields", "schema_errors", "statefulset_manifest",
    "strategic_merge_patch", "template_revision",
]
