"""The rollout state machine, walked through hand-checked scenarios on plain dicts.

`Cluster` plays the API server (objects, generations), on `settle()` the workload
controllers, and the pods' connectors: each reports the settings its workload's settings file
gives it (the connector's own parser and hash), unless the test stops it following; every reconcile round-trips the status through its JSON form, as the operator reads
it back from the API, so nothing is carried between reconciles but what the cluster stores.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
from collections.abc import Mapping
from typing import Any

import pytest

from moonlease_operator.api import APPROVE_MASTER_RESTART_ANNOTATION, Phase, PolicyStatus, StageName, read_spec
from moonlease_dev.testbed.kube.patches import merge_patch
from moonlease_operator.core.status import dump_status, read_status
from moonlease_operator.core.ab_plan import ABReading
from moonlease_operator.core.compatibility import (
    VersionSource,
    evaluate_compatibility,
    image_mooncake_version,
    parse_mooncake_version,
)
from moonlease_settings.settings_file import SETTINGS_FILE_NAME, parse_settings_file, settings_hash
from moonlease_operator.core.connector_delivery import (
    SETTINGS_CONFIG_MAP_LABEL,
    SettingsReport,
    reads_settings_file,
    settings_config_map_name,
    startup_defaults,
)
from moonlease_operator.core.slots import CONFIG_HASH_ANNOTATION, POLICY_LABEL, build_update
from moonlease_operator.core.fleet import Claim, evaluate_claims, resolve_fleet
from moonlease_operator.core.health import Health, evaluate_health
from moonlease_operator.core.changes import ChangeAction
from moonlease_operator.core.rollout import (
    Observed,
    PolicyRef,
    ReconcilePlan,
    config_maps_to_restore,
    plan_fetch,
    plan_reconcile,
    plan_release,
    settings_config_maps_to_read,
)
from moonlease_operator.api import PolicySpecError, parse_spec

pytestmark = pytest.mark.unit

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


def deployment(name: str, *containers: dict[str, Any], replicas: int = 2, labels: dict[str, str] | None = None,
               kind: str = "Deployment") -> dict[str, Any]:
    pod_labels = {"app": name, **(labels or {})}
    return {"apiVersion": "apps/v1", "kind": kind,
            "metadata": {"name": name, "namespace": "ns", "generation": 1, "labels": dict(pod_labels),
                         "resourceVersion": "1"},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": pod_labels},
                                  "spec": {"containers": list(containers) or [
                                      {"name": "vllm", "image": "vllm:1", "args": ["serve", "m"]}]}}}}


def master_deployment() -> dict[str, Any]:
    return deployment("mooncake-master", {"name": "master", "image": "reg/mooncake-master:v0.3.14",
                                          "args": ["--rpc_port=50051", "--eviction_ratio=0.05"]}, replicas=1)


SPEC: dict[str, Any] = {
    # Approvals have their own tests; the flow tests let forward restarts through.
    "master": {"name": "mooncake-master", "evictionRatio": 0.1, "requireApprovalForRestart": False},
    "connector": {"leaseMode": "selective"},
    "targets": [{"name": "prefill", "role": "prefill", "mooncakeVersion": "0.3.14"},
                {"name": "decode", "role": "decode", "mooncakeVersion": "0.3.14"}],
    "rollout": {"stageTimeoutSeconds": 60},
}


def spec_with(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    for path, value in changes.items():
        node = spec
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return spec


class Cluster:
    """Objects, a clock, and controllers that do what the test says."""

    def __init__(self, *workloads: dict[str, Any]) -> None:
        self.workloads = {(w["kind"], w["metadata"]["name"]): w for w in workloads}
        self.config_maps: dict[str, dict[str, Any]] = {}
        self.status_json: dict[str, Any] = {}
        self.now = T0
        self.annotations: dict[str, str] = {}
        self.generation = 1
        self.others: list[dict[str, Any]] = []
        self.events: list[tuple[str, str, str]] = []
        self.writes: list[tuple[str, str]] = []
        self.frozen_connectors: set[str] = set()  # workloads whose connectors ignore their file
        self.refusing_connectors: set[str] = set()  # workloads whose connectors refuse their file's mode
        self.pod_specs: dict[str, dict[str, Any]] = {}  # workload -> the spec its pods really run
        self.reported: dict[str, SettingsReport] = {}
        for key in self.workloads:
            self.settle(key[1])

    @property
    def status(self) -> PolicyStatus:
        return read_status(self.status_json)

    def reconcile(self, spec: Mapping[str, Any], *, ab_reading: ABReading | None = None) -> ReconcilePlan:
        """One reconcile; `ab_reading` plays the handler's A/B measurement (only when due)."""
        previous = read_status(self.status_json)
        parsed = read_spec(spec)
        fetch = plan_fetch(parsed, previous, self.now)
        pods = self.pods() if fetch.pods else None
        observed = Observed(workloads=copy.deepcopy(self.workloads), config_maps=copy.deepcopy(self.config_maps),
                            policies=self.others, pods=pods, ab_reading=ab_reading if fetch.ab_due else None,
                            settings_reports=None if pods is None else self.settings_reports(pods))
        plan = plan_reconcile(spec=parsed, policy=PolicyRef("fleet", "ns", self.generation, "2026-01-01T00:00:00Z",
                                                              self.annotations),
                              previous=previous, observed=observed, now=self.now)
        # As the API server stores it: the status merge-patched onto the stored one (what a write
        # leaves out, stays).
        self.status_json = merge_patch(self.status_json, json.loads(json.dumps(dump_status(plan.status)))) or {}
        self.events.extend((e.type, e.reason, e.message) for e in plan.events)
        for change in plan.changes:
            store = self.config_maps if change.kind == "ConfigMap" else self.workloads
            key = change.name if change.kind == "ConfigMap" else change.ref
            current = store.get(key) or change.create_from
            assert current is not None, f"{change.ref} does not exist"
            new = build_update(current, change)
            assert new is not None, "the planner asked for a change that changes nothing"
            new.setdefault("metadata", {}).setdefault("generation", 1)
            if new.get("spec") != current.get("spec"):
                new["metadata"]["generation"] += 1
            store[key] = new
            self.writes.append(change.ref)
        return plan

    def run(self, spec: Mapping[str, Any], *, rounds: int = 12) -> PolicyStatus:
        """Reconcile and settle every workload until the phase stops changing."""
        for _ in range(rounds):
            self.reconcile(spec)
            for key in self.workloads:
                self.settle(key[1])
        return self.status

    def obj(self, name: str) -> dict[str, Any]:
        return next(o for (_, n), o in self.workloads.items() if n == name)

    def settle(self, name: str, *, fail: bool = False) -> None:
        """The controller finishes (or fails) the workload's rollout."""
        obj = self.obj(name)
        replicas = obj["spec"]["replicas"]
        progressing = {"type": "Progressing", "status": "False" if fail else "True",
                       "reason": "ProgressDeadlineExceeded" if fail else "NewReplicaSetAvailable", "message": "m"}
        obj["status"] = {"observedGeneration": obj["metadata"]["generation"], "replicas": replicas,
                         "updatedReplicas": replicas if not fail else 1, "readyReplicas": replicas - int(fail),
                         "availableReplicas": replicas - int(fail), "conditions": [progressing]}
        obj["_settled_template"] = None if fail else copy.deepcopy(obj["spec"]["template"])

    def observe_only(self, name: str) -> None:
        """The controller sees the new generation but nothing moves (a stalled rollout)."""
        obj = self.obj(name)
        obj["status"] = {**obj.get("status", {}), "observedGeneration": obj["metadata"]["generation"],
                         "updatedReplicas": 0}

    def pods(self) -> list[dict[str, Any]]:
        pods = []
        for obj in self.workloads.values():
            template = obj.get("_settled_template")
            if template is None:
                continue
            for i in range(obj["spec"]["replicas"]):
                pods.append({"metadata": {"name": f"{obj['metadata']['name']}-{i}", "namespace": "ns",
                                          "labels": template["metadata"]["labels"],
                                          "annotations": dict(template["metadata"].get("annotations") or {}),
                                          "ownerName": obj["metadata"]["name"]},
                             "spec": copy.deepcopy(self.pod_specs.get(obj["metadata"]["name"])
                                                   or template.get("spec") or {}),
                             "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}})
        return pods

    def settings_reports(self, pods: list[dict[str, Any]]) -> dict[str, SettingsReport]:
        """What each pod's connector reports: the settings its file gives it, over the start-up
        defaults of its template (a frozen connector keeps what it reported last)."""
        reports = {}
        for pod in pods:
            if not reads_settings_file(pod):
                continue
            name, owner = pod["metadata"]["name"], pod["metadata"]["ownerName"]
            if owner in self.frozen_connectors and name in self.reported:
                reports[name] = self.reported[name]
                continue
            data = (self.config_maps.get(settings_config_map_name(owner)) or {}).get("data") or {}
            defaults = startup_defaults({"spec": {"template": {"spec": pod["spec"]}}}, None)
            assert defaults is not None
            config = parse_settings_file(data.get(SETTINGS_FILE_NAME, "{}"), defaults)
            kept = self.reported.get(name)
            if owner in self.refusing_connectors and kept is not None and kept.settings_hash != settings_hash(config):
                # The connector read the file and refused it (e.g. a mode its model cannot serve).
                reports[name] = dataclasses.replace(kept, refused_hash=settings_hash(config),
                                                    refused_reason="model_unsupported")
                continue
            reports[name] = SettingsReport(settings_hash=settings_hash(config), lease_mode=config.lease_mode.value)
        self.reported.update(reports)
        return reports

    def stage_phases(self) -> dict[str, str]:
        return {s.name.value: s.phase.value for s in self.status.stages}

    def reasons(self) -> list[str]:
        return [reason for _, reason, _ in self.events]


def fleet() -> Cluster:
    return Cluster(master_deployment(), deployment("prefill"), deployment("decode"))


STAGE_WORKLOADS = {"master": "mooncake-master", "prefill": "prefill", "decode": "decode"}


def rolled_to(stage: str, spec: Mapping[str, Any] = SPEC, cluster: Cluster | None = None) -> Cluster:
    """A fleet (`cluster`, else `fleet()`) whose rollout of `spec` has reached `stage`
    (Progressing; its controller not finished), every stage before it settled."""
    cluster = cluster if cluster is not None else fleet()
    cluster.reconcile(spec)
    while cluster.stage_phases()[stage] != "Progressing":
        running = next(n for n, p in cluster.stage_phases().items() if p == "Progressing")
        cluster.settle(STAGE_WORKLOADS[running])
        cluster.reconcile(spec)
    return cluster


def template(cluster: Cluster, name: str) -> dict[str, Any]:
    return cluster.obj(name)["spec"]["template"]


# ---- the happy path -------------------------------------------------------------------------------

def test_workloads_that_fail_requests_on_a_failed_load_are_warned_about_until_fixed() -> None:
    recompute = ["--kv-transfer-config", json.dumps({"kv_load_failure_policy": "recompute"})]
    cluster = Cluster(master_deployment(),
                      deployment("prefill", {"name": "vllm", "image": "vllm:1", "args": ["serve", "m", *recompute]}),
                      deployment("decode"))
    cluster.run(SPEC)
    warned = cluster.status.condition("LoadFailuresFailRequests")
    assert warned is not None and warned.status.value == "True" and warned.reason == "LoadFailurePolicyFail"
    assert "Deployment/decode does not set kv_load_failure_policy" in warned.message
    assert "prefill" not in warned.message and '"kv_load_failure_policy": "recompute"' in warned.message
    assert cluster.status.phase is Phase.READY  # a warning: the rollout is not held by it
    assert [(t, m) for t, r, m in cluster.events if r == "LoadFailurePolicyFail"] == [("Warning", warned.message)]

    # The owner adds the line: the operator keeps it (and its own entries), the condition clears.
    args = cluster.obj("decode")["spec"]["template"]["spec"]["containers"][0]["args"]
    at = args.index("--kv-transfer-config") + 1
    args[at] = json.dumps({**json.loads(args[at]), "kv_load_failure_policy": "recompute"})
    status = cluster.run(SPEC)
    cleared = status.condition("LoadFailuresFailRequests")
    assert cleared is not None and cleared.status.value == "False" and cleared.reason == "AsExpected"
    assert sum(r == "LoadFailurePolicyFail" for _, r, _ in cluster.events) == 1


def test_evict_beside_other_engines_is_warned_about_and_cleared_once_one_engine_writes() -> None:
    spec = spec_with(**{"connector.retentionEvict": True, "master.evictionHighWatermarkRatio": 0.8})
    cluster = fleet()
    cluster.run(spec)
    warned = cluster.status.condition("EvictOnSharedStore")
    assert warned is not None and warned.status.value == "True" and warned.reason == "EvictOnSharedStore"
    assert "4 vLLM engines share the store (Deployment/prefill 2, Deployment/decode 2)" in warned.message
    assert cluster.status.phase is Phase.READY  # a warning: evict still reaches every engine
    assert [(t, m) for t, r, m in cluster.events if r == "EvictOnSharedStore"] == [("Warning", warned.message)]
    cluster.run(spec)
    assert sum(r == "EvictOnSharedStore" for _, r, _ in cluster.events) == 1  # posted once

    # The policy turns evict off: the condition clears (and a policy that never had it, has none).
    status = cluster.run(spec_with(**{"master.evictionHighWatermarkRatio": 0.8}))
    cleared = status.condition("EvictOnSharedStore")
    assert cleared is not None and cleared.status.value == "False" and cleared.reason == "AsExpected"
    assert fleet().run(SPEC).condition("EvictOnSharedStore") is None


def test_evict_on_one_fleet_order_service_is_not_warned_about() -> None:
    """Every engine names the same fleet order service: one order for the store, nothing to warn."""
    spec = spec_with(**{"connector.retentionEvict": True, "master.evictionHighWatermarkRatio": 0.8})
    for target in spec["targets"]:
        target["container"] = "vllm"
    sidecar = {"name": "proxy", "image": "envoy:1"}  # first in the pod: the target's container is found by name

    def warned(extra: dict[str, Any]) -> bool:
        kv = ["--kv-transfer-config", json.dumps({"kv_connector_extra_config": extra})]
        vllm = {"name": "vllm", "image": "vllm:1", "args": ["serve", "m", *kv]}
        cluster = Cluster(master_deployment(), deployment("prefill", sidecar, vllm), deployment("decode", sidecar, vllm))
        cluster.run(spec)
        return cluster.status.condition("EvictOnSharedStore") is not None

    assert not warned({"mooncake_fleet_order_url": "http://fleet-order:8790"})
    assert warned({})


def test_stages_roll_out_one_after_the_other() -> None:
    cluster = fleet()
    cluster.reconcile(SPEC)
    assert cluster.stage_phases() == {"master": "Progressing", "prefill": "Pending", "decode": "Pending"}
    assert cluster.writes == [("Deployment", "mooncake-master")]
    # (The fleet's vLLM commands leave kv_load_failure_policy at vLLM's 'fail': warned about once.)
    assert cluster.reasons() == ["RolloutStarted", "MasterRestart", "StageProgressing", "LoadFailurePolicyFail"]
    assert "--eviction_ratio: 0.05 -> 0.1" in cluster.events[1][2] and "empties the Mooncake store" in cluster.events[1][2]

    # The status says so too, before the operator patches anything.
    assert "empties the Mooncake store" in cluster.status.stages[0].message
    progressing = cluster.status.condition("Progressing")
    assert progressing is not None and "--eviction_ratio: 0.05 -> 0.1" in progressing.message
    cluster.reconcile(SPEC)  # the master's controller has not moved: keep waiting, change nothing
    assert cluster.status.phase is Phase.PROGRESSING and len(cluster.writes) == 1
    cluster.settle("mooncake-master")
    cluster.reconcile(SPEC)
    assert cluster.stage_phases() == {"master": "Succeeded", "prefill": "Progressing", "decode": "Pending"}
    # The settings file first, then the (one-time) adoption of the workload.
    assert cluster.writes[1:] == [("ConfigMap", "prefill-moonlease"), ("Deployment", "prefill")]
    cluster.settle("prefill")
    cluster.reconcile(SPEC)
    assert cluster.writes[3:] == [("ConfigMap", "decode-moonlease"), ("Deployment", "decode")]
    assert cluster.status.current_stage is StageName.DECODE
    cluster.settle("decode")
    cluster.reconcile(SPEC)
    status = cluster.status
    assert status.phase is Phase.READY and status.applied_config_hash == status.desired_config_hash
    # Ready workloads are counted, not listed (the status lists only those that need attention).
    assert [(c.role.value, c.phase.value, c.count) for c in status.target_counts] == [
        ("master", "Ready", 1), ("prefill", "Ready", 1), ("decode", "Ready", 1)]
    assert status.targets == [] and status.targets_total == 3 and status.targets_omitted == 0
    assert cluster.reasons()[-2:] == ["StageSucceeded", "RolloutComplete"]
    assert {c.type: (c.status.value, c.reason) for c in status.conditions} == {
        "Ready": ("True", "RolloutComplete"), "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"), "Invalid": ("False", "SpecValid"),
        "LoadFailuresFailRequests": ("True", "LoadFailurePolicyFail")}

    # At rest: the same status, no events, no changes — however often it is planned.
    before, events = cluster.status_json, len(cluster.events)
    cluster.now += datetime.timedelta(hours=1)
    plan = cluster.reconcile(SPEC)
    assert plan.changes == () and plan.events == () and cluster.status_json == before and len(cluster.events) == events


def test_a_stage_waits_until_pods_run_the_new_configuration() -> None:
    cluster = fleet()
    spec = spec_with(**{"master.evictionRatio": 0.05})  # the master already has it
    cluster.reconcile(spec)  # adopts prefill: its pod template changes
    # The controller claims success but the pods still run the old template.
    obj = cluster.obj("prefill")
    obj["status"]["observedGeneration"] = obj["metadata"]["generation"]
    cluster.reconcile(spec)
    prefill = next(t for t in cluster.status.targets if t.name == "prefill")
    assert prefill.phase.value == "Updating" and "ready pods run configuration" in prefill.message
    assert cluster.stage_phases()["prefill"] == "Progressing"


def test_a_settings_change_waits_for_every_pods_connector_then_succeeds_without_restarts() -> None:
    cluster = fleet()
    cluster.run(SPEC)
    generations = {name: cluster.obj(name)["metadata"]["generation"] for name in ("prefill", "decode")}
    cluster.frozen_connectors.add("prefill")  # its pods keep reporting the old settings
    spec = spec_with(**{"connector.leaseMode": "leaseAll"})
    cluster.writes.clear()
    cluster.reconcile(spec)
    cluster.reconcile(spec)
    assert cluster.stage_phases()["prefill"] == "Progressing"
    prefill = next(t for t in cluster.status.targets if t.name == "prefill")
    assert prefill.phase.value == "Updating"
    assert "pod prefill-0: connector runs settings" in prefill.message and "(lease mode selective)" in prefill.message
    assert "pod prefill-1:" in prefill.message
    assert cluster.reasons().count("SettingsNotVerified") == 1  # announced once, not every reconcile
    cluster.frozen_connectors.clear()
    status = cluster.run(spec)
    assert status.phase is Phase.READY and cluster.stage_phases()["decode"] == "Succeeded"
    # Only the settings files were written: no vLLM pod template changed, no pod restarted.
    assert cluster.writes == [("ConfigMap", "prefill-moonlease"), ("ConfigMap", "decode-moonlease")]
    assert {name: cluster.obj(name)["metadata"]["generation"] for name in generations} == generations


def test_a_pod_that_never_reports_the_settings_times_out_and_rolls_back() -> None:
    cluster = fleet()
    cluster.run(SPEC)
    before = copy.deepcopy(cluster.config_maps["prefill-moonlease"]["data"])
    cluster.frozen_connectors.add("prefill")
    spec = spec_with(**{"connector.leaseMode": "leaseAll"})
    cluster.reconcile(spec)
    cluster.reconcile(spec)
    cluster.now += datetime.timedelta(seconds=61)
    status = cluster.run(spec)
    assert status.phase is Phase.DEGRADED and status.condition("Degraded").reason == "RolledBack"
    assert cluster.stage_phases()["prefill"] == "RolledBack"
    assert "connector settings not verified" in (cluster.status.stages[1].message or "")
    assert cluster.config_maps["prefill-moonlease"]["data"] == before  # the live settings went back


def _fail_decode_after_prefill_succeeded(cluster: Cluster, spec: dict[str, Any]) -> None:
    """Forward: prefill's connectors switch (stage Succeeded); decode's never do, and the
    decode stage times out. Then prefill's kubelet stops delivering files too."""
    cluster.frozen_connectors.add("decode")
    for _ in range(3):
        cluster.reconcile(spec)
    assert cluster.stage_phases() == {"master": "Skipped", "prefill": "Succeeded", "decode": "Progressing"}
    cluster.frozen_connectors.add("prefill")  # its connectors keep the settings they run now
    cluster.now += datetime.timedelta(seconds=61)


def test_a_settings_rollback_is_done_only_once_the_connectors_run_the_restored_file() -> None:
    cluster = fleet()
    cluster.run(SPEC)
    before = copy.deepcopy(cluster.config_maps["prefill-moonlease"]["data"])
    spec = spec_with(**{"connector.leaseMode": "leaseAll"})
    _fail_decode_after_prefill_succeeded(cluster, spec)
    for _ in range(4):
        cluster.reconcile(spec)
    # The file is back, the controller has nothing to do (no pod template changed) — and still the
    # stage is not rolled back: prefill's connectors run leaseAll.
    assert cluster.config_maps["prefill-moonlease"]["data"] == before
    assert cluster.stage_phases() == {"master": "Skipped", "prefill": "RollingBack", "decode": "RolledBack"}
    status = cluster.status
    assert status.phase is Phase.ROLLING_BACK
    prefill = next(t for t in status.targets if t.name == "prefill")
    assert prefill.phase.value == "RollingBack"
    assert prefill.message.startswith("restored connector settings not verified: pod prefill-0: connector runs")
    assert "(lease mode leaseAll)" in prefill.message
    assert "restored connector settings not verified" in status.condition("Progressing").message
    cluster.frozen_connectors.clear()  # the kubelet delivers the restored file
    status = cluster.run(spec)
    assert status.phase is Phase.DEGRADED and status.condition("Degraded").reason == "RolledBack"
    assert cluster.stage_phases() == {"master": "Skipped", "prefill": "RolledBack", "decode": "RolledBack"}


def test_a_settings_rollback_the_connectors_never_take_is_reported_incomplete() -> None:
    cluster = fleet()
    cluster.run(SPEC)
    spec = spec_with(**{"connector.leaseMode": "leaseAll"})
    _fail_decode_after_prefill_succeeded(cluster, spec)
    for _ in range(3):
        cluster.reconcile(spec)
    assert cluster.stage_phases()["prefill"] == "RollingBack"
    cluster.now += datetime.timedelta(seconds=61)
    status = cluster.run(spec)
    assert cluster.stage_phases() == {"master": "Skipped", "prefill": "RollbackFailed", "decode": "RolledBack"}
    degraded = status.condition("Degraded")
    assert status.phase is Phase.DEGRADED and degraded.reason == "RollbackIncomplete"
    assert "restored connector settings not verified" in status.stages[1].message
    assert "lease mode leaseAll" in status.stages[1].message


def test_settings_a_connector_refuses_fail_the_stage_at_once() -> None:
    cluster = fleet()
    cluster.run(SPEC)
    cluster.refusing_connectors.add("prefill")
    spec = spec_with(**{"connector.leaseMode": "leaseAll"})
    for _ in range(3):
        cluster.reconcile(spec)  # no clock advance: no timeout is waited for
    assert cluster.stage_phases()["prefill"] in ("RollingBack", "RolledBack")
    failure = cluster.status.stages[1].message
    assert "connector settings not verified" in failure and "it refused them (model_unsupported)" in failure
    status = cluster.run(spec)
    assert status.phase is Phase.DEGRADED and cluster.stage_phases()["prefill"] == "RolledBack"


def test_a_master_rollback_is_done_only_once_its_pods_run_the_restored_flags() -> None:
    cluster = fleet()
    cluster.reconcile(SPEC)
    cluster.settle("mooncake-master", fail=True)
    cluster.reconcile(SPEC)  # failed on sight: its own stage rolls back at once
    assert cluster.stage_phases()["master"] == "RollingBack"
    new = copy.deepcopy(template(cluster, "mooncake-master")["spec"])  # --eviction_ratio=0.05 restored ...
    new["containers"][0]["args"] = ["--rpc_port=50051", "--eviction_ratio=0.1"]
    cluster.pod_specs["mooncake-master"] = new  # ... but the pods run the policy's flag
    cluster.settle("mooncake-master")
    cluster.reconcile(SPEC)
    assert cluster.stage_phases()["master"] == "RollingBack"
    master = next(t for t in cluster.status.targets if t.name == "mooncake-master")
    assert master.message == ("restored master flags not verified: pod mooncake-master-0: runs"
                              " --eviction_ratio=0.1 (wants 0.05)")
    del cluster.pod_specs["mooncake-master"]
    cluster.reconcile(SPEC)
    assert cluster.stage_phases()["master"] == "RolledBack"


def test_decode_before_prefill_when_asked() -> None:
    cluster = fleet()
    cluster.run(spec_with(**{"rollout.stages": ["master", "decode", "prefill"]}))
    order = [name for kind, name in cluster.writes if kind != "ConfigMap"]
    assert order == ["mooncake-master", "decode", "prefill"]


def test_a_connector_change_does_not_restart_the_master() -> None:
    cluster = fleet()
    cluster.run(SPEC)
    master_generation = cluster.obj("mooncake-master")["metadata"]["generation"]
    cluster.writes.clear()
    status = cluster.run(spec_with(**{"connector.leaseMode": "leaseAll"}))
    assert status.phase is Phase.READY and status.revision == 2
    assert cluster.obj("mooncake-master")["metadata"]["generation"] == master_generation
    assert cluster.stage_phases() == {"master": "Skipped", "prefill": "Succeeded", "decode": "Succeeded"}
    assert [n for _, n in cluster.writes] == ["prefill-moonlease", "decode-moonlease"]  # settings files only
    assert "MasterRestart" not in cluster.reasons()[cluster.reasons().index("RolloutComplete") + 1:]


def test_a_master_without_settings_is_never_touched() -> None:
    cluster = fleet()
    spec = spec_with(master={"name": "mooncake-master", "version": "0.3.14"})
    cluster.run(spec)
    assert cluster.stage_phases()["master"] == "Skipped" and "MasterRestart" not in cluster.reasons()
    assert POLICY_LABEL not in cluster.obj("mooncake-master")["metadata"]["labels"]


# ---- approval, pause --------------------------------------------------------------------------

def test_a_master_restart_waits_for_approval_of_exactly_this_change() -> None:
    cluster = fleet()
    spec = spec_with(**{"master.requireApprovalForRestart": True})
    for _ in range(3):
        cluster.reconcile(spec)
    status = cluster.status
    assert status.phase is Phase.AWAITING_APPROVAL and cluster.writes == []
    assert status.pending_approval is not None and status.pending_approval in status.stages[0].message
    assert "empties the Mooncake store" in status.stages[0].message
    assert cluster.reasons().count("StageAwaitingApproval") == 1  # announced once

    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = "something-else"
    cluster.reconcile(spec)
    assert cluster.writes == []
    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = status.pending_approval
    assert cluster.run(spec).phase is Phase.READY and cluster.status.pending_approval is None
    assert cluster.writes[0] == ("Deployment", "mooncake-master")


def test_paused_holds_before_the_next_stage_and_resumes() -> None:
    cluster = fleet()
    cluster.reconcile(SPEC)  # the master stage starts
    paused = spec_with(**{"rollout.paused": True})
    cluster.settle("mooncake-master")
    for _ in range(3):
        cluster.reconcile(paused)
    assert cluster.status.phase is Phase.PAUSED and cluster.stage_phases()["prefill"] == "Pending"
    assert cluster.writes == [("Deployment", "mooncake-master")]  # the running stage finished; nothing new
    assert cluster.reasons().count("Paused") == 1
    assert cluster.run(SPEC).phase is Phase.READY


def test_pause_between_stages_counts_on_the_clock() -> None:
    cluster = fleet()
    spec = spec_with(**{"rollout.pauseBetweenStagesSeconds": 300})
    cluster.reconcile(spec)
    cluster.settle("mooncake-master")
    cluster.reconcile(spec)
    assert cluster.stage_phases()["master"] == "Succeeded" and cluster.stage_phases()["prefill"] == "Pending"
    cluster.now += datetime.timedelta(seconds=299)
    cluster.reconcile(spec)
    assert cluster.writes == [("Deployment", "mooncake-master")]
    ready = cluster.status.condition("Progressing")
    assert ready is not None and ready.reason == "PauseBetweenStages"
    cluster.now += datetime.timedelta(seconds=2)
    cluster.reconcile(spec)
    assert cluster.writes[-1] == ("Deployment", "prefill")


# ---- failure --------------------------------------------------------------------------------------

def test_a_stalled_stage_times_out_and_every_changed_stage_rolls_back_last_first() -> None:
    cluster = fleet()
    before = {name: copy.deepcopy(template(cluster, name)) for name in ("mooncake-master", "prefill", "decode")}
    cluster.reconcile(SPEC)
    cluster.settle("mooncake-master")
    cluster.reconcile(SPEC)
    cluster.settle("prefill")
    cluster.reconcile(SPEC)  # decode starts ...
    cluster.observe_only("decode")  # ... and never moves
    cluster.now += datetime.timedelta(seconds=60)
    cluster.reconcile(SPEC)
    assert cluster.status.phase is Phase.PROGRESSING  # exactly the timeout: not yet
    cluster.now += datetime.timedelta(seconds=1)
    cluster.reconcile(SPEC)
    assert cluster.stage_phases() == {"master": "Succeeded", "prefill": "Succeeded", "decode": "RollingBack"}
    assert cluster.status.phase is Phase.ROLLING_BACK and cluster.status.failed_stage is StageName.DECODE
    assert template(cluster, "decode") == before["decode"]
    cluster.settle("decode")
    cluster.reconcile(SPEC)
    assert cluster.stage_phases()["decode"] == "RolledBack" and cluster.stage_phases()["prefill"] == "RollingBack"
    assert template(cluster, "prefill") == before["prefill"] and template(cluster, "mooncake-master") != before["mooncake-master"]
    cluster.settle("prefill")
    cluster.reconcile(SPEC)
    # A target stage failed: the master keeps its new settings (rolling it back would empty the
    # store a second time) unless that rollback is approved.
    status = cluster.status
    assert status.phase is Phase.DEGRADED and cluster.stage_phases() == {
        "master": "Succeeded", "prefill": "RolledBack", "decode": "RolledBack"}
    assert template(cluster, "mooncake-master") != before["mooncake-master"]
    assert status.pending_approval is not None and status.pending_approval.startswith("rollback:1:")
    degraded = status.condition("Degraded")
    assert degraded is not None and "the master keeps its new settings" in degraded.message
    assert status.pending_approval in degraded.message and "--eviction_ratio: 0.1 -> 0.05" in degraded.message
    for _ in range(2):
        cluster.reconcile(SPEC)
    assert template(cluster, "mooncake-master") != before["mooncake-master"]
    assert cluster.reasons()[cluster.reasons().index("StageFailed"):] == [
        "StageFailed", "StageRollingBack", "StageRolledBack",  # decode, which failed
        "StageRollingBack", "StageRolledBack",  # prefill
        "AwaitingApproval",  # the master's rollback, offered once
        "RolledBack"]
    assert "MasterRestart" not in cluster.reasons()[cluster.reasons().index("StageFailed"):]

    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = status.pending_approval
    cluster.reconcile(SPEC)
    assert cluster.stage_phases()["master"] == "RollingBack"
    cluster.settle("mooncake-master")
    cluster.reconcile(SPEC)
    status = cluster.status
    assert status.phase is Phase.DEGRADED and cluster.stage_phases() == dict.fromkeys(("master", "prefill", "decode"), "RolledBack")
    assert {name: template(cluster, name) for name in before} == before
    degraded = status.condition("Degraded")
    assert degraded is not None and degraded.reason == "RolledBack" and "not ready within 60s" in degraded.message
    assert "not ready within 60s" in status.stages[2].message and status.stages[2].message.endswith("rolled back")
    assert cluster.reasons()[-4:] == ["MasterRestart", "StageRollingBack", "StageRolledBack", "RolledBack"]
    warnings = {r for t, r, _ in cluster.events if t == "Warning"}
    assert {"StageFailed", "StageRollingBack", "MasterRestart", "RolledBack"} <= warnings

    # Degraded is a resting state: nothing more happens until the spec changes.
    writes = len(cluster.writes)
    plan = cluster.reconcile(SPEC)
    assert plan.changes == () and plan.events == () and len(cluster.writes) == writes
    status = cluster.run(spec_with(**{"connector.leaseMode": "leaseAll"}))
    assert status.phase is Phase.READY and status.revision == 2 and status.applied_revision == 2


def test_a_failed_master_stage_rolls_the_master_back_after_approval() -> None:
    cluster = fleet()
    spec = spec_with(**{"master.requireApprovalForRestart": True})
    cluster.reconcile(spec)
    forward = cluster.status.pending_approval
    assert forward is not None and forward.startswith("forward:1:")
    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = forward
    cluster.reconcile(spec)
    cluster.settle("mooncake-master", fail=True)
    writes = len(cluster.writes)
    for _ in range(2):
        cluster.reconcile(spec)
    status = cluster.status
    assert status.phase is Phase.AWAITING_APPROVAL and len(cluster.writes) == writes  # the forward approval is not enough
    assert status.pending_approval is not None and status.pending_approval.startswith("rollback:1:")
    assert "rollback waits for approval" in status.stages[0].message and cluster.stage_phases()["master"] == "Failed"
    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = status.pending_approval
    cluster.reconcile(spec)
    assert cluster.stage_phases()["master"] == "RollingBack" and "MasterRestart" in cluster.reasons()[-3:]


def test_failing_pods_fail_the_stage_at_once() -> None:
    cluster = fleet()
    cluster.reconcile(SPEC)
    cluster.settle("mooncake-master", fail=True)
    cluster.reconcile(SPEC)
    assert cluster.stage_phases()["master"] == "RollingBack"
    assert cluster.status.stages[0].message == "Deployment/mooncake-master: rollout failed: m; rolling back"
    assert cluster.now == cluster.status.stages[0].started_at  # failed on sight, no timeout waited for


def test_halt_leaves_the_fleet_where_it_failed() -> None:
    cluster = fleet()
    spec = spec_with(**{"rollout.onFailure": "halt"})
    cluster.reconcile(spec)
    cluster.settle("mooncake-master")
    cluster.reconcile(spec)
    cluster.settle("prefill", fail=True)
    changed = copy.deepcopy(template(cluster, "prefill"))
    for _ in range(3):
        cluster.reconcile(spec)
    status = cluster.status
    assert status.phase is Phase.DEGRADED and cluster.stage_phases()["prefill"] == "Failed"
    assert template(cluster, "prefill") == changed and len(cluster.writes) == 3
    degraded = status.condition("Degraded")
    assert degraded is not None and degraded.reason == "Halted"
    assert cluster.reasons().count("Halted") == 1


# ---- drift, release -------------------------------------------------------------------------------

def test_a_master_drift_repair_waits_for_its_own_approval() -> None:
    cluster = fleet()
    spec = spec_with(**{"master.requireApprovalForRestart": True})
    cluster.reconcile(spec)
    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = cluster.status.pending_approval or ""
    assert cluster.run(spec).phase is Phase.READY
    args = cluster.obj("mooncake-master")["spec"]["template"]["spec"]["containers"][0]["args"]
    args[args.index("--eviction_ratio=0.1")] = "--eviction_ratio=0.3"  # someone edits the master
    cluster.obj("mooncake-master")["metadata"]["generation"] += 1
    cluster.writes.clear()
    status = cluster.run(spec)
    assert status.phase is Phase.AWAITING_APPROVAL and cluster.writes == []
    assert status.pending_approval is not None and status.pending_approval.startswith("forward:2:")
    assert "--eviction_ratio: 0.3 -> 0.1" in status.stages[0].message
    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = status.pending_approval
    assert cluster.run(spec).phase is Phase.READY and cluster.writes == [("Deployment", "mooncake-master")]


def test_a_drifted_workload_is_brought_back_alone() -> None:
    cluster = fleet()
    cluster.run(SPEC)
    data = cluster.config_maps["decode-moonlease"]["data"]
    data["connector-settings.json"] = data["connector-settings.json"].replace('"selective"', '"leaseAll"')
    cluster.writes.clear()
    status = cluster.run(SPEC)
    assert status.phase is Phase.READY and status.revision == 2
    assert cluster.writes == [("ConfigMap", "decode-moonlease")]
    # Someone drops the settings file from the arguments: re-adopted, that workload alone.
    args = cluster.obj("prefill")["spec"]["template"]["spec"]["containers"][0]["args"]
    args[-1] = args[-1].replace('"mooncake_settings_file"', '"x"')
    cluster.obj("prefill")["metadata"]["generation"] += 1
    cluster.writes.clear()
    status = cluster.run(SPEC)
    assert status.phase is Phase.READY and status.revision == 3
    assert cluster.writes == [("Deployment", "prefill")]


def test_a_workload_no_longer_covered_gets_its_original_back() -> None:
    cluster = fleet()
    original = copy.deepcopy(cluster.obj("decode"))
    cluster.run(SPEC)
    spec = spec_with(targets=[SPEC["targets"][0]], **{"rollout.stages": ["master", "prefill"]})
    cluster.run(spec)
    restored = cluster.obj("decode")
    assert restored["spec"] == original["spec"] and restored["metadata"]["labels"] == original["metadata"]["labels"]
    assert "Released" in cluster.reasons()


def test_release_restores_the_targets_and_keeps_the_master_by_default() -> None:
    cluster = fleet()
    originals = copy.deepcopy(cluster.workloads)
    cluster.run(SPEC)
    configured_master = copy.deepcopy(cluster.obj("mooncake-master")["spec"])
    plan = plan_release(policy=PolicyRef("fleet", "ns", 1, ""), spec=read_spec(SPEC), previous=cluster.status,
                        managed=list(cluster.workloads.values()), now=T0)
    assert [e.reason for e in plan.events] == ["Restored", "Released"] and plan.pending_approval is None
    assert len(plan.changes) == 3
    for change in plan.changes:
        new = build_update(cluster.workloads[change.ref], change)
        assert new is not None and "annotations" not in new["metadata"]
        assert new["metadata"]["labels"] == originals[change.ref]["metadata"]["labels"]
        expected = configured_master if change.name == "mooncake-master" else originals[change.ref]["spec"]
        assert new["spec"] == expected


def test_release_gives_the_settings_config_maps_back_and_keeps_the_masters_file_by_default() -> None:
    cluster = fleet()
    cluster.run(SPEC)
    assert set(cluster.config_maps) == {"prefill-moonlease", "decode-moonlease"}
    managed = [*cluster.workloads.values(), *({"kind": "ConfigMap", **c} for c in cluster.config_maps.values())]
    # A master file the policy changed (as the deletion reads it): no settings label.
    master_file = copy.deepcopy(managed[-1])
    master_file["metadata"]["name"] = "cfg"
    master_file["metadata"]["labels"].pop(SETTINGS_CONFIG_MAP_LABEL)
    spec = read_spec(spec_with(**{"master.configMap": {"name": "cfg", "key": "m.json"}}))
    plan = plan_release(policy=PolicyRef("fleet", "ns", 1, ""), spec=spec, previous=cluster.status,
                        managed=[*managed, master_file], now=T0)
    actions = {c.name: c.action for c in plan.changes if c.kind == "ConfigMap"}
    assert actions == {"prefill-moonlease": ChangeAction.RELEASE, "decode-moonlease": ChangeAction.RELEASE,
                       "cfg": ChangeAction.FORGET}


def test_config_maps_are_named_for_reading_by_name() -> None:
    """The operator reads ConfigMaps by name only (RBAC `get`): the targets' settings files while
    reconciling; every workload's settings file and the master's file when the policy is deleted."""
    cluster = fleet()
    spec = read_spec(spec_with(**{"master.configMap": {"name": "cfg", "key": "m.json"}}))
    assert settings_config_maps_to_read(spec, cluster.workloads) == ("prefill-moonlease", "decode-moonlease")
    assert plan_fetch(spec, PolicyStatus()).spec is spec
    others = [*cluster.workloads.values(), deployment("unrelated")]
    assert config_maps_to_restore(spec, others) == (
        "mooncake-master-moonlease", "prefill-moonlease", "decode-moonlease", "unrelated-moonlease", "cfg")
    assert config_maps_to_restore(read_spec({"master": {}}), others)[-1] == "unrelated-moonlease"


def test_release_with_restore_restarts_the_master_only_once_approved() -> None:
    cluster = fleet()
    originals = copy.deepcopy(cluster.workloads)
    spec = spec_with(**{"master.onDelete": "restore", "master.requireApprovalForRestart": True})
    cluster.reconcile(spec)
    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = cluster.status.pending_approval or ""
    cluster.run(spec)
    policy = PolicyRef("fleet", "ns", 1, "", dict(cluster.annotations))
    plan = plan_release(policy=policy, spec=read_spec(spec), previous=cluster.status,
                        managed=list(cluster.workloads.values()), now=T0)
    assert plan.pending_approval == f"restore:1:{plan.pending_approval.split(':')[2]}"
    assert [c.name for c in plan.changes] == ["decode", "prefill"]  # the targets go on; the master waits
    assert [e.reason for e in plan.events] == ["AwaitingApproval", "Restored"]
    assert "--eviction_ratio: 0.1 -> 0.05" in plan.events[0].message
    assert plan.status is not None and plan.status.pending_approval == plan.pending_approval
    ready = plan.status.condition("Ready")  # the targets are going back: not Ready any more
    assert ready is not None and ready.status.value == "False" and ready.reason == "AwaitingApproval"
    assert plan.pending_approval in ready.message
    # Asked again (kopf retries), nothing is announced twice.
    again = plan_release(policy=policy, spec=read_spec(spec), previous=plan.status,
                         managed=list(cluster.workloads.values()), now=T0)
    assert again.status is None and [e.reason for e in again.events] == ["Restored"]

    approved = PolicyRef("fleet", "ns", 1, "", {APPROVE_MASTER_RESTART_ANNOTATION: plan.pending_approval})
    plan = plan_release(policy=approved, spec=read_spec(spec), previous=plan.status,
                        managed=list(cluster.workloads.values()), now=T0)
    assert plan.pending_approval is None and [e.reason for e in plan.events] == ["MasterRestart", "Restored"]
    for change in plan.changes:
        new = build_update(cluster.workloads[change.ref], change)
        assert new is not None and new["spec"] == originals[change.ref]["spec"]


# ---- refusals -----------------------------------------------------------------------------------

def test_an_invalid_spec_changes_nothing_and_says_why_once_per_generation() -> None:
    cluster = fleet()
    bad = spec_with(**{"rollout.stages": ["master", "decode"]})
    for _ in range(3):
        plan = cluster.reconcile(bad)
        assert plan.changes == ()
    assert cluster.status.phase is Phase.INVALID and cluster.reasons() == ["InvalidSpec"]
    cluster.generation = 2
    cluster.reconcile(bad)
    assert cluster.reasons() == ["InvalidSpec", "InvalidSpec"]


@pytest.mark.parametrize(("setup", "reason", "needle"), [
    ("foreign", "ForeignConnector", "LMCacheConnectorV1"),
    ("old-master", "Incompatible", "runs Mooncake 0.3.13"),
    ("undeclared", "Incompatible", "Mooncake version unknown"),
    ("conflict", "ConflictingPolicy", "already claimed by policy older"),
])
def test_refusals_change_nothing(setup: str, reason: str, needle: str) -> None:
    cluster = fleet()
    spec = copy.deepcopy(SPEC)
    if setup == "foreign":
        cluster.obj("decode")["spec"]["template"]["spec"]["containers"][0]["args"] += [
            "--kv-transfer-config", json.dumps({"kv_connector": "LMCacheConnectorV1"})]
    elif setup == "old-master":
        cluster.obj("mooncake-master")["spec"]["template"]["spec"]["containers"][0]["image"] = "reg/mooncake-master:0.3.13"
    elif setup == "undeclared":
        del spec["targets"][1]["mooncakeVersion"]
    else:
        cluster.others = [{"metadata": {"name": "older", "creationTimestamp": "2025-12-31T00:00:00Z"},
                           "spec": {"master": {"name": "other-master"}, "targets": [{"name": "decode", "role": "decode"}]}}]
    before = copy.deepcopy(cluster.workloads)
    for _ in range(2):
        plan = cluster.reconcile(spec)
        assert plan.changes == ()
    assert cluster.workloads == before
    status = cluster.status
    invalid = status.condition("Invalid")
    assert status.phase is Phase.INVALID and invalid is not None and invalid.reason == reason and needle in invalid.message
    assert cluster.reasons() == [reason]


def test_missing_workloads_keep_the_policy_pending() -> None:
    cluster = Cluster(master_deployment(), deployment("prefill"))
    cluster.reconcile(SPEC)
    status = cluster.status
    ready = status.condition("Ready")
    assert status.phase is Phase.PENDING and ready is not None and "Deployment/decode (targets[1]) not found" in ready.message
    assert cluster.writes == []
    cluster.workloads[("Deployment", "decode")] = deployment("decode")
    cluster.settle("decode")
    assert cluster.run(SPEC).phase is Phase.READY


def test_plan_fetch_lists_pods_only_while_verifying() -> None:
    assert plan_fetch(read_spec(SPEC), PolicyStatus()).pods is False
    cluster = fleet()
    cluster.reconcile(SPEC)
    assert plan_fetch(read_spec(SPEC), cluster.status).pods is True
    assert plan_fetch(read_spec({"master": {}}), cluster.status).pods is False
    with_map = spec_with(**{"master.configMap": {"name": "cfg", "key": "m.json"}})
    assert plan_fetch(read_spec(with_map), PolicyStatus()).config_maps == ("cfg",)


def test_master_settings_in_a_config_map_restart_the_master_through_its_annotation() -> None:
    cluster = fleet()
    cluster.obj("mooncake-master")["spec"]["template"]["spec"]["containers"][0]["args"] = ["--config_path=/etc/m.json"]
    cluster.config_maps["cfg"] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"},
                                  "data": {"m.json": '{"rpc_port": 50051}'}}
    spec = spec_with(master={"name": "mooncake-master", "version": "0.3.14", "evictionRatio": 0.2,
                             "configMap": {"name": "cfg", "key": "m.json"}, "requireApprovalForRestart": False})
    assert cluster.run(spec).phase is Phase.READY
    assert json.loads(cluster.config_maps["cfg"]["data"]["m.json"]) == {"rpc_port": 50051, "eviction_ratio": 0.2}
    annotations = template(cluster, "mooncake-master")["metadata"]["annotations"]
    assert annotations[CONFIG_HASH_ANNOTATION] == cluster.reconcile(spec).all_targets[0].config_hash
    assert cluster.writes[:2] == [("ConfigMap", "cfg"), ("Deployment", "mooncake-master")]


