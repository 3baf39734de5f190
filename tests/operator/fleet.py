"""A small fleet on the local API server for the operator tests: a Mooncake master Deployment,
a prefill Deployment (with a sidecar and a --kv-transfer-config of its own) and a decode
StatefulSet selected by label, plus helpers to read what the operator wrote."""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
from typing import Any

from moonlease_dev.testbed.kube import (
    DEPLOYMENTS,
    STATEFULSETS,
    LocalApiServer,
    deployment_manifest,
    is_rollout_complete,
    statefulset_manifest,
)
from moonlease_operator.core.slots import CONFIG_HASH_ANNOTATION
from tests.fixtures.kube import FAST_OPTIONS

NS = "default"
OPERATOR_AGENT = "moonlease-operator/"
WRITES = ("create", "patch", "update", "delete")

USER_KV_CONFIG = {"kv_connector_extra_config": {"lookup_rpc_port": 5557, "mooncake_max_lease_rounds": 5}}
MASTER = deployment_manifest("mooncake-master", replicas=1, containers=[
    {"name": "master", "image": "registry.local/mooncake/mooncake-master:v0.3.14",
     "args": ["--rpc_port=50051", "--eviction_ratio=0.05"]}])
PREFILL = deployment_manifest("llama-prefill", replicas=2, containers=[
    {"name": "vllm", "image": "registry.local/vllm:0.9.1",
     "args": ["serve", "/models/llama", "--kv-transfer-config", json.dumps(USER_KV_CONFIG)]},
    {"name": "metrics-proxy", "image": "registry.local/envoy:1", "args": ["--port=9000"]}])
DECODE = statefulset_manifest("llama-decode", replicas=2, labels={"moonlease.io/role": "decode"}, containers=[
    {"name": "vllm", "image": "registry.local/vllm:0.9.1", "args": ["serve", "/models/llama"],
     "env": [{"name": "HF_HOME", "value": "/cache"}]}])
WORKLOADS = {"mooncake-master": DEPLOYMENTS, "llama-prefill": DEPLOYMENTS, "llama-decode": STATEFULSETS}

SPEC: dict[str, Any] = {
    # Approvals have their own tests; the flow tests let forward master restarts through.
    "master": {"name": "mooncake-master", "evictionRatio": 0.1, "defaultKvLeaseTtlMs": 5000,
               "requireApprovalForRestart": False},
    "connector": {"leaseMode": "selective"},
    "targets": [
        {"name": "llama-prefill", "role": "prefill", "container": "vllm", "mooncakeVersion": "0.3.14"},
        {"kind": "StatefulSet", "role": "decode", "mooncakeVersion": "0.3.14",
         "selector": {"matchLabels": {"moonlease.io/role": "decode"}}},
    ],
    "rollout": {"stageTimeoutSeconds": 30},
}


def policy(name: str = "fleet", spec: dict[str, Any] | None = None, **changes: Any) -> dict[str, Any]:
    """A MooncakeLeasePolicy manifest; `changes` are dotted paths into SPEC."""
    body = copy.deepcopy(spec if spec is not None else SPEC)
    for path, value in changes.items():
        node = body
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return {"apiVersion": "moonlease.io/v1alpha1", "kind": "MooncakeLeasePolicy",
            "metadata": {"name": name, "namespace": NS}, "spec": body}


