"""Bad policies change nothing: the schema refuses what it can (the API server answers 422), and
the operator refuses the rest (CEL rules, where the server stores a policy without them, compatibility,
overlaps, foreign connectors) with an Invalid condition and a warning event."""

from __future__ import annotations

import copy
import json
from typing import Any

import aiohttp
import pytest

from moonlease_dev.testbed.kube import CONFIGMAPS, LocalApiServer, is_rollout_complete
from moonlease_settings.settings_file import SETTINGS_FILE_NAME
from moonlease_operator.core.connector_delivery import settings_config_map_name
from moonlease_operator.core.slots import POLICY_LABEL
from moonlease_operator.runner import OperatorThread
from tests.operator.fleet import (
    NS,
    WORKLOADS,
    condition,
    configured,
    create_fleet,
    operator_writes,
    phase,
    policy,
    reasons,
    let_reconcile,
    status,
    workload,
)

pytestmark = pytest.mark.operator

WAIT = 15.0
POLICIES = f"/apis/moonlease.io/v1alpha1/namespaces/{NS}/mooncakeleasepolicies"


async def post(kube: LocalApiServer, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """`kubectl create` over HTTP."""
    async with aiohttp.ClientSession() as session:
        async with session.post(kube.url + POLICIES, data=json.dumps(body),
                                headers={"Content-Type": "application/json"}) as rsp:
            return rsp.status, await rsp.json()


def unchanged(kube: LocalApiServer, originals: dict[str, dict[str, Any]]) -> bool:
    """Spec, generation, labels and annotations as they were (the controllers still write status)."""
    def view(obj: dict[str, Any]) -> tuple[Any, ...]:
        meta = obj["metadata"]
        return obj["spec"], meta["generation"], meta.get("labels"), meta.get("annotations")

    return all(view(workload(kube, name)) == view(original) for name, original in originals.items())


SCHEMA_REFUSES = {
    "eviction ratio 0": {"master.evictionRatio": 0},
    "watermark above 1": {"master.evictionHighWatermarkRatio": 1.01},
    "lease ttl 0": {"master.defaultKvLeaseTtlMs": 0},
    "soft-pin ttl negative": {"master.defaultKvSoftPinTtlMs": -5},
    "master kind": {"master.kind": "DaemonSet"},
    "unknown mode": {"connector.leaseMode": "leaseNone"},
    "empty targets": {"targets": []},
    "target role": {"targets": [{"name": "llama-prefill", "role": "both"}]},
    "unknown stage": {"rollout.stages": ["master", "canary"]},
    "stage timeout 0": {"rollout.stageTimeoutSeconds": 0},
    "negative pause": {"rollout.pauseBetweenStagesSeconds": -1},
    "on failure": {"rollout.onFailure": "retry"},
    "config map key": {"master.configMap": {"name": "cfg", "key": "a/b"}},
    "non-ASCII label value": {"targets": [{"kind": "StatefulSet", "role": "decode",
                                           "selector": {"matchLabels": {"moonlease.io/role": "decodé"}}}]},
}

CEL_REFUSES = {
    "name and selector": ({"targets": [{"name": "llama-prefill", "role": "prefill",
                                         "selector": {"matchLabels": {"a": "b"}}}]},
                          "exactly one of name or selector"),
    "lastHitOnly without hybrid": ({"connector.leaseMode": "lastHitOnly"}, "needs every target to be hybrid"),
    "role without stage": ({"rollout.stages": ["master", "prefill"]}, "every target role must have a stage"),
    "master as target": ({"targets": [{"name": "mooncake-master", "role": "prefill"}],
                          "rollout.stages": ["master", "prefill"]}, "the master workload cannot also be a target"),
    "empty selector": ({"targets": [{"role": "decode", "selector": {"matchLabels": {}}}]},
                       "a selector must match on at least one label"),
    "non-ASCII label key": ({"targets": [{"kind": "StatefulSet", "role": "decode",
                                          "selector": {"matchLabels": {"moonlease.io/røle": "decode"}}}],
                             "rollout.stages": ["master", "decode"]},
                            "matchLabels keys must be Kubernetes label keys"),
}


async def test_the_schema_refuses_bad_fields_and_nothing_changes(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    originals = await create_fleet(kube)
    for case, changes in SCHEMA_REFUSES.items():
        code, answer = await post(kube, policy(name="bad", **changes))
        assert code == 422 and answer["kind"] == "Status", case
        assert kube.get("mlp", NS, "bad") is None, case
    assert operator_writes(kube) == [] and unchanged(kube, originals)


async def test_cel_rule_violations_are_refused_by_the_operator(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    originals = await create_fleet(kube)
    kube.emulator.cel_rules = False  # a CRD installed without its rules: the operator's mirror must refuse
    for index, (case, (changes, message)) in enumerate(CEL_REFUSES.items()):
        name = f"bad-{index}"
        code, _ = await post(kube, policy(name=name, **changes))
        assert code == 201, f"{case}: the server does not evaluate CEL here, so the operator must"
        await kube.wait_for(lambda: phase(kube, name) == "Invalid", timeout=WAIT, what=f"{case} refused")
        invalid = condition(kube, "Invalid", name)
        assert (invalid["status"], invalid["reason"]) == ("True", "InvalidSpec") and message in invalid["message"], case
        await kube.wait_for(lambda: reasons(kube, name) == ["InvalidSpec"], what=f"{case}: one warning event")
        event = kube.events(NS, involved_name=name)[0]
        assert event["type"] == "Warning" and message in event["message"], case
    assert unchanged(kube, originals)
    assert not any(configured(workload(kube, n)["spec"]["template"]) for n in WORKLOADS)


@pytest.mark.parametrize(("case", "reason", "needle"), [
    ("foreign connector", "ForeignConnector", "LMCacheConnectorV1"),
    ("old master", "Incompatible", "runs Mooncake 0.3.13"),
    ("undeclared client version", "Incompatible", "Mooncake version unknown"),
    ("missing container", "UnmanageableWorkload", "container engine not found"),
])
async def test_a_fleet_that_cannot_run_the_policy_is_refused_untouched(
        kube: LocalApiServer, running_operator: OperatorThread, case: str, reason: str, needle: str) -> None:
    originals = await create_fleet(kube)
    body = policy()
    if case == "foreign connector":
        await kube.patch("statefulsets", NS, "llama-decode", {"spec": {"template": {"spec": {"containers": [
            {**originals["llama-decode"]["spec"]["template"]["spec"]["containers"][0],
             "args": ["serve", "--kv-transfer-config", json.dumps({"kv_connector": "LMCacheConnectorV1"})]}]}}}})
        originals["llama-decode"] = workload(kube, "llama-decode")
    elif case == "old master":
        body["spec"]["master"]["version"] = "0.3.13"
    elif case == "undeclared client version":
        del body["spec"]["targets"][0]["mooncakeVersion"]
    else:
        body["spec"]["targets"][0]["container"] = "engine"
    await kube.create(body)
    await kube.wait_for(lambda: phase(kube) == "Invalid", timeout=WAIT, what="phase Invalid")
    invalid = condition(kube, "Invalid")
    assert invalid["reason"] == reason and needle in invalid["message"]
    await let_reconcile(3)
    assert reasons(kube) == [reason]  # said once
    assert unchanged(kube, originals)
    assert not any(POLICY_LABEL in (workload(kube, n)["metadata"].get("labels") or {}) for n in WORKLOADS)

    # Fixing the cause lets the policy through.
    if case == "foreign connector":
        await kube.patch("statefulsets", NS, "llama-decode", {"spec": {"template": {"spec": {"containers": [
            {**originals["llama-decode"]["spec"]["template"]["spec"]["containers"][0], "args": ["serve"]}]}}}})
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready once fixed")


SHELL_VLLM = {"name": "vllm", "image": "registry.local/vllm:0.9.1", "command": ["sh", "-c"],
              "args": ["huggingface-cli download /models/llama && vllm serve /models/llama"]}
SIDECAR = {"name": "istio-proxy", "image": "istio/proxyv2:1.22", "args": ["proxy", "sidecar"]}
VLLM = {"name": "vllm", "image": "registry.local/vllm:0.9.1", "args": ["serve", "/models/llama"]}
REDIS = {"name": "redis", "image": "redis:7", "args": ["--appendonly", "yes"]}
# Issue 27: a token ending in vllm, an image name containing it, a script that only mentions us.
REDIS_ON_VLLM_DIR = {"name": "redis", "image": "redis:7", "args": ["--dir", "/data/vllm"]}
ROUTER = {"name": "router", "image": "ghcr.io/vllm-project/vllm-router:0.1", "args": ["--port", "8000"]}
MENTION_ONLY = {"name": "vllm", "image": "registry.local/vllm:0.9.1", "command": ["sh", "-c"],
                "args": ["pip install moonlease_connector && echo /etc/moonlease/connector/connector-settings.json"
                         " && vllm serve /models/llama"]}


def _containers(kube: LocalApiServer, name: str) -> list[dict[str, Any]]:
    return workload(kube, name)["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize(("case", "needle"), [
    ("shell-wrapped vLLM", "runs its command through a shell script"),
    ("sidecar first, no container", "has 2 containers (istio-proxy, vllm): set spec.targets[1].container"),
    ("selector matches Redis", "container 'redis' does not run vLLM"),
    ("selector matches Redis on /data/vllm", "container 'redis' does not run vLLM"),
    ("selector matches a vllm-router", "container 'router' does not run vLLM"),
    ("a sidecar named as the vLLM container", "container 'metrics-proxy' does not run vLLM"),
    ("a script that only mentions the connector", "runs its command through a shell script"),
    ("master.name at a vLLM workload", "does not run mooncake_master"),
    ("multi-container master, no container", "set spec.master.container"),
])
async def test_workloads_the_operator_cannot_manage_end_invalid_never_ready(
        kube: LocalApiServer, running_operator: OperatorThread, case: str, needle: str) -> None:
    """Issue 15: each shape used to end Ready while the pods ran the old settings."""
    await create_fleet(kube)
    body = policy()
    cache = {"selector matches Redis": REDIS, "selector matches Redis on /data/vllm": REDIS_ON_VLLM_DIR,
             "selector matches a vllm-router": ROUTER}.get(case)
    if case in ("shell-wrapped vLLM", "a script that only mentions the connector"):
        script = SHELL_VLLM if case == "shell-wrapped vLLM" else MENTION_ONLY
        await kube.patch("statefulsets", NS, "llama-decode",
                         {"spec": {"template": {"spec": {"containers": [{**script, "args": script["args"]}]}}}})
    elif case == "a sidecar named as the vLLM container":
        body["spec"]["targets"][0]["container"] = "metrics-proxy"  # a mistake: must never get vLLM's flags
    elif case == "sidecar first, no container":
        await kube.patch("statefulsets", NS, "llama-decode",
                         {"spec": {"template": {"spec": {"containers": [SIDECAR, VLLM]}}}})
    elif cache is not None:
        await kube.create({"apiVersion": "apps/v1", "kind": "StatefulSet",
                           "metadata": {"name": "cache", "namespace": NS, "labels": {"moonlease.io/role": "decode"}},
                           "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "cache"}},
                                    "template": {"metadata": {"labels": {"app": "cache"}},
                                                 "spec": {"containers": [cache]}}}})
    elif case == "master.name at a vLLM workload":
        body["spec"]["master"].update(name="llama-prefill", container="vllm")  # named: still refused
        body["spec"]["targets"] = body["spec"]["targets"][1:]
        body["spec"]["rollout"]["stages"] = ["master", "decode"]
    else:
        await kube.patch("deployments", NS, "mooncake-master", {"spec": {"template": {"spec": {"containers": [
            *_containers(kube, "mooncake-master"), SIDECAR]}}}})
    await kube.wait_for(lambda: all(is_rollout_complete(workload(kube, n)) for n in WORKLOADS),
                        timeout=10, what="the fleet to settle")
    before = {n: workload(kube, n)["spec"] for n in WORKLOADS}
    await kube.create(body)
    await kube.wait_for(lambda: phase(kube) == "Invalid", timeout=WAIT, what=f"{case}: phase Invalid")
    invalid = condition(kube, "Invalid")
    assert invalid["status"] == "True" and invalid["reason"] == "UnmanageableWorkload", invalid
    assert needle in invalid["message"], invalid["message"]
    await kube.wait_for(lambda: "UnmanageableWorkload" in reasons(kube), what=f"{case}: a warning event")
    event = next(e for e in kube.events(NS, involved_name="fleet") if e["reason"] == "UnmanageableWorkload")
    assert event["type"] == "Warning" and needle in event["message"]
    await let_reconcile(2)
    assert phase(kube) == "Invalid"
    assert {n: workload(kube, n)["spec"] for n in WORKLOADS} == before  # nothing delivered half-way


async def test_overlapping_policies_the_later_one_is_refused(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    await create_fleet(kube)
    await kube.create(policy(name="first"))
    await kube.wait_for(lambda: phase(kube, "first") == "Ready", timeout=WAIT, what="the first policy Ready")
    first = copy.deepcopy(status(kube, "first"))
    versions = {n: workload(kube, n)["metadata"]["resourceVersion"] for n in WORKLOADS}

    second = policy(name="second", **{"connector.leaseMode": "leaseAll"})
    second["spec"]["master"] = {"name": "other-master"}
    await kube.create({"apiVersion": "apps/v1", "kind": "Deployment",
                       "metadata": {"name": "other-master", "namespace": NS},
                       "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "m2"}},
                                "template": {"metadata": {"labels": {"app": "m2"}},
                                             "spec": {"containers": [{"name": "m", "image": "mooncake:0.3.14",
                                                                       "command": ["mooncake_master"]}]}}}})
    await kube.create(second)
    await kube.wait_for(lambda: phase(kube, "second") == "Invalid", timeout=WAIT, what="the second refused")
    invalid = condition(kube, "Invalid", "second")
    assert invalid["reason"] == "ConflictingPolicy"
    assert "Deployment/llama-prefill is managed by policy first" in invalid["message"]
    await kube.wait_for(lambda: reasons(kube, "second") == ["ConflictingPolicy"], what="its warning event")
    assert {n: workload(kube, n)["metadata"]["resourceVersion"] for n in WORKLOADS} == versions
    assert status(kube, "first") == first

    # Once the first policy is gone (and has restored its workloads), the second may proceed.
    await kube.delete("mlp", NS, "first")
    await kube.wait_for(lambda: phase(kube, "second") == "Ready", timeout=WAIT, what="the second Ready")
    settings = kube.get(CONFIGMAPS, NS, settings_config_map_name("llama-prefill"))["data"][SETTINGS_FILE_NAME]
    assert json.loads(settings)["mooncake_lease_mode"] == "leaseAll"


async def test_a_policy_waits_for_its_workloads(kube: LocalApiServer, running_operator: OperatorThread) -> None:
    await kube.create(policy())
    await kube.wait_for(lambda: phase(kube) == "Pending", timeout=WAIT, what="phase Pending")
    ready = condition(kube, "Ready")
    assert ready["reason"] == "WorkloadNotFound" and "Deployment/mooncake-master (master) not found" in ready["message"]
    assert "no StatefulSet matches the selector of targets[1]" in ready["message"]
    await create_fleet(kube)
    await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
    assert reasons(kube)[0] == "WorkloadNotFound"