# ---- fleet, claims, compatibility, health -----------------------------------------------------

def test_selectors_resolve_to_sorted_workloads_once() -> None:
    workloads = {("Deployment", n): deployment(n, labels={"tier": "vllm"}) for n in ("b", "a", "mooncake-master")}
    workloads[("StatefulSet", "c")] = deployment("c", labels={"tier": "vllm"}, kind="StatefulSet")
    spec = parse_spec({"master": {"name": "mooncake-master"},
                       "targets": [{"name": "b", "role": "decode"},
                                   {"selector": {"matchLabels": {"tier": "vllm"}}, "role": "prefill"},
                                   {"kind": "StatefulSet", "selector": {"matchLabels": {"tier": "none"}}, "role": "prefill"}]})
    resolved = resolve_fleet(spec, workloads)
    assert [(m.stage.value, m.name) for m in resolved.members] == [
        ("master", "mooncake-master"), ("decode", "b"), ("prefill", "a")]
    assert resolved.missing == ("no StatefulSet matches the selector of targets[2]",)


def test_claims_go_to_the_label_then_the_oldest() -> None:
    workloads = {("Deployment", n): deployment(n) for n in ("m", "x")}
    spec = parse_spec({"master": {"name": "m"}, "targets": [{"name": "x", "role": "decode"}]})
    mine = resolve_fleet(spec, workloads)
    older = Claim("a-older", "2026-01-01T00:00:00Z", frozenset({("Deployment", "x")}))
    assert evaluate_claims(name="b", created="2026-01-02T00:00:00Z", fleet=mine, others=[older], workloads=workloads)
    assert not evaluate_claims(name="b", created="2025-12-31T00:00:00Z", fleet=mine, others=[older], workloads=workloads)
    workloads[("Deployment", "x")]["metadata"]["labels"][POLICY_LABEL] = "a-older"
    assert evaluate_claims(name="b", created="2025-12-31T00:00:00Z", fleet=mine, others=[older], workloads=workloads)
    assert not evaluate_claims(name="b", created="2025-12-31T00:00:00Z", fleet=mine, others=[], workloads=workloads)