async def create_fleet(kube: LocalApiServer, *, decode: dict[str, Any] | None = None,
                       prefill: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Create the three workloads (`decode`, `prefill`: another workload of the same name), wait
    until their controllers settle, return them as stored."""
    for manifest in (MASTER, prefill if prefill is not None else PREFILL, decode if decode is not None else DECODE):
        await kube.create(copy.deepcopy(manifest))
    await kube.wait_for(lambda: all(is_rollout_complete(workload(kube, n)) for n in WORKLOADS),
                        timeout=10, what="the fleet to settle")
    return {name: workload(kube, name) for name in WORKLOADS}


def workload(kube: LocalApiServer, name: str) -> dict[str, Any]:
    return kube.get(WORKLOADS[name], NS, name) or {}


def status(kube: LocalApiServer, name: str = "fleet") -> dict[str, Any]:
    return (kube.get("mlp", NS, name) or {}).get("status") or {}


def phase(kube: LocalApiServer, name: str = "fleet") -> str | None:
    return status(kube, name).get("phase")


def stage_phases(kube: LocalApiServer, name: str = "fleet") -> dict[str, str]:
    return {s["name"]: s["phase"] for s in status(kube, name).get("stages", [])}


def condition(kube: LocalApiServer, type_: str, name: str = "fleet") -> dict[str, Any]:
    return next((c for c in status(kube, name).get("conditions", []) if c["type"] == type_), {})


def describe_policy(kube: LocalApiServer, name: str = "fleet") -> str:
    """The policy's phase, stages and events in a line: what a timed-out wait found."""
    stages = ", ".join(f"{s['name']} {s['phase']} ({s.get('message', '')})" for s in status(kube, name).get("stages", []))
    return f"phase {phase(kube, name)}; stages: {stages or 'none'}; events: {reasons(kube, name, transient=True)}"


#: Event reasons whose presence depends on timing (a connector reading its new settings file a
#: moment after the operator looked): left out of `reasons` unless asked for.
TRANSIENT_REASONS = ("SettingsNotVerified",)


def reasons(kube: LocalApiServer, name: str = "fleet", *, transient: bool = False) -> list[str]:
    events = sorted(kube.events(NS, involved_name=name), key=lambda e: int(e["metadata"]["resourceVersion"]))
    return [e["reason"] for e in events if transient or e["reason"] not in TRANSIENT_REASONS]


async def wait_for_stage_start(kube: LocalApiServer, stage: str, name: str, timeout: float = 15.0) -> None:
    """Until `stage` is Progressing and its workload `name` carries our configuration (the
    status announces a stage before the operator patches it: both)."""
    await kube.wait_for(lambda: stage_phases(kube).get(stage) == "Progressing"
                        and configured(workload(kube, name)["spec"]["template"]),
                        timeout=timeout, what=f"the {stage} stage to start")


def configured(obj: dict[str, Any]) -> bool:
    """Whether a workload's pod template carries the operator's configuration hash."""
    return CONFIG_HASH_ANNOTATION in ((obj.get("metadata") or {}).get("annotations") or {})


def as_left_by_users(obj: dict[str, Any]) -> dict[str, Any]:
    """What a restore must bring back exactly: the spec, labels and annotations (but the
    Deployment controller's own, `deployment.kubernetes.io/revision`, which counts rollouts)."""
    meta = obj.get("metadata") or {}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items()
                   if not k.startswith("deployment.kubernetes.io/")}
    return {"spec": obj.get("spec"), "labels": meta.get("labels"), "annotations": annotations or None}


def operator_writes(kube: LocalApiServer, since: int = 0) -> list[tuple[str | None, str | None]]:
    """Writes by kopf or the operator's client since API call `since`."""
    return [(c.verb, c.rbac_resource) for c in kube.api_calls()[since:]
            if c.verb in WRITES and c.user_agent.startswith(("kopf/", OPERATOR_AGENT))]


async def let_reconcile(times: int = 3) -> None:
    """Wait for `times` of the operator's safety-net resyncs (`FAST_OPTIONS.resync_interval`
    each): whatever it would do unprompted — repeat an event, write, restart something — it has
    had the chance to do by then. (A reconcile reads the watch caches: no request to count.)"""
    await asyncio.sleep(times * FAST_OPTIONS.resync_interval + 0.2)


class ManualClock:
    """The operator's clock, moved by the test (stage timeouts and pauses count on it)."""

    def __init__(self) -> None:
        self.now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)

    def __call__(self) -> datetime.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += datetime.timedelta(seconds=seconds)
