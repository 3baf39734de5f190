"""The chart's objects in the local API server with the operator running against them for real
(kopf over HTTP; the server's simulator plays the Deployment/StatefulSet controllers).

`load_release` creates what a `helm install` of a values set would create, as far as the local
API server serves it (workloads, Services, ConfigMaps, the policy; not RBAC objects, whose
effect test_rbac.py evaluates itself). `drive_every_call` walks the operator through each kind
of request it makes, so that the RBAC test sees them all even when it runs alone.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from moonlease_dev.testbed.kube import (
    CONFIGMAPS,
    DEPLOYMENTS,
    STATEFULSETS,
    LocalApiServer,
    deployment_manifest,
    is_rollout_complete,
    statefulset_manifest,
)
from moonlease_operator.options import OperatorOptions
from moonlease_operator.peering import build_peering_crds
from moonlease_operator.runner import OperatorThread
from tests.chart.rendering import NAMESPACE, RELEASE, JsonObj

#: Reconcile often, retry fast (the simulator ticks every 20 ms); same as tests/fixtures/kube.py.
FAST_OPTIONS = OperatorOptions(reconcile_interval=0.1, error_delay=0.1, api_retries=3, api_backoff=0.01,
                               api_timeout=10.0)
WAIT = 20.0
SERVED_KINDS = ("ConfigMap", "Service", "Deployment", "StatefulSet")
OTHER_NAMESPACE = "team-b"


async def load_release(kube: LocalApiServer, objects: Sequence[JsonObj]) -> None:
    """Create the rendered workloads (policy last, as `helm install` orders custom resources) and
    wait until their controllers report them rolled out."""
    for obj in objects:
        if obj["kind"] in SERVED_KINDS:
            await kube.create(copy.deepcopy(obj))
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    await kube.wait_for(lambda: all(is_rollout_complete(current(kube, o)) for o in workloads), timeout=WAIT,
                        what="the release's workloads to roll out")
    for obj in objects:
        if obj["kind"] == "MooncakeLeasePolicy":
            await kube.create(copy.deepcopy(obj))


def current(kube: LocalApiServer, obj: Mapping[str, Any]) -> JsonObj:
    kind = DEPLOYMENTS if obj["kind"] == "Deployment" else STATEFULSETS
    return kube.get(kind, obj["metadata"]["namespace"], obj["metadata"]["name"]) or {}


def policy_status(kube: LocalApiServer, name: str = RELEASE, namespace: str = NAMESPACE) -> JsonObj:
    return (kube.get("mlp", namespace, name) or {}).get("status") or {}


async def wait_ready(kube: LocalApiServer, *, name: str = RELEASE, namespace: str = NAMESPACE,
                     revision: int = 1) -> JsonObj:
    def ready() -> bool:
        status = policy_status(kube, name, namespace)
        return status.get("phase") == "Ready" and status.get("appliedRevision") == revision
    try:
        await kube.wait_for(ready, timeout=WAIT, what=f"policy {namespace}/{name} Ready at revision {revision}")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; status: {json.dumps(policy_status(kube, name, namespace))[:2000]}") from None
    return policy_status(kube, name, namespace)


def extra_statefulset_target() -> tuple[JsonObj, JsonObj]:
    """A decode StatefulSet outside the chart (no connector config yet) and its policy target."""
    manifest = statefulset_manifest("extra-decode", namespace=NAMESPACE, replicas=1, containers=[
        {"name": "vllm", "image": "registry.local/moonlease/vllm-connector:0.1.0", "args": ["serve", "/models/m"]}])
    target = {"kind": "StatefulSet", "name": "extra-decode", "role": "decode", "container": "vllm",
              "mooncakeVersion": "0.3.14"}
    return manifest, target


def config_map_fleet(namespace: str) -> tuple[list[JsonObj], JsonObj]:
    """A master whose settings live in a ConfigMap (--config_path), a decode Deployment, and the
    policy over them."""
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "master-config", "namespace": namespace},
              "data": {"master.yaml": "rpc_port: 50051\n"}}
    master = deployment_manifest("mooncake-master", namespace=namespace, replicas=1, containers=[
        {"name": "master", "image": "registry.local/moonlease/mooncake:0.3.14", "command": ["mooncake_master"],
         "args": ["--config_path=/etc/mooncake/master.yaml"]}])
    decode = deployment_manifest("decode", namespace=namespace, replicas=1, containers=[
        {"name": "vllm", "image": "registry.local/moonlease/vllm-connector:0.1.0", "args": ["serve", "/models/m"]}])
    policy = {"apiVersion": "moonlease.io/v1alpha1", "kind": "MooncakeLeasePolicy",
              "metadata": {"name": "config-map-fleet", "namespace": namespace},
              "spec": {"master": {"name": "mooncake-master", "version": "0.3.14", "evictionRatio": 0.1,
                                  "configMap": {"name": "master-config", "key": "master.yaml"},
                                  "requireApprovalForRestart": False},
                       "targets": [{"name": "decode", "role": "decode", "mooncakeVersion": "0.3.14"}],
                       "rollout": {"stages": ["master", "decode"], "stageTimeoutSeconds": 30}}}
    return [config, master, decode], policy


async def drive_every_call(kube: LocalApiServer, chart_objects: Sequence[JsonObj], *,
                           namespaces: Sequence[str] = ()) -> None:
    """Run the operator (cluster-wide, or over `namespaces`) through every request it makes:

    1. the chart's release plus a StatefulSet target: the first patch of the StatefulSet meets
       a 409, so the operator reads it again (get);
    2. the policy switches to selective leasing: prefill's and decode's settings ConfigMaps are
       patched (the workloads are adopted already), the prefill's first patch meets a 409 (get,
       patch ConfigMaps; list pods while verifying);
    3. another namespace's policy keeps the master's settings in a ConfigMap (get, patch), its
       decode is adopted (its settings ConfigMap created) and its master's first patch meets a
       409 (get Deployments);
    4. the release's policy is deleted: the operator restores what it changed (label-selected
       lists of workloads and ConfigMaps, patches) and kopf releases its finalizer.
    """
    statefulset, target = extra_statefulset_target()
    objects = [copy.deepcopy(o) for o in chart_objects]
    policy = next(o for o in objects if o["kind"] == "MooncakeLeasePolicy")
    policy["spec"]["targets"].append(target)
    await kube.create(statefulset)
    for crd in build_peering_crds():  # the chart's crds/ (helm installs them before the templates)
        if kube.get("customresourcedefinitions", None, crd["metadata"]["name"]) is None:
            await kube.create(crd)
    for obj in objects:
        if obj["kind"] in ("ClusterKopfPeering", "KopfPeering"):
            await kube.create(copy.deepcopy(obj))
    deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-operator"))
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    peering = next(a.split("=", 1)[1] for a in args if a.startswith("--peering="))
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS, namespaces=list(namespaces),
                              peering=peering):
        kube.inject_failures(STATEFULSETS, NAMESPACE, "extra-decode", status=409, count=1)
        await load_release(kube, objects)
        await wait_ready(kube)

        kube.inject_failures(CONFIGMAPS, NAMESPACE, f"{RELEASE}-prefill-moonlease", status=409, count=1)
        await kube.patch("mlp", NAMESPACE, RELEASE, {"spec": {"connector": {"leaseMode": "selective"}}})
        await wait_ready(kube, revision=2)

        others, other_policy = config_map_fleet(OTHER_NAMESPACE)
        for obj in others:
            await kube.create(obj)
        kube.inject_failures(DEPLOYMENTS, OTHER_NAMESPACE, "mooncake-master", status=409, count=1)
        await kube.create(other_policy)
        await wait_ready(kube, name="config-map-fleet", namespace=OTHER_NAMESPACE)

        await kube.delete("mlp", NAMESPACE, RELEASE)
        await kube.wait_for(lambda: kube.get("mlp", NAMESPACE, RELEASE) is None, timeout=WAIT,
                            what="the policy's finalizer to be released")