@pytest.mark.parametrize(("text", "ok"), [
    ("0.3.14", True), ("v0.3.14", True), ("0.3.14.post1", True), ("0.3.15", True), ("1.0.0", True),
    ("0.3.13", False), ("0.3.13.post1", False), ("0.3.14.dev20261022", False), ("0.3.14-rc1", False),
    ("0.2.99", False),
])
def test_mooncake_versions_compare_like_releases(text: str, ok: bool) -> None:
    version = parse_mooncake_version(text)
    assert version is not None and version.at_least((0, 3, 14)) is ok


@pytest.mark.parametrize(("image", "tag"), [
    ("reg.local:5000/mooncake/mooncake-master:v0.3.14", "v0.3.14"),
    ("vllm/vllm-openai:v0.9.1", None), ("reg.local:5000/mooncake-master", None),
    ("ghcr.io/x/vllm-mooncake:0.3.14@sha256:abc", "0.3.14"),
])
def test_only_mooncake_images_tell_a_mooncake_version(image: str, tag: str | None) -> None:
    assert image_mooncake_version(image) == tag


def test_compatibility_gate() -> None:
    spec = parse_spec({**SPEC, "connector": {"leaseMode": "leaseAll"}})
    unknown = [VersionSource(StageName.DECODE, "Deployment", "d", None, "vllm:0.9.1")]
    assert evaluate_compatibility(spec, unknown) == []  # leaseAll needs nothing
    selective = parse_spec(SPEC)
    assert "Mooncake version unknown" in evaluate_compatibility(selective, unknown)[0]
    assert evaluate_compatibility(selective, [VersionSource(StageName.MASTER, "Deployment", "m", "0.3.14", None)]) == []


