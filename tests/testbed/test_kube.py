"""The local Kubernetes API server: what it adds to kmock, the rollout simulator, and kopf (the
Moonlease operator) running against it for real over HTTP."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import aiohttp
import kubernetes.client
import kubernetes.config
import pytest

from moonlease_dev.testbed.kube.simulator import workload_of
from moonlease_dev.testbed.kube import (
    DEPLOYMENTS,
    LocalApiServerThread,
    PODS,
    REPLICASETS,
    STATEFULSETS,
    LocalApiServer,
    apply_schema_defaults,
    local_api_server,
    deployment_manifest,
    is_rollout_complete,
    match_field_selector,
    match_label_selector,
    merge_patch,
    parse_label_selector,
    prune_unknown_fields,
    statefulset_manifest,
    strategic_merge_patch,
)
from moonlease_dev.testbed.processes import free_port
from moonlease_operator.runner import OperatorThread
from tests.fixtures.kube import FAST_OPTIONS

pytestmark = pytest.mark.operator

ROOT = Path(__file__).resolve().parents[2]
POLICY_PATH = "/apis/moonlease.io/v1alpha1/namespaces/default/mooncakeleasepolicies"


def policy(name: str = "fleet", **spec_changes: Any) -> dict[str, Any]:
    spec = {"master": {"name": "mooncake-master"},
            "targets": [{"name": "llama-prefill", "role": "prefill"}, {"name": "llama-decode", "role": "decode"}]}
    spec.update(spec_changes)
    return {"apiVersion": "moonlease.io/v1alpha1", "kind": "MooncakeLeasePolicy",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}


async def http(kube: LocalApiServer, method: str, path: str, body: Any = None, *,
               content_type: str = "application/json", params: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        data = None if body is None else json.dumps(body)
        async with session.request(method, kube.url + path, data=data, params=params,
                                   headers={"Content-Type": content_type}) as rsp:
            return rsp.status, await rsp.json()


def rv(obj: dict[str, Any]) -> int:
    return int(obj["metadata"]["resourceVersion"])


# ---- pure helpers ---------------------------------------------------------------------------------

def test_merge_patch_is_rfc7386() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1, 2]}, {"a": {"b": None, "d": 3}, "l": [3]}) == \
        {"a": {"c": 2, "d": 3}, "l": [3]}


def test_strategic_merge_patch_merges_containers_by_name() -> None:
    current = {"spec": {"containers": [
        {"name": "vllm", "args": ["--a"], "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]},
        {"name": "sidecar", "image": "s:1"}]}}
    patch = {"spec": {"containers": [{"name": "vllm", "args": ["--b"],
                                      "env": [{"name": "Y", "value": "3"}, {"name": "X", "$patch": "delete"}]}],
                      "$setElementOrder/containers": [{"name": "vllm"}, {"name": "sidecar"}]}}
    assert strategic_merge_patch(current, patch) == {"spec": {"containers": [
        {"name": "vllm", "args": ["--b"], "env": [{"name": "Y", "value": "3"}]},
        {"name": "sidecar", "image": "s:1"}]}}
    assert merge_patch(current, patch)["spec"]["containers"][0].get("image") is None  # plain merge loses it


@pytest.mark.parametrize(("selector", "labels", "expected"), [
    ("app=a", {"app": "a"}, True),
    ("app==a,tier!=db", {"app": "a", "tier": "db"}, False),
    ("app in (a, b),!legacy", {"app": "b"}, True),
    ("app notin (a),role", {"app": "c"}, False),
    ("role", {"role": ""}, True),
])
def test_label_selectors(selector: str, labels: dict[str, str], expected: bool) -> None:
    assert match_label_selector(parse_label_selector(selector), labels) is expected


def test_field_selectors() -> None:
    event = {"metadata": {"name": "e"}, "involvedObject": {"kind": "Pod", "name": "p"}}
    assert match_field_selector("involvedObject.name=p,involvedObject.kind!=Deployment", event)
    assert not match_field_selector("metadata.name=other", event)


def test_schema_defaulting_and_pruning() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "default": {}, "properties": {"b": {"type": "integer", "default": 3}}},
        "c": {"type": "string"}}}
    assert apply_schema_defaults({}, schema) == {"a": {"b": 3}}
    assert prune_unknown_fields({"a": {"b": 1, "x": 2}, "c": None, "y": 1}, schema) == ({"a": {"b": 1}}, ["a.x", "y"])


# ---- the API server semantics kopf relies on -----------------------------------------------------------

async def test_discovery_serves_the_crd_with_its_status_subresource(kube_manual: LocalApiServer) -> None:
    status, body = await http(kube_manual, "GET", "/apis/moonlease.io/v1alpha1")
    assert status == 200
    names = {r["name"]: r for r in body["resources"]}
    assert names["mooncakeleasepolicies"]["kind"] == "MooncakeLeasePolicy"
    assert names["mooncakeleasepolicies"]["shortNames"] == ["mlp"] and "mooncakeleasepolicies/status" in names
    status, core = await http(kube_manual, "GET", "/api/v1")
    assert core["groupVersion"] == "v1" and {"events", "pods", "namespaces"} <= {r["name"] for r in core["resources"]}
    crd = kube_manual.get("customresourcedefinitions", None, "mooncakeleasepolicies.moonlease.io")
    assert crd is not None and {c["type"] for c in crd["status"]["conditions"]} == {"NamesAccepted", "Established"}


async def test_resource_version_and_generation(kube_manual: LocalApiServer) -> None:
    status, created = await http(kube_manual, "POST", POLICY_PATH, policy())
    assert status == 201 and created["metadata"]["generation"] == 1 and created["metadata"]["uid"]
    path = f"{POLICY_PATH}/fleet"

    _, labelled = await http(kube_manual, "PATCH", path, {"metadata": {"labels": {"x": "y"}}},
                             content_type="application/merge-patch+json")
    assert rv(labelled) > rv(created) and labelled["metadata"]["generation"] == 1  # metadata: no new generation

    _, respec = await http(kube_manual, "PATCH", path, {"spec": {"connector": {"leaseMode": "selective"}}},
                           content_type="application/merge-patch+json")
    assert rv(respec) > rv(labelled) and respec["metadata"]["generation"] == 2

    _, same = await http(kube_manual, "PATCH", path, {"spec": {"connector": {"leaseMode": "selective"}}},
                         content_type="application/merge-patch+json")
    assert rv(same) == rv(respec)  # a no-op write is not a new version

    # kopf's finalizer/progress writes: a JSON patch guarded by a resourceVersion test.
    stale = [{"op": "test", "path": "/metadata/resourceVersion", "value": str(rv(created))},
             {"op": "add", "path": "/metadata/finalizers", "value": ["moonlease.io/finalizer"]}]
    status, error = await http(kube_manual, "PATCH", path, stale, content_type="application/json-patch+json")
    assert status == 422 and error["kind"] == "Status"
    fresh = [{**stale[0], "value": str(rv(respec))}, stale[1]]
    status, finalized = await http(kube_manual, "PATCH", path, fresh, content_type="application/json-patch+json")
    assert status == 200 and finalized["metadata"]["finalizers"] == ["moonlease.io/finalizer"]

    status, _ = await http(kube_manual, "PUT", path, {**finalized, "metadata": {**finalized["metadata"],
                                                                                "resourceVersion": "1"}})
    assert status == 409

    # Deletion waits for the finalizer; removing it deletes the object.
    status, deleting = await http(kube_manual, "DELETE", path)
    assert status == 200 and deleting["metadata"]["deletionTimestamp"]
    assert kube_manual.get("mlp", "default", "fleet") is not None
    await http(kube_manual, "PATCH", path, {"metadata": {"finalizers": None}},
               content_type="application/merge-patch+json")
    assert kube_manual.get("mlp", "default", "fleet") is None
    versions = [int(v["metadata"]["resourceVersion"]) for v in kube_manual.history("mlp", "default", "fleet") if v]
    assert versions == sorted(set(versions))


async def test_status_subresource_separates_spec_and_status(kube_manual: LocalApiServer) -> None:
    await kube_manual.create(policy())
    path = f"{POLICY_PATH}/fleet"
    await http(kube_manual, "PATCH", path, {"status": {"phase": "Ready"}, "spec": {"connector": {"leaseMode": "selective"}}},
               content_type="application/merge-patch+json")
    obj = kube_manual.get("mlp", "default", "fleet")
    assert obj is not None and "status" not in obj and obj["spec"]["connector"]["leaseMode"] == "selective"
    await http(kube_manual, "PATCH", f"{path}/status", {"status": {"phase": "Ready"}, "spec": {"connector": None}},
               content_type="application/merge-patch+json")
    obj = kube_manual.get("mlp", "default", "fleet")
    assert obj is not None and obj["status"] == {"phase": "Ready"} and obj["spec"]["connector"]["leaseMode"] == "selective"
    assert obj["metadata"]["generation"] == 2


async def test_custom_resources_are_defaulted_pruned_and_validated(kube_manual: LocalApiServer) -> None:
    body = policy()
    body["spec"]["master"]["evictionWatermark"] = 0.9  # a typo: not in the schema
    status, created = await http(kube_manual, "POST", POLICY_PATH, body)
    assert status == 201
    assert "evictionWatermark" not in created["spec"]["master"]
    assert created["spec"]["rollout"]["stages"] == ["master", "prefill", "decode"]
    assert created["spec"]["connector"] == {"leaseMode": "leaseAll", "junctionRetention": False,
                                           "retentionSkip": False, "retentionPin": False,
                                           "retentionRetry": False, "retentionEvict": False}

    strict_status, strict = await http(kube_manual, "POST", POLICY_PATH, {**body, "metadata": {"name": "strict"}},
                                       params={"fieldValidation": "Strict"})
    assert strict_status == 400 and "spec.master.evictionWatermark" in strict["message"]

    bad = policy("bad")
    bad["spec"]["master"]["evictionRatio"] = 0
    status, error = await http(kube_manual, "POST", POLICY_PATH, bad)
    assert status == 422 and "spec.master.evictionRatio" in error["message"]
    assert kube_manual.get("mlp", "default", "bad") is None

    status, _ = await http(kube_manual, "PATCH", f"{POLICY_PATH}/fleet/status", {"status": {"phase": "Sideways"}},
                           content_type="application/merge-patch+json")
    assert status == 422
    status, _ = await http(kube_manual, "PATCH", f"{POLICY_PATH}/fleet", {"spec": {"master": None}},
                           content_type="application/strategic-merge-patch+json")
    assert status == 415  # custom resources take no strategic merge patches


async def test_namespaces_names_and_lists(kube_manual: LocalApiServer) -> None:
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": "ev-"}, "reason": "R",
             "involvedObject": {"kind": "Pod", "name": "p"}}
    _, first = await http(kube_manual, "POST", "/api/v1/namespaces/default/events", event)
    _, second = await http(kube_manual, "POST", "/api/v1/namespaces/default/events", event)
    assert first["metadata"]["name"].startswith("ev-") and first["metadata"]["name"] != second["metadata"]["name"]
    status, _ = await http(kube_manual, "POST", "/api/v1/namespaces/nowhere/events", event)
    assert status == 404
    status, _ = await http(kube_manual, "POST", "/api/v1/namespaces/default/events", {**event, "metadata": {"name": first["metadata"]["name"]}})
    assert status == 409

    for name, tier in (("a", "web"), ("b", "db")):
        await kube_manual.create(deployment_manifest(name, labels={"tier": tier}))
    status, listed = await http(kube_manual, "GET", "/apis/apps/v1/deployments", params={"labelSelector": "tier=db"})
    assert listed["kind"] == "DeploymentList" and [d["metadata"]["name"] for d in listed["items"]] == ["b"]
    assert int(listed["metadata"]["resourceVersion"]) == kube_manual.emulator.resource_version


async def test_namespaces_over_http(kube_manual: LocalApiServer) -> None:
    # kmock 0.8 cannot parse these paths by itself (a 500 on the list, discovery on the fetch).
    status, created = await http(kube_manual, "POST", "/api/v1/namespaces",
                                 {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}})
    assert status == 201 and created["metadata"]["name"] == "team-a"
    status, listed = await http(kube_manual, "GET", "/api/v1/namespaces")
    assert status == 200 and {n["metadata"]["name"] for n in listed["items"]} == {"default", "team-a"}
    status, fetched = await http(kube_manual, "GET", "/api/v1/namespaces/team-a")
    assert status == 200 and fetched["kind"] == "Namespace"
    status, _ = await http(kube_manual, "DELETE", "/api/v1/namespaces/team-a")
    assert status == 200 and kube_manual.get("namespaces", None, "team-a") is None


async def test_watch_streams_matching_changes(kube_manual: LocalApiServer) -> None:
    await kube_manual.create(deployment_manifest("old", labels={"tier": "web"}))
    events: list[tuple[str, str]] = []

    async def watch() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.get(kube_manual.url + "/apis/apps/v1/namespaces/default/deployments",
                                   params={"watch": "true", "labelSelector": "tier=web", "timeoutSeconds": "2"}) as rsp:
                async for line in rsp.content:
                    if line.strip():
                        event = json.loads(line)
                        events.append((event["type"], event["object"]["metadata"]["name"]))
                        if len(events) == 3:
                            return

    task = asyncio.create_task(watch())
    await kube_manual.wait_for(lambda: events, what="the initial ADDED event")
    await kube_manual.create(deployment_manifest("other", labels={"tier": "db"}))
    await kube_manual.create(deployment_manifest("new", labels={"tier": "web"}))
    await kube_manual.patch(DEPLOYMENTS, "default", "old", {"spec": {"replicas": 3}})
    await asyncio.wait_for(task, 5)
    assert events == [("ADDED", "old"), ("ADDED", "new"), ("MODIFIED", "old")]


async def test_deleting_a_workload_deletes_its_pods(kube_manual: LocalApiServer) -> None:
    await kube_manual.create(deployment_manifest("web", replicas=2))
    for _ in range(3):
        await kube_manual.simulator.tick()
    assert len(kube_manual.list(PODS, "default")) == 2
    await kube_manual.delete(DEPLOYMENTS, "default", "web")
    assert kube_manual.list(PODS, "default") == []


async def test_injected_failures_answer_before_anything_changes(kube_manual: LocalApiServer) -> None:
    await kube_manual.create(deployment_manifest("web"))
    path = "/apis/apps/v1/namespaces/default/deployments/web"
    before = kube_manual.get(DEPLOYMENTS, "default", "web")
    conflict = kube_manual.inject_failures(DEPLOYMENTS, "default", "web", status=409, count=2)
    outage = kube_manual.inject_failures(DEPLOYMENTS, status=503, count=1, verbs=("list",))
    patch = {"spec": {"replicas": 5}}
    for _ in range(2):
        status, body = await http(kube_manual, "PATCH", path, patch, content_type="application/merge-patch+json")
        assert (status, body["reason"]) == (409, "Conflict")
    assert kube_manual.get(DEPLOYMENTS, "default", "web") == before  # refused before touching it
    status, body = await http(kube_manual, "PATCH", path, patch, content_type="application/merge-patch+json")
    assert status == 200 and body["spec"]["replicas"] == 5 and conflict.fired == 2 and conflict.remaining == 0
    status, _ = await http(kube_manual, "GET", "/apis/apps/v1/namespaces/default/deployments")
    assert status == 503 and outage.fired == 1
    status, _ = await http(kube_manual, "GET", "/apis/apps/v1/namespaces/default/deployments")
    assert status == 200


async def test_kubernetes_client_and_kubeconfig_reach_the_server(kube_manual: LocalApiServer, tmp_path: Path) -> None:
    def with_client() -> list[str]:
        api = kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(kube_manual.kubernetes_configuration()))
        api.create_namespaced_custom_object("moonlease.io", "v1alpha1", "default", "mooncakeleasepolicies", policy())
        kubeconfig = kube_manual.write_kubeconfig(tmp_path / "kubeconfig")
        client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        listed = kubernetes.client.CustomObjectsApi(client).list_namespaced_custom_object(
            "moonlease.io", "v1alpha1", "default", "mooncakeleasepolicies")
        return [item["metadata"]["name"] for item in listed["items"]]

    assert await asyncio.to_thread(with_client) == ["fleet"]
    calls = [(c.verb, c.rbac_resource) for c in kube_manual.api_calls()]
    assert ("create", "mooncakeleasepolicies") in calls and ("list", "mooncakeleasepolicies") in calls


# ---- the rollout simulator -------------------------------------------------------------------------------

def template_with(obj: dict[str, Any], arg: str) -> dict[str, Any]:
    spec = copy.deepcopy(obj["spec"]["template"]["spec"])
    spec["containers"][0]["args"] = [arg]
    return {"spec": {"template": {"spec": spec}}}


async def ticks(kube: LocalApiServer, n: int) -> None:
    for _ in range(n):
        await kube.simulator.tick()


async def test_deleting_a_deployment_removes_its_replicasets_and_their_pods(kube_manual: LocalApiServer) -> None:
    await kube_manual.create(deployment_manifest("decode", replicas=2))
    await kube_manual.create(deployment_manifest("prefill", replicas=1))
    await ticks(kube_manual, 3)
    assert len(kube_manual.list(PODS, "default", label_selector="app.kubernetes.io/name=decode")) == 2
    await kube_manual.delete(DEPLOYMENTS, "default", "decode")
    # Garbage collection follows the owners: Deployment -> ReplicaSet -> Pod.
    assert kube_manual.list(PODS, "default", label_selector="app.kubernetes.io/name=decode") == []
    assert [rs["metadata"]["name"].rsplit("-", 1)[0] for rs in kube_manual.list(REPLICASETS, "default")] == ["prefill"]
    await ticks(kube_manual, 2)  # and the controller does not bring them back
    assert [workload_of(kube_manual.emulator, p) for p in kube_manual.list(PODS, "default")] == ["prefill"]


async def test_rollout_advances_over_ticks_after_a_template_change(kube_manual: LocalApiServer) -> None:
    obj = await kube_manual.create(deployment_manifest("decode", replicas=3))
    await ticks(kube_manual, 4)
    settled = kube_manual.get(DEPLOYMENTS, "default", "decode")
    assert settled is not None and is_rollout_complete(settled)

    changed = await kube_manual.patch(DEPLOYMENTS, "default", "decode", template_with(obj, "--lease=selective"))
    assert changed["metadata"]["generation"] == 2 and not is_rollout_complete(changed)
    seen = []
    for _ in range(5):
        await kube_manual.simulator.tick()
        dep = kube_manual.get(DEPLOYMENTS, "default", "decode")
        assert dep is not None
        seen.append((dep["status"]["observedGeneration"], dep["status"]["updatedReplicas"], is_rollout_complete(dep)))
    assert seen[:3] == [(2, 0, False), (2, 1, False), (2, 2, False)]
    assert seen[3:] == [(2, 3, True), (2, 3, True)]
    conditions = {c["type"]: c for c in dep["status"]["conditions"]}
    assert conditions["Progressing"]["reason"] == "NewReplicaSetAvailable"
    pods = kube_manual.list(PODS, "default", label_selector="app.kubernetes.io/name=decode")
    assert len(pods) == 3 and all(p["spec"]["containers"][0]["args"] == ["--lease=selective"] for p in pods)
    # Each pod belongs to the ReplicaSet of its template, which the Deployment controls (as the
    # ReplicaSet controller creates them; `kubectl describe pod` shows "Controlled By").
    replicasets = {rs["metadata"]["uid"]: rs for rs in kube_manual.list(REPLICASETS, "default")}
    for pod in pods:
        (owner,) = pod["metadata"]["ownerReferences"]
        assert owner["kind"] == "ReplicaSet" and owner["controller"] is True
        rs = replicasets[owner["uid"]]
        assert rs["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
        assert rs["metadata"]["labels"]["pod-template-hash"] == pod["metadata"]["labels"]["pod-template-hash"]
        assert workload_of(kube_manual.emulator, pod) == "decode"
    # The writes are recorded as a cluster's are: status by kube-controller-manager, pods' status
    # by the kubelet (`kubectl get -o yaml --show-managed-fields`; conflict detection reads them).
    managers = {(e["manager"], e["operation"], e.get("subresource")) for e in dep["metadata"]["managedFields"]}
    assert ("kube-controller-manager", "Update", "status") in managers
    pod_managers = {(e["manager"], e.get("subresource")) for e in pods[0]["metadata"]["managedFields"]}
    assert {("kube-controller-manager", None), ("kubelet", "status")} <= pod_managers


async def test_stalled_rollout_never_completes_until_healed(kube_manual: LocalApiServer) -> None:
    obj = await kube_manual.create(deployment_manifest("prefill", replicas=2))
    await ticks(kube_manual, 3)
    kube_manual.simulator.stall("Deployment", "default", "prefill")
    await kube_manual.patch(DEPLOYMENTS, "default", "prefill", template_with(obj, "--new"))
    await ticks(kube_manual, 10)
    dep = kube_manual.get(DEPLOYMENTS, "default", "prefill")
    assert dep is not None and dep["status"]["observedGeneration"] == 2
    assert dep["status"]["updatedReplicas"] == 0 and dep["status"]["readyReplicas"] == 2
    assert not is_rollout_complete(dep)
    kube_manual.simulator.heal("Deployment", "default", "prefill")
    await ticks(kube_manual, 3)
    healed = kube_manual.get(DEPLOYMENTS, "default", "prefill")
    assert healed is not None and is_rollout_complete(healed)


async def test_failed_rollout_reports_the_deadline_and_rollback_succeeds(kube_manual: LocalApiServer) -> None:
    obj = await kube_manual.create(deployment_manifest("decode", replicas=2))
    await ticks(kube_manual, 3)
    kube_manual.simulator.fail("Deployment", "default", "decode",
                               when=lambda t: "--bad" in t["spec"]["containers"][0].get("args", []))
    await kube_manual.patch(DEPLOYMENTS, "default", "decode", template_with(obj, "--bad"))
    await ticks(kube_manual, 4)
    dep = kube_manual.get(DEPLOYMENTS, "default", "decode")
    assert dep is not None and not is_rollout_complete(dep)
    progressing = {c["type"]: c for c in dep["status"]["conditions"]}["Progressing"]
    assert (progressing["status"], progressing["reason"]) == ("False", "ProgressDeadlineExceeded")
    assert dep["status"]["readyReplicas"] == 1 and dep["status"]["updatedReplicas"] == 1
    crashing = [p for p in kube_manual.list(PODS, "default")
                if p["status"]["containerStatuses"][0]["state"].get("waiting", {}).get("reason") == "CrashLoopBackOff"]
    assert len(crashing) == 1

    await kube_manual.patch(DEPLOYMENTS, "default", "decode", {"spec": {"template": obj["spec"]["template"]}})
    await ticks(kube_manual, 2)
    rolled_back = kube_manual.get(DEPLOYMENTS, "default", "decode")
    assert rolled_back is not None and is_rollout_complete(rolled_back)
    assert rolled_back["metadata"]["generation"] == 3


async def test_statefulset_rollout_and_failure(kube_manual: LocalApiServer) -> None:
    obj = await kube_manual.create(statefulset_manifest("master", replicas=2))
    await ticks(kube_manual, 3)
    sts = kube_manual.get(STATEFULSETS, "default", "master")
    assert sts is not None and is_rollout_complete(sts)
    first_revision = sts["status"]["currentRevision"]

    await kube_manual.patch(STATEFULSETS, "default", "master", template_with(obj, "--eviction_ratio=0.1"))
    await kube_manual.simulator.tick()
    await kube_manual.simulator.tick()
    mid = kube_manual.get(STATEFULSETS, "default", "master")
    assert mid is not None and mid["status"]["currentRevision"] == first_revision
    assert mid["status"]["updateRevision"] != first_revision and mid["status"]["updatedReplicas"] == 1
    by_name = {p["metadata"]["name"]: p for p in kube_manual.list(PODS, "default")}
    assert by_name["master-1"]["spec"]["containers"][0]["args"] == ["--eviction_ratio=0.1"]  # highest ordinal first
    assert "args" not in by_name["master-0"]["spec"]["containers"][0]
    await kube_manual.simulator.tick()
    done = kube_manual.get(STATEFULSETS, "default", "master")
    assert done is not None and is_rollout_complete(done) and done["status"]["currentRevision"] == mid["status"]["updateRevision"]

    kube_manual.simulator.fail("StatefulSet", "default", "master")
    await kube_manual.patch(STATEFULSETS, "default", "master", template_with(obj, "--eviction_ratio=0.2"))
    await ticks(kube_manual, 6)
    failing = kube_manual.get(STATEFULSETS, "default", "master")
    assert failing is not None and not is_rollout_complete(failing)
    assert failing["status"]["readyReplicas"] == 1


async def test_background_simulator_ticks_by_itself(kube: LocalApiServer) -> None:
    await kube.create(deployment_manifest("web", replicas=2))
    done = await kube.wait_for(lambda: is_rollout_complete(kube.get(DEPLOYMENTS, "default", "web") or {}),
                               timeout=3, what="the simulated rollout")
    assert done


# ---- kopf against the local server --------------------------------------------------------------------------

def phase_of(kube: LocalApiServer, name: str) -> str | None:
    return ((kube.get("mlp", "default", name) or {}).get("status") or {}).get("phase")


async def test_operator_accepts_a_valid_policy(kube: LocalApiServer, running_operator: OperatorThread) -> None:
    created = await kube.create(policy())
    await kube.wait_for(lambda: phase_of(kube, "fleet") == "Pending", what="status written by the operator")
    obj = kube.get("mlp", "default", "fleet")
    assert obj is not None
    status = obj["status"]
    assert status["observedGeneration"] == created["metadata"]["generation"] == 1
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Invalid"]["status"], conditions["Invalid"]["reason"]) == ("False", "SpecValid")
    # Valid, but its workloads do not exist here: it waits for them and says which.
    ready = conditions["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "WorkloadNotFound")
    assert "Deployment/mooncake-master (master) not found" in ready["message"]
    assert kube.events("default", involved_name="fleet", reason="InvalidSpec") == []

    # kopf watches the policies; the operator's own client writes their status.
    by_kopf = {(c.verb, c.rbac_resource) for c in kube.api_calls() if c.user_agent.startswith("kopf/")}
    by_us = {(c.verb, c.rbac_resource) for c in kube.api_calls() if c.user_agent.startswith("moonlease-operator/")}
    assert {("list", "mooncakeleasepolicies"), ("watch", "mooncakeleasepolicies")} <= by_kopf
    assert ("patch", "mooncakeleasepolicies/status") in by_us


async def test_operator_refuses_an_invalid_policy_with_status_and_event(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    # Passes the schema but breaks a CEL rule; with the CRD's rules off (as if installed without
    # them) the server stores it, and only the operator's mirror catches it.
    kube.emulator.cel_rules = False
    bad = policy(targets=[{"name": "llama-decode", "selector": {"matchLabels": {"a": "b"}}, "role": "decode"}])
    await kube.create(bad)
    await kube.wait_for(lambda: phase_of(kube, "fleet") == "Invalid", what="phase Invalid")
    events = await kube.wait_for(lambda: kube.events("default", involved_name="fleet", reason="InvalidSpec"),
                                 what="the InvalidSpec event")
    assert events[0]["type"] == "Warning" and "exactly one of name or selector" in events[0]["message"]
    invalid = {c["type"]: c for c in kube.get("mlp", "default", "fleet")["status"]["conditions"]}["Invalid"]
    assert (invalid["status"], invalid["reason"]) == ("True", "InvalidSpec")

    await kube.patch("mlp", "default", "fleet", {"spec": {"targets": [{"name": "llama-decode", "role": "decode"}]}})
    await kube.wait_for(lambda: phase_of(kube, "fleet") == "Pending", what="the fixed policy accepted")
    status = kube.get("mlp", "default", "fleet")["status"]
    assert status["observedGeneration"] == 2
    assert {c["type"]: c["status"] for c in status["conditions"]}.items() >= {"Invalid": "False", "Ready": "False"}.items()
    assert len(kube.events("default", involved_name="fleet", reason="InvalidSpec")) == 1


async def test_restarted_operator_resumes_without_repeating_itself(kube: LocalApiServer) -> None:
    bad = policy(rollout={"stages": ["master", "decode"]})  # no stage for the prefill target
    kube.emulator.cel_rules = False  # a CEL rule: stored only by a server without the CRD's rules
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        await kube.create(bad)
        await kube.wait_for(lambda: phase_of(kube, "fleet") == "Invalid", what="phase Invalid")
        await kube.wait_for(lambda: kube.events("default", involved_name="fleet"), what="the event")
    before = kube.get("mlp", "default", "fleet")
    assert before is not None

    def our_calls() -> list[tuple[str | None, str | None]]:
        return [(c.verb, c.rbac_resource) for c in kube.api_calls() if c.user_agent.startswith("moonlease-operator/")]

    calls_before = len(our_calls())
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        # The new operator re-judges the policy (from its watch caches, once they are open, then at
        # each safety-net resync) and finds nothing to say.
        await kube.wait_for(lambda: ("watch", "deployments") in our_calls()[calls_before:],
                            what="the resumed operator's caches")
        await asyncio.sleep(4 * FAST_OPTIONS.resync_interval)
    assert ("patch", "mooncakeleasepolicies/status") not in our_calls()[calls_before:]
    after = kube.get("mlp", "default", "fleet")
    assert after is not None and after["status"] == before["status"]
    assert len(kube.events("default", involved_name="fleet")) == 1


async def test_operator_process_logs_in_with_a_kubeconfig(kube: LocalApiServer, tmp_path: Path) -> None:
    """`moonlease operator` as the image runs it: kopf's own login from KUBECONFIG."""
    import os
    import signal
    import sys

    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "moonlease", "operator", "--standalone", f"--metrics-port={free_port()}",
        f"--liveness=http://127.0.0.1:{free_port()}/healthz", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        await kube.create(policy())
        await kube.wait_for(lambda: proc.returncode is not None or phase_of(kube, "fleet") == "Pending",
                            timeout=20, what="status written by the operator process")
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(proc.communicate(), 15)
    assert proc.returncode == 0 and phase_of(kube, "fleet") == "Pending", output.decode()[-3000:]
    assert b"WorkloadNotFound" in output


