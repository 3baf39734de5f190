"""The chart's objects in the local API server with the operator running against them for real
(kopf over HTTP; the server's simulator plays the Deployment/StatefulSet controllers).

`helm_install` installs the chart with a values set as a user would: `helm install`, through the
Helm SDK (helm-python-sdk: Helm 4's Go SDK, server-side apply), waiting until what it created
is ready. `drive_every_call` walks the operator through each kind of request it makes, so that
the RBAC test sees them all even when it runs alone.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

import helm_python as helm
import yaml

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
from moonlease_operator.runner import OperatorThread
from tests.chart.rendering import CHART_DIR, NAMESPACE, RELEASE, JsonObj, manifests

#: Reconcile often, retry fast (the simulator ticks every 20 ms); same as tests/fixtures/kube.py.
FAST_OPTIONS = OperatorOptions(reconcile_interval=0.1, error_delay=0.1, api_retries=3, api_backoff=0.01,
                               api_timeout=10.0)
WAIT = 20.0
OTHER_NAMESPACE = "team-b"


async def helm_install(kube: LocalApiServer, values: Mapping[str, Any] | None = None) -> list[JsonObj]:
    """`helm install moonlease charts/moonlease -n inference` with `values`, through the Helm SDK,
    then a wait until the release's workloads are rolled out (read in process: Helm's own
    `--wait` watches every kind it installed, about a second more per install here); the
    objects it installed (the release's manifest). Helm's calls block: they run in a thread
    while this loop serves them."""
    kubeconfig = yaml.safe_dump(kube.kubeconfig(namespace=NAMESPACE))
    with helm.Config(kubeconfig_content=kubeconfig, namespace=NAMESPACE) as config:
        release = await asyncio.to_thread(config.install, str(CHART_DIR), RELEASE, copy.deepcopy(dict(values or {})),
                                          namespace=NAMESPACE, timeout=int(WAIT))
    assert (release["status"], release["revision"]) == ("deployed", 1), release
    objects = manifests({"manifest": release["manifest"]})
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    await kube.wait_for(lambda: all(is_rollout_complete(current(kube, o)) for o in workloads), timeout=WAIT,
                        what="the release's workloads to roll out")
    return objects


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


async def drive_every_call(kube: LocalApiServer, values: Mapping[str, Any], *,
                           namespaces: Sequence[str] = ()) -> list[JsonObj]:
    """Run the operator (cluster-wide, or over `namespaces`) through every request it makes, and
    return what the release installed:

    1. the chart installed with `values` and a StatefulSet target (`policy.targets`), then the
       operator started (as the release's operator pod would, with its peering): the first patch
       of the StatefulSet meets a 409, so the operator reads it again (get);
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
    await kube.create(statefulset)
    with_target: dict[str, Any] = copy.deepcopy(dict(values))
    with_target.setdefault("policy", {}).setdefault("targets", []).append(target)
    objects = await helm_install(kube, with_target)  # the CRDs of crds/ first, the peering object(s) with the rest
    deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-operator"))
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    peering = next(a.split("=", 1)[1] for a in args if a.startswith("--peering="))
    kube.inject_failures(STATEFULSETS, NAMESPACE, "extra-decode", status=409, count=1)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS, namespaces=list(namespaces),
                              peering=peering):
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
    return objects