def test_compatibility_gate_knows_soft_pins_need_evictable_pins() -> None:
    """Retention pin (issue 21) with allow_evict_soft_pinned_objects=false: pinned resume sets
    leave only when their pins expire and puts fail meanwhile. The CEL rule refuses such a spec;
    the gate says so again for a spec that bypassed validation."""
    base = parse_spec({**SPEC, "connector": {"leaseMode": "leaseAll", "retentionPin": True}})
    assert evaluate_compatibility(base, []) == []
    bad = base.model_copy(update={"master": base.master.model_copy(
        update={"allow_evict_soft_pinned_objects": False})})
    assert "allowEvictSoftPinnedObjects" in evaluate_compatibility(bad, [])[0]
    with pytest.raises(PolicySpecError):
        parse_spec({**SPEC, "connector": {"retentionPin": True},
                    "master": {**SPEC["master"], "allowEvictSoftPinnedObjects": False}})


def test_compatibility_gate_knows_evict_needs_the_masters_watermark() -> None:
    """Retention evict keeps the store under the master's eviction watermark: the spec must say
    what it is. The CEL rule refuses a spec without it; the gate says so again for a spec that
    bypassed validation; the watermark declared reaches the connector's settings."""
    from moonlease_operator.core.settings import build_connector_settings

    spec = parse_spec({**SPEC, "connector": {"retentionEvict": True},
                       "master": {**SPEC["master"], "evictionHighWatermarkRatio": 0.8}})
    assert evaluate_compatibility(spec, []) == []
    settings = build_connector_settings(spec.connector, spec.master.eviction_high_watermark_ratio)
    assert settings.file["mooncake_retention_evict"] is True
    assert settings.file["mooncake_retention_evict_watermark"] == 0.8
    off = build_connector_settings(parse_spec(SPEC).connector).file  # off is written, as off
    assert off["mooncake_retention_evict"] is False and "mooncake_retention_evict_watermark" not in off
    bad = spec.model_copy(update={"master": spec.master.model_copy(
        update={"eviction_high_watermark_ratio": None})})
    assert "evictionHighWatermarkRatio" in evaluate_compatibility(bad, [])[0]
    with pytest.raises(PolicySpecError):
        parse_spec({**SPEC, "connector": {"retentionEvict": True}})