async def test_namespaced_operator_leaves_other_namespaces_alone() -> None:
    async with local_api_server(namespaces=("team-a", "team-b")) as kube:
        async with OperatorThread(connection=kube.connection_info(), namespaces=["team-a"], options=FAST_OPTIONS):
            for ns in ("team-b", "team-a"):
                await kube.create({**policy(), "metadata": {"name": "fleet", "namespace": ns}})
            await kube.wait_for(lambda: (kube.get("mlp", "team-a", "fleet") or {}).get("status"),
                                what="the watched namespace handled")
        assert "status" not in kube.get("mlp", "team-b", "fleet")
        watched = {c.path for c in kube.api_calls() if c.verb == "watch"}
        assert "/api/v1/namespaces" in watched
        assert "/apis/moonlease.io/v1alpha1/namespaces/team-a/mooncakeleasepolicies" in watched
        assert not any("team-b" in path for path in watched)


def test_server_and_operator_from_synchronous_code() -> None:
    """What a synchronous program (the demo) does: both in background threads."""
    with LocalApiServerThread() as server, OperatorThread(connection=server.api.connection_info(),
                                                          options=FAST_OPTIONS):
        server.call(server.api.create(policy()))
        server.call(server.api.wait_for(lambda: phase_of(server.api, "fleet") == "Pending",
                                        what="the policy accepted"))
        assert server.api.get("mlp", "default", "fleet")["status"]["observedGeneration"] == 1


async def test_a_timed_out_wait_says_what_it_found_instead(kube_manual: LocalApiServer) -> None:
    with pytest.raises(TimeoutError, match=r"waiting for phase Ready; found phase Progressing"):
        await kube_manual.wait_for(lambda: False, timeout=0.05, what="phase Ready",
                                   describe=lambda: "phase Progressing")