def test_health_from_the_controller_and_the_pods() -> None:
    obj = deployment("w")
    obj["metadata"]["generation"] = 3
    obj["status"] = {"observedGeneration": 2}
    assert evaluate_health(obj, None).health is Health.PROGRESSING
    obj["status"] = {"observedGeneration": 3, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2,
                     "availableReplicas": 2}
    assert evaluate_health(obj, None).health is Health.COMPLETE
    obj["spec"]["template"]["metadata"]["annotations"] = {CONFIG_HASH_ANNOTATION: "h2"}
    crashing = {"metadata": {"name": "w-1", "namespace": "ns", "labels": {"app": "w"},
                             "annotations": {CONFIG_HASH_ANNOTATION: "h2"}},
                "status": {"containerStatuses": [{"state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}}
    assert evaluate_health(obj, [crashing]).health is Health.FAILED
    crashing["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] = "h1"  # an older template's pod
    assert evaluate_health(obj, [crashing]).health is Health.PROGRESSING  # and no pod runs h2 yet


def test_a_master_change_that_did_not_land_is_announced_again_before_the_retry() -> None:
    cluster = fleet()
    first = cluster.reconcile(SPEC)
    assert [e.reason for e in first.events].count("MasterRestart") == 1
    # The write never reached the server (an outage after the status was written).
    cluster.workloads[("Deployment", "mooncake-master")] = master_deployment()
    cluster.settle("mooncake-master")
    retry = cluster.reconcile(SPEC)
    assert [e.reason for e in retry.events] == ["MasterRestart"] and [c.name for c in retry.changes] == ["mooncake-master"]
    # Once it landed, waiting for the controller announces nothing more.
    assert cluster.reconcile(SPEC).events == ()


def test_every_status_the_planner_writes_fits_the_crd() -> None:
    import jsonschema

    from moonlease_operator.crd import build_crd, validation_schema

    validator = jsonschema.Draft4Validator(validation_schema(build_crd(), strict=True))
    cluster = fleet()
    seen = set()
    for spec in (SPEC, spec_with(**{"master.requireApprovalForRestart": True}), spec_with(**{"rollout.onFailure": "halt"})):
        cluster.reconcile(spec)
        cluster.settle("mooncake-master", fail=True)
        for _ in range(4):
            cluster.reconcile(spec)
            present = {k: v for k, v in cluster.status_json.items() if v is not None}
            validator.validate({"apiVersion": "moonlease.io/v1alpha1", "kind": "MooncakeLeasePolicy",
                                "metadata": {"name": "fleet"}, "spec": spec, "status": present})
            seen.add(cluster.status.phase)
    assert {Phase.ROLLING_BACK, Phase.DEGRADED} <= seen


# ---- per-member problems (issue 15, item 5) ---------------------------------------------------------

def test_a_deleted_target_is_reported_on_itself_and_the_rest_carries_on() -> None:
    cluster = fleet()
    assert cluster.run(SPEC).phase is Phase.READY
    decode = cluster.workloads.pop(("Deployment", "decode"))
    cluster.writes.clear()
    plan = cluster.reconcile(spec_with(**{"connector.leaseMode": "leaseAll"}))
    assert plan.changes and cluster.writes == [("ConfigMap", "prefill-moonlease")]  # not frozen by the missing one
    status = cluster.run(spec_with(**{"connector.leaseMode": "leaseAll"}))
    assert status.phase is Phase.DEGRADED and status.failed_stage is None  # never Ready with a target missing
    degraded = status.condition("Degraded")
    assert degraded is not None and degraded.reason == "MemberExcluded" and "Deployment/decode: not found" in degraded.message
    left = next(t for t in status.targets if t.name == "decode")
    assert left.phase.value == "Excluded" and left.message == "left out: not found"
    said = cluster.reasons().count("MemberExcluded")  # when left out, and the phase's Degraded event
    cluster.run(spec_with(**{"connector.leaseMode": "leaseAll"}))
    assert 1 <= said <= 2 and cluster.reasons().count("MemberExcluded") == said  # not repeated

    # It comes back (as it was when deleted): a new attempt brings it in.
    cluster.workloads[("Deployment", "decode")] = decode
    status = cluster.run(spec_with(**{"connector.leaseMode": "leaseAll"}))
    assert status.phase is Phase.READY and status.targets == []
    assert {c.phase.value for c in status.target_counts} == {"Ready"} and status.targets_total == 3


def test_a_rollback_half_way_continues_when_a_target_vanishes() -> None:
    cluster = rolled_to("decode")
    cluster.observe_only("decode")
    cluster.now += datetime.timedelta(seconds=61)
    cluster.reconcile(SPEC)
    assert cluster.stage_phases()["decode"] == "RollingBack"
    del cluster.workloads[("Deployment", "prefill")]  # gone while decode rolls back
    cluster.settle("decode")
    status = cluster.run(SPEC)
    assert cluster.stage_phases() == {"master": "Succeeded", "prefill": "RolledBack", "decode": "RolledBack"}
    assert status.phase is Phase.DEGRADED and status.failed_stage is StageName.DECODE
    assert next(t for t in status.targets if t.name == "prefill").phase.value == "Excluded"


def test_a_target_that_becomes_unmanageable_is_left_out_alone() -> None:
    cluster = fleet()
    cluster.run(SPEC)
    vllm = cluster.obj("decode")["spec"]["template"]["spec"]["containers"][0]
    vllm["command"], vllm["args"] = ["sh", "-c"], ["vllm serve m"]
    cluster.writes.clear()
    status = cluster.run(spec_with(**{"connector.leaseMode": "leaseAll"}))
    assert cluster.writes == [("ConfigMap", "prefill-moonlease")]  # the shell-wrapped one: not even its file
    left = next(t for t in status.targets if t.name == "decode")
    assert left.phase.value == "Excluded" and "through a shell script" in left.message
    assert status.phase is Phase.DEGRADED and status.condition("Degraded").reason == "MemberExcluded"


def test_the_master_stage_waits_until_its_running_pods_carry_the_new_flags() -> None:
    cluster = fleet()
    stale = copy.deepcopy(template(cluster, "mooncake-master")["spec"])  # --eviction_ratio=0.05
    cluster.pod_specs["mooncake-master"] = stale  # the pods claim the new template but run the old flags
    spec = spec_with(**{"master.requireApprovalForRestart": False})
    cluster.reconcile(spec)
    cluster.settle("mooncake-master")
    cluster.reconcile(spec)
    assert cluster.stage_phases()["master"] == "Progressing"
    master = next(t for t in cluster.status.targets if t.name == "mooncake-master")
    assert master.phase.value == "Updating"
    assert master.message == "master flags not verified: pod mooncake-master-0: runs --eviction_ratio=0.05 (wants 0.1)"
    del cluster.pod_specs["mooncake-master"]
    cluster.reconcile(spec)
    assert cluster.stage_phases()["master"] == "Succeeded"


def test_a_selector_that_selects_nothing_after_the_rollout_is_never_ready() -> None:
    cluster = Cluster(master_deployment(), deployment("prefill"), deployment("decode", labels={"tier": "decode"}))
    spec = spec_with(targets=[SPEC["targets"][0], {"selector": {"matchLabels": {"tier": "decode"}}, "role": "decode",
                                                  "mooncakeVersion": "0.3.14"}])
    assert cluster.run(spec).phase is Phase.READY
    del cluster.workloads[("Deployment", "decode")]
    status = cluster.run(spec)
    assert status.phase is Phase.DEGRADED and "no Deployment matches the selector of targets[1]" in \
        status.condition("Degraded").message


def test_a_target_claimed_by_another_policy_after_the_rollout_is_left_alone() -> None:
    cluster = fleet()
    cluster.run(SPEC)
    cluster.others = [{"metadata": {"name": "older", "creationTimestamp": "2025-12-31T00:00:00Z"},
                       "spec": {"master": {"name": "other-master"}, "targets": [{"name": "decode", "role": "decode"}]}}]
    cluster.obj("decode")["metadata"]["labels"][POLICY_LABEL] = "older"  # the other policy took it over
    claimed = copy.deepcopy(cluster.obj("decode"))
    cluster.writes.clear()
    status = cluster.run(spec_with(**{"connector.leaseMode": "leaseAll"}))
    assert cluster.writes == [("ConfigMap", "prefill-moonlease")] and cluster.obj("decode") == claimed
    left = next(t for t in status.targets if t.name == "decode")
    assert left.phase.value == "Excluded" and "is managed by policy older" in left.message
    assert status.phase is Phase.DEGRADED
