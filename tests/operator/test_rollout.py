"""The operator rolling policies out for real: kopf against the local API server, whose simulator
plays the Deployment and StatefulSet controllers (complete, stall or fail, as each test says)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import sys
from typing import Any

import aiohttp
import kopf
import pytest

from moonlease_dev.testbed.kube import CONFIGMAPS, DEPLOYMENTS, PODS, STATEFULSETS, LocalApiServer, is_rollout_complete
from moonlease_settings.config import MoonleaseConnectorConfig
from moonlease_settings.settings_file import SETTINGS_FILE_NAME, SETTINGS_FILE_PATH, parse_settings_file
from moonlease_operator.core.connector_delivery import (
    SETTINGS_PORT_ANNOTATION,
    SETTINGS_VOLUME,
    settings_config_map_name,
)
from tests.support.settings_volume import free_port, read_settings_endpoint
from moonlease_operator.api import APPROVE_MASTER_RESTART_ANNOTATION
from moonlease_operator.core.slots import CONFIG_HASH_ANNOTATION, ORIGINAL_ANNOTATION, POLICY_LABEL
from moonlease_operator.handlers import OperatorContext
from moonlease_operator.peering import build_peering_crds, build_peering_object
from moonlease_operator.runner import OperatorThread
from tests.fixtures.kube import FAST_OPTIONS
from tests.operator.fleet import (
    DECODE,
    NS,
    SPEC,
    USER_KV_CONFIG,
    WORKLOADS,
    ManualClock,
    as_left_by_users,
    condition,
    configured,
    create_fleet,
    operator_writes,
    phase,
    policy,
    reasons,
    let_reconcile,
    stage_phases,
    status,
    wait_for_stage_start,
    workload,
)

pytestmark = pytest.mark.operator

WAIT = 15.0


def vllm_container(obj: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")


def kv_config(container: dict[str, Any]) -> dict[str, Any]:
    args = container["args"]
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def template_versions(kube: LocalApiServer, name: str) -> list[dict[str, Any]]:
    """The distinct pod templates a workload went through, in order."""
    seen: list[dict[str, Any]] = []
    for version in kube.history(WORKLOADS[name], NS, name):
        if version is not None and (not seen or version["spec"]["template"] != seen[-1]):
            seen.append(version["spec"]["template"])
    return seen


def first_rv(kube: LocalApiServer, name: str, predicate: Any) -> int:
    return next(int(v["metadata"]["resourceVersion"]) for v in kube.history(WORKLOADS[name], NS, name)
                if v is not None and predicate(v))


def done_with_our_config(obj: dict[str, Any]) -> bool:
    return configured(obj["spec"]["template"]) and is_rollout_complete(obj)


async def test_a_policy_rolls_out_stage_by_stage_verified_and_then_rests(kube: LocalApiServer) -> None:
    originals = await create_fleet(kube)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS) as operator:
        await kube.create(policy())
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
        await kube.wait_for(lambda: "RolloutComplete" in reasons(kube), what="the RolloutComplete event")

        # Stage order, proven by resourceVersions: a stage is patched only after the previous
        # stage's controller reported its rollout complete.
        master_done = first_rv(kube, "mooncake-master", done_with_our_config)
        prefill_patched = first_rv(kube, "llama-prefill", lambda v: configured(v["spec"]["template"]))
        prefill_done = first_rv(kube, "llama-prefill", done_with_our_config)
        decode_patched = first_rv(kube, "llama-decode", lambda v: configured(v["spec"]["template"]))
        assert master_done < prefill_patched < prefill_done < decode_patched

        # The master got its flags, in Mooncake's names, and nothing else changed in it.
        master = workload(kube, "mooncake-master")
        assert master["spec"]["template"]["spec"]["containers"][0]["args"] == [
            "--rpc_port=50051", "--eviction_ratio=0.1", "--default_kv_lease_ttl=5000"]
        # The targets are adopted: the settings file's path merged into the user's JSON, the
        # volume and mount added, the sidecar and the env untouched; the settings themselves are
        # in each workload's ConfigMap, which the running connectors read.
        expected_extra = {**USER_KV_CONFIG["kv_connector_extra_config"], "mooncake_settings_file": SETTINGS_FILE_PATH}
        prefill = workload(kube, "llama-prefill")
        config = kv_config(vllm_container(prefill))
        assert config == {"kv_connector_extra_config": expected_extra, "kv_connector": "MooncakeStoreConnector",
                          "kv_connector_module_path": "moonlease_connector", "kv_role": "kv_both"}
        assert prefill["spec"]["template"]["spec"]["containers"][1] == \
            originals["llama-prefill"]["spec"]["template"]["spec"]["containers"][1]
        decode = vllm_container(workload(kube, "llama-decode"))
        assert decode["env"] == [{"name": "HF_HOME", "value": "/cache"}]
        assert decode["volumeMounts"] == [{"name": SETTINGS_VOLUME, "mountPath": "/etc/moonlease/connector",
                                           "readOnly": True}]
        for name in ("llama-prefill", "llama-decode"):
            text = kube.get(CONFIGMAPS, NS, settings_config_map_name(name))["data"][SETTINGS_FILE_NAME]
            assert parse_settings_file(text, MoonleaseConnectorConfig()).lease_mode.value == "selective"
        # What the operator verified: every pod's running connector reports selective lease.
        for pod in kube.list(PODS, NS):
            if SETTINGS_PORT_ANNOTATION in pod["metadata"].get("annotations", {}):
                report = read_settings_endpoint(int(pod["metadata"]["annotations"][SETTINGS_PORT_ANNOTATION]))
                assert report.lease_mode == "selective", pod["metadata"]["name"]
        # Each workload restarted once, and its pods run what was rolled out.
        assert all(len(template_versions(kube, name)) == 2 for name in WORKLOADS)
        for name in WORKLOADS:
            obj = workload(kube, name)
            digest = obj["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
            pods = kube.list(PODS, NS, label_selector=f"app.kubernetes.io/name={name}")
            assert len(pods) == obj["spec"]["replicas"]
            assert {p["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] for p in pods} == {digest}

        # Status: phase, conditions with reasons, stages, every workload, hashes, columns.
        result = status(kube)
        assert result["observedGeneration"] == 1 and result["appliedConfigHash"] == result["desiredConfigHash"]
        assert result["currentStage"] == "decode" and result["revision"] == result["appliedRevision"] == 1
        assert {c["type"]: (c["status"], c["reason"]) for c in result["conditions"]} == {
            "Ready": ("True", "RolloutComplete"), "Progressing": ("False", "RolloutComplete"),
            "Degraded": ("False", "AsExpected"), "Invalid": ("False", "SpecValid"),
            "LoadFailuresFailRequests": ("True", "LoadFailurePolicyFail")}
        assert stage_phases(kube) == {"master": "Succeeded", "prefill": "Succeeded", "decode": "Succeeded"}
        # Every workload Ready: counted per stage, none listed (only those that need attention are).
        assert [(c["role"], c["phase"], c["count"]) for c in result["targetCounts"]] == [
            ("master", "Ready", 1), ("prefill", "Ready", 1), ("decode", "Ready", 1)]
        assert result.get("targets", []) == [] and result["targetsTotal"] == 3 and result["targetsOmitted"] == 0
        assert reasons(kube) == [
            "RolloutStarted", "MasterRestart", "StageProgressing", "LoadFailurePolicyFail", "StageSucceeded",
            "StageProgressing",
            "StageSucceeded", "StageProgressing", "StageSucceeded", "RolloutComplete"]

        # At rest: the safety-net resyncs read the watch caches: not one request, let alone a write.
        registry = operator.metrics.registry
        assert registry is not None
        before = registry.get_sample_value("moonlease_operator_reconciles_total", {"result": "success"}) or 0
        mark = len(kube.api_calls())
        await let_reconcile(5)
        assert [(c.verb, c.rbac_resource) for c in kube.api_calls()[mark:] if c.user_agent.startswith("moonlease")] == []
        assert (registry.get_sample_value("moonlease_operator_reconciles_total", {"result": "success"}) or 0) > before
        assert registry.get_sample_value("moonlease_operator_targets",
                                         {"namespace": NS, "policy": "fleet", "state": "Ready"}) == 3
        assert registry.get_sample_value("moonlease_operator_current_stage",
                                         {"namespace": NS, "policy": "fleet", "stage": "decode"}) == 1
        assert registry.get_sample_value("moonlease_operator_reconcile_duration_seconds_count") >= 5


async def test_decode_first_and_a_connector_change_leaves_the_master_alone(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    await create_fleet(kube)
    await kube.create(policy(**{"rollout.stages": ["master", "decode", "prefill"]}))
    await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
    assert first_rv(kube, "llama-decode", done_with_our_config) < \
        first_rv(kube, "llama-prefill", lambda v: configured(v["spec"]["template"]))
    generations = {name: workload(kube, name)["metadata"]["generation"] for name in WORKLOADS}
    pods_before = {p["metadata"]["name"] for p in kube.list(PODS, NS)}

    # leaseAll + junction retention, then lastHitOnly: live, through the settings files only.
    for connector, mode, junctions, revision in (({"leaseMode": "leaseAll", "junctionRetention": True},
                                                   "leaseAll", "true", 2),
                                                  ({"leaseMode": "lastHitOnly", "junctionRetention": False},
                                                   "lastHitOnly", "false", 3)):
        hybrid = [{**t, "hybrid": mode == "lastHitOnly"} for t in SPEC["targets"]]  # lastHitOnly needs it
        await kube.patch("mlp", NS, "fleet", {"spec": {"connector": connector, "targets": hybrid}})
        await kube.wait_for(lambda: status(kube).get("appliedRevision") == revision and phase(kube) == "Ready",
                            timeout=WAIT, what=f"rollout {revision} ({status(kube)})")
        assert stage_phases(kube) == {"master": "Skipped", "decode": "Succeeded", "prefill": "Succeeded"}
        for pod in kube.list(PODS, NS):
            port = pod["metadata"].get("annotations", {}).get(SETTINGS_PORT_ANNOTATION)
            if port is not None:
                report = read_settings_endpoint(int(port))
                assert (report.lease_mode, report.junction_retention) == (mode, junctions)
    # No workload restarted: same generations, same pods (the master and every vLLM pod).
    assert {name: workload(kube, name)["metadata"]["generation"] for name in WORKLOADS} == generations
    assert {p["metadata"]["name"] for p in kube.list(PODS, NS)} == pods_before
    assert reasons(kube).count("MasterRestart") == 1  # only for the first rollout


async def test_a_stalled_stage_rolls_back_every_changed_stage(kube: LocalApiServer) -> None:
    originals = await create_fleet(kube)
    kube.simulator.stall("StatefulSet", NS, "llama-decode", when=configured)
    clock = ManualClock()
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS, clock=clock):
        await kube.create(policy())
        # The status announces the stage before the operator patches it: wait for both.
        await wait_for_stage_start(kube, "decode", "llama-decode")
        assert not is_rollout_complete(workload(kube, "llama-decode"))
        clock.advance(31)  # past stageTimeoutSeconds
        await kube.wait_for(lambda: phase(kube) == "Degraded", timeout=WAIT, what="phase Degraded")
        # The status is written first, the events right after it.
        await kube.wait_for(lambda: "RolledBack" in reasons(kube), what="the RolledBack event")

        # A decode failure rolls the targets back and leaves the master alone (a second restart
        # would empty the store again), offering its rollback for approval.
        assert stage_phases(kube) == {"master": "Succeeded", "prefill": "RolledBack", "decode": "RolledBack"}
        pending = status(kube)["pendingApproval"]
        assert pending.startswith("rollback:1:") and pending in condition(kube, "Degraded")["message"]
        assert "--eviction_ratio: 0.1 -> 0.05" in condition(kube, "Degraded")["message"]
        assert workload(kube, "mooncake-master")["metadata"]["generation"] == 2
        assert "MasterRestart" not in reasons(kube)[reasons(kube).index("StageFailed"):]
        assert "AwaitingApproval" in reasons(kube)[reasons(kube).index("StageFailed"):]

        await kube.patch("mlp", NS, "fleet", {"metadata": {"annotations": {APPROVE_MASTER_RESTART_ANNOTATION: pending}}})
        await kube.wait_for(lambda: stage_phases(kube).get("master") == "RolledBack", timeout=WAIT,
                            what="the approved master rollback")
        await kube.wait_for(lambda: reasons(kube)[-1] == "RolledBack", what="the RolledBack event again")

    result = status(kube)
    assert stage_phases(kube) == {"master": "RolledBack", "prefill": "RolledBack", "decode": "RolledBack"}
    assert result["failedStage"] == "decode" and result.get("appliedConfigHash") is None
    degraded = condition(kube, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "RolledBack")
    assert "not ready within 30s" in degraded["message"] and "StatefulSet/llama-decode" in degraded["message"]
    assert [t["phase"] for t in result["targets"]] == ["RolledBack"] * 3  # each needs attention: all listed
    assert [(c["role"], c["phase"], c["count"]) for c in result["targetCounts"]] == [
        ("master", "RolledBack", 1), ("prefill", "RolledBack", 1), ("decode", "RolledBack", 1)]
    # Every workload is back to its own configuration, through its own rolling update.
    for name, original in originals.items():
        now = workload(kube, name)
        assert now["spec"] == original["spec"], name
        assert is_rollout_complete(now) and now["metadata"]["generation"] == 3
    # Rolled back last stage first, each announced; the master only once approved, announced.
    tail = reasons(kube)[reasons(kube).index("StageFailed"):]
    assert tail == ["StageFailed", "StageRollingBack", "StageRolledBack", "StageRollingBack", "StageRolledBack",
                    "AwaitingApproval", "RolledBack", "VerbApplied", "MasterRestart", "StageRollingBack",
                    "StageRolledBack", "RolledBack"]
    decode_back = first_rv(kube, "llama-decode", lambda v: v["metadata"]["generation"] == 3)
    prefill_back = first_rv(kube, "llama-prefill", lambda v: v["metadata"]["generation"] == 3)
    master_back = first_rv(kube, "mooncake-master", lambda v: v["metadata"]["generation"] == 3)
    assert decode_back < prefill_back < master_back


async def test_failing_pods_roll_back_at_once_or_halt(kube: LocalApiServer, running_operator: OperatorThread) -> None:
    await create_fleet(kube)
    kube.simulator.fail("Deployment", NS, "llama-prefill", when=configured)
    await kube.create(policy(name="halting", **{"rollout.onFailure": "halt"}))
    await kube.wait_for(lambda: phase(kube, "halting") == "Degraded", timeout=WAIT, what="halted")
    assert condition(kube, "Degraded", "halting")["reason"] == "Halted"
    assert stage_phases(kube, "halting") == {"master": "Succeeded", "prefill": "Failed", "decode": "Pending"}
    assert configured(workload(kube, "llama-prefill")["spec"]["template"])  # left where it failed
    assert "CrashLoopBackOff" in status(kube, "halting")["stages"][1]["message"] or \
        "rollout failed" in status(kube, "halting")["stages"][1]["message"]

    # Switching the same policy to rollback undoes what it changed.
    await kube.patch("mlp", NS, "halting", {"spec": {"rollout": {"onFailure": "rollback"}}})
    await kube.wait_for(lambda: condition(kube, "Degraded", "halting").get("reason") == "RolledBack",
                        timeout=WAIT, what="rolled back")
    assert not configured(workload(kube, "llama-prefill")["spec"]["template"])
    assert configured(workload(kube, "mooncake-master")["spec"]["template"])  # its own stage succeeded: kept
    assert status(kube, "halting")["pendingApproval"].startswith("rollback:")
    assert not configured(workload(kube, "llama-decode")["spec"]["template"])


async def test_a_restarted_operator_resumes_mid_rollout(kube: LocalApiServer) -> None:
    await create_fleet(kube)
    kube.simulator.stall("Deployment", NS, "llama-prefill", when=configured)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        await kube.create(policy())
        await wait_for_stage_start(kube, "prefill", "llama-prefill")
    # The operator is gone mid-stage; the stall clears while nobody watches.
    before = status(kube)
    kube.simulator.heal("Deployment", NS, "llama-prefill")
    await kube.wait_for(lambda: is_rollout_complete(workload(kube, "llama-prefill")), what="prefill to finish")
    assert status(kube) == before

    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
        await kube.wait_for(lambda: "RolloutComplete" in reasons(kube), what="the RolloutComplete event")
    assert all(len(template_versions(kube, name)) == 2 for name in WORKLOADS)  # nobody patched twice
    assert status(kube)["revision"] == 1
    assert reasons(kube) == [
        "RolloutStarted", "MasterRestart", "StageProgressing", "LoadFailurePolicyFail", "StageSucceeded",
            "StageProgressing",
        "StageSucceeded", "StageProgressing", "StageSucceeded", "RolloutComplete"]


async def test_conflicts_and_server_errors_are_retried_without_damage(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    await create_fleet(kube)
    faults = [
        kube.inject_failures(DEPLOYMENTS, NS, "llama-prefill", status=409, count=3),
        kube.inject_failures(STATEFULSETS, NS, "llama-decode", status=500, count=2),
        kube.inject_failures(DEPLOYMENTS, NS, "mooncake-master", status=409, count=1),
        kube.inject_failures("mlp", NS, "fleet", status=503, count=2, subresource="status"),
        kube.inject_failures(DEPLOYMENTS, status=500, count=2, verbs=("list",)),
    ]
    await kube.create(policy())
    await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
    assert [f.fired for f in faults] == [3, 2, 1, 2, 2]
    for name in ("llama-prefill", "llama-decode"):
        container = vllm_container(workload(kube, name))
        assert container["args"].count("--kv-transfer-config") == 1
        assert [m["name"] for m in container["volumeMounts"]] == [SETTINGS_VOLUME]
        assert kv_config(container)["kv_connector_extra_config"]["mooncake_settings_file"] == SETTINGS_FILE_PATH
    assert all(len(template_versions(kube, name)) == 2 for name in WORKLOADS)
    registry = running_operator.metrics.registry
    assert registry is not None
    assert registry.get_sample_value("moonlease_operator_api_retries_total", {"reason": "conflict"}) >= 4
    assert registry.get_sample_value("moonlease_operator_api_retries_total", {"reason": "status_500"}) >= 4


async def test_a_refused_patch_shows_in_status_at_once_and_fails_its_stage(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    """Issue 15: a PATCH the API server refuses used to show only as "not ready within 60s"."""
    originals = await create_fleet(kube)
    refusal = kube.inject_failures(STATEFULSETS, NS, "llama-decode", status=422, count=1000, subresource=None)
    await kube.create(policy(**{"rollout.stageTimeoutSeconds": 3600}))  # no timeout can explain it
    await kube.wait_for(lambda: any("422" in (t.get("writeError") or "") for t in status(kube).get("targets", [])),
                        timeout=WAIT, what="the refusal on the workload")
    decode = next(t for t in status(kube)["targets"] if t["name"] == "llama-decode")
    assert "PATCH StatefulSet/llama-decode refused: 422 Invalid: injected failure 422" in decode["writeError"]
    written = condition(kube, "WriteFailed")
    assert (written["status"], written["reason"]) == ("True", "WriteRefused") and "llama-decode" in written["message"]
    await kube.wait_for(lambda: "WriteRefused" in reasons(kube), what="the WriteRefused event")
    event = next(e for e in kube.events(NS, involved_name="fleet") if e["reason"] == "WriteRefused")
    assert event["type"] == "Warning" and "422" in event["message"]

    # The stage fails on the refusal itself, and the changed targets roll back (the master stays).
    await kube.wait_for(lambda: phase(kube) == "Degraded", timeout=WAIT, what="phase Degraded")
    result = status(kube)
    assert result["failedStage"] == "decode" and "refused: 422" in result["stages"][2]["message"]
    assert "not ready within" not in result["stages"][2]["message"]
    assert workload(kube, "llama-decode")["spec"] == originals["llama-decode"]["spec"]
    await kube.wait_for(lambda: workload(kube, "llama-prefill")["spec"] == originals["llama-prefill"]["spec"],
                        timeout=WAIT, what="prefill rolled back")
    assert refusal.fired >= 1


@pytest.mark.parametrize("when", ["after Ready", "mid-rollout"])
async def test_deleting_the_policy_restores_the_workloads_exactly(
        kube: LocalApiServer, running_operator: OperatorThread, when: str) -> None:
    originals = await create_fleet(kube)
    if when == "mid-rollout":
        kube.simulator.stall("StatefulSet", NS, "llama-decode", when=configured)
    await kube.create(policy())
    target = "Ready" if when == "after Ready" else "Progressing"
    await kube.wait_for(lambda: (configured(workload(kube, "llama-decode")["spec"]["template"]))
                        if when == "mid-rollout" else phase(kube) == target, timeout=WAIT, what=f"the policy {target}")
    assert POLICY_LABEL in workload(kube, "llama-decode")["metadata"]["labels"]

    configured_master = workload(kube, "mooncake-master")["spec"]
    await kube.delete("mlp", NS, "fleet")
    await kube.wait_for(lambda: kube.get("mlp", NS, "fleet") is None, timeout=WAIT, what="the policy gone")
    for name, original in originals.items():
        left = as_left_by_users(workload(kube, name))
        if name == "mooncake-master":  # master.onDelete: keep (the default): settings stay, no restart
            assert left == {**as_left_by_users(original), "spec": configured_master}
        else:
            assert left == as_left_by_users(original), name
    await kube.wait_for(lambda: all(is_rollout_complete(workload(kube, n)) for n in WORKLOADS), timeout=WAIT,
                        what="the restored fleet to settle")
    restored = [e for e in kube.events(NS, involved_name="fleet") if e["reason"] == "Restored"]
    assert len(restored) == 1 and "Deployment/mooncake-master" not in restored[0]["message"]
    assert reasons(kube).count("MasterRestart") == 1  # the rollout's; none for the deletion


async def test_deleting_with_restore_restarts_the_master_only_once_approved(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    originals = await create_fleet(kube)
    await kube.create(policy(**{"master.onDelete": "restore"}))
    await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
    # Approvals on (the default; the fleet's SPEC turns them off for the rollout tests).
    await kube.patch("mlp", NS, "fleet", {"spec": {"master": {"requireApprovalForRestart": True}}})
    await kube.wait_for(lambda: status(kube).get("observedGeneration") == 2, timeout=WAIT, what="the edit seen")
    assert phase(kube) == "Ready"
    await kube.delete("mlp", NS, "fleet")
    await kube.wait_for(lambda: (status(kube).get("pendingApproval") or "").startswith("restore:1:"), timeout=WAIT,
                        what="the restore waiting for approval")
    pending = status(kube)["pendingApproval"]
    for name in ("llama-prefill", "llama-decode"):  # the targets are given back meanwhile
        await kube.wait_for(lambda n=name: as_left_by_users(workload(kube, n)) == as_left_by_users(originals[n]),
                            timeout=WAIT, what=f"{name} restored")
    assert configured(workload(kube, "mooncake-master")["spec"]["template"])
    assert kube.get("mlp", NS, "fleet") is not None and status(kube)["phase"] == "AwaitingApproval"
    ready = condition(kube, "Ready")  # the targets were given back: no false Ready meanwhile
    assert (ready["status"], ready["reason"]) == ("False", "AwaitingApproval") and pending in ready["message"]
    asked = [e for e in kube.events(NS, involved_name="fleet") if e["reason"] == "AwaitingApproval"]
    assert len(asked) == 1 and pending in asked[0]["message"] and "--eviction_ratio: 0.1 -> 0.05" in asked[0]["message"]

    await kube.patch("mlp", NS, "fleet", {"metadata": {"annotations": {APPROVE_MASTER_RESTART_ANNOTATION: pending}}})
    await kube.wait_for(lambda: kube.get("mlp", NS, "fleet") is None, timeout=WAIT, what="the policy gone")
    assert as_left_by_users(workload(kube, "mooncake-master")) == as_left_by_users(originals["mooncake-master"])
    assert reasons(kube).count("MasterRestart") == 2  # the rollout's and the restore's


async def test_a_master_restart_waits_for_approval(kube: LocalApiServer, running_operator: OperatorThread) -> None:
    await create_fleet(kube)
    await kube.create(policy(**{"master.requireApprovalForRestart": True}))
    await kube.wait_for(lambda: phase(kube) == "AwaitingApproval", timeout=WAIT, what="AwaitingApproval")
    await let_reconcile(3)
    pending = status(kube)["pendingApproval"]
    assert not configured(workload(kube, "mooncake-master")["spec"]["template"])
    stage = status(kube)["stages"][0]
    assert stage["phase"] == "AwaitingApproval" and "empties the Mooncake store" in stage["message"]
    assert f"{APPROVE_MASTER_RESTART_ANNOTATION}={pending}" in stage["message"]
    assert reasons(kube).count("StageAwaitingApproval") == 1

    await kube.patch("mlp", NS, "fleet", {"metadata": {"annotations": {APPROVE_MASTER_RESTART_ANNOTATION: pending}}})
    await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
    assert status(kube).get("pendingApproval") is None
    assert reasons(kube).index("StageAwaitingApproval") < reasons(kube).index("MasterRestart")


async def test_a_master_drift_repair_waits_for_its_own_approval(kube: LocalApiServer,
                                                               running_operator: OperatorThread) -> None:
    """Someone edits the master's flags after the rollout: putting them back would restart the
    master (and empty the store), so the repair waits for an approval of its own."""
    await create_fleet(kube)
    await kube.create(policy(**{"master.requireApprovalForRestart": True}))
    await kube.wait_for(lambda: phase(kube) == "AwaitingApproval", timeout=WAIT, what="AwaitingApproval")
    first = status(kube)["pendingApproval"]
    await kube.patch("mlp", NS, "fleet", {"metadata": {"annotations": {APPROVE_MASTER_RESTART_ANNOTATION: first}}})
    await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")

    master = copy.deepcopy(workload(kube, "mooncake-master"))
    containers = master["spec"]["template"]["spec"]["containers"]
    args = containers[0]["args"]
    edited = [a for a in args if not a.startswith("--eviction_ratio=")] + ["--eviction_ratio=0.3"]
    containers[0]["args"] = edited
    await kube.patch(WORKLOADS["mooncake-master"], NS, "mooncake-master",
                     {"spec": {"template": {"spec": {"containers": containers}}}})
    mark = len(kube.api_calls())
    await kube.wait_for(lambda: phase(kube) == "AwaitingApproval", timeout=WAIT, what="the drift repair's approval")
    pending = status(kube)["pendingApproval"]
    assert pending != first and pending.startswith("forward:2:")
    assert "--eviction_ratio: 0.3 -> 0.1" in status(kube)["stages"][0]["message"]
    await let_reconcile(3)
    # Nothing restarts the master meanwhile: the user's edit stays until the approval.
    assert workload(kube, "mooncake-master")["spec"]["template"]["spec"]["containers"][0]["args"] == edited
    assert ("patch", "deployments") not in operator_writes(kube, mark)

    await kube.patch("mlp", NS, "fleet", {"metadata": {"annotations": {APPROVE_MASTER_RESTART_ANNOTATION: pending}}})
    await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready after the repair")
    repaired = workload(kube, "mooncake-master")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--eviction_ratio=0.1" in repaired and "--eviction_ratio=0.3" not in repaired


async def test_paused_between_stages_and_by_the_spec(kube: LocalApiServer) -> None:
    await create_fleet(kube)
    clock = ManualClock()
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS, clock=clock):
        await kube.create(policy(**{"rollout.pauseBetweenStagesSeconds": 600}))
        await kube.wait_for(lambda: stage_phases(kube).get("master") == "Succeeded", timeout=WAIT,
                            what="the master stage done")
        await let_reconcile(3)
        assert stage_phases(kube)["prefill"] == "Pending" and condition(kube, "Progressing")["reason"] == \
            "PauseBetweenStages"
        await kube.patch("mlp", NS, "fleet", {"spec": {"rollout": {"paused": True}}})
        # Let a reconcile that read the old spec finish before the pause runs out.
        await let_reconcile(2)
        clock.advance(601)
        await kube.wait_for(lambda: phase(kube) == "Paused", timeout=WAIT, what="phase Paused")
        assert not configured(workload(kube, "llama-prefill")["spec"]["template"])
        await kube.patch("mlp", NS, "fleet", {"spec": {"rollout": {"paused": False, "pauseBetweenStagesSeconds": 0}}})
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")


async def test_master_settings_in_a_config_map(kube: LocalApiServer, running_operator: OperatorThread) -> None:
    await create_fleet(kube)
    await kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "master-config", "namespace": NS},
                       "data": {"master.yaml": "rpc_port: 50051\n"}})
    await kube.patch(DEPLOYMENTS, NS, "mooncake-master", {"spec": {"template": {"spec": {"containers": [
        {"name": "master", "image": "registry.local/mooncake/mooncake-master:v0.3.14",
         "args": ["--config_path=/etc/mooncake/master.yaml"]}]}}}})
    await kube.wait_for(lambda: is_rollout_complete(workload(kube, "mooncake-master")), what="the master settled")
    original = workload(kube, "mooncake-master")
    config_map = kube.get("configmaps", NS, "master-config")
    await kube.create(policy(**{"master.configMap": {"name": "master-config", "key": "master.yaml"},
                                "master.onDelete": "restore"}))  # approvals off (fleet SPEC): restored at once
    await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
    data = kube.get("configmaps", NS, "master-config")["data"]["master.yaml"]
    assert data == "rpc_port: 50051\ndefault_kv_lease_ttl: 5000\neviction_ratio: 0.1\n"
    master = workload(kube, "mooncake-master")
    assert master["spec"]["template"]["spec"] == original["spec"]["template"]["spec"]  # args untouched
    assert master["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]  # restarted by hash

    await kube.delete("mlp", NS, "fleet")
    await kube.wait_for(lambda: kube.get("mlp", NS, "fleet") is None, timeout=WAIT, what="the policy gone")
    assert as_left_by_users(kube.get("configmaps", NS, "master-config")) == as_left_by_users(config_map) | {
        "spec": None}
    assert kube.get("configmaps", NS, "master-config")["data"] == config_map["data"]
    assert as_left_by_users(workload(kube, "mooncake-master")) == as_left_by_users(original)
    assert ORIGINAL_ANNOTATION not in (workload(kube, "mooncake-master")["metadata"].get("annotations") or {})


async def test_the_operator_process_serves_its_metrics(kube: LocalApiServer, tmp_path: Any) -> None:
    """`moonlease operator --metrics-port`: the runner serves the operator's metrics."""
    await create_fleet(kube)
    port, health = free_port(), free_port()
    env = {**os.environ, "KUBECONFIG": str(kube.write_kubeconfig(tmp_path / "kubeconfig"))}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "moonlease", "operator", "--standalone", "--metrics-port", str(port),
            f"--liveness=http://127.0.0.1:{health}/healthz", "--reconcile-interval", "0.2", env=env, stdout=out, stderr=asyncio.subprocess.STDOUT)
    try:
        await kube.create(policy())
        await kube.wait_for(lambda: proc.returncode is not None or phase(kube) == "Ready", timeout=30,
                            what="phase Ready from the operator process")

        async def scrape() -> str:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/metrics") as rsp:
                    return await rsp.text()

        # The metrics follow the status at the end of the same reconcile.
        samples = await kube.wait_for(lambda: _ready_samples(scrape()), what="the Ready gauge")
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 15)
    assert phase(kube) == "Ready", log.read_text()[-3000:]
    assert samples[("moonlease_operator_reconciles_total", (("result", "success"),))] >= 3
    policy_labels = (("namespace", "default"), ("policy", "fleet"))
    assert samples[("moonlease_operator_targets", (*policy_labels, ("state", "Ready")))] == 3
    assert samples[("moonlease_operator_targets", (*policy_labels, ("state", "Pending")))] == 0
    assert samples[("moonlease_operator_current_stage", (*policy_labels, ("stage", "decode")))] == 1
    assert samples[("moonlease_operator_current_stage", (*policy_labels, ("stage", "master")))] == 0
    assert samples[("moonlease_operator_reconcile_duration_seconds_count", ())] >= 3


async def _ready_samples(text: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
    """Parsed samples of the operator's metrics once its phase gauge says Ready."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(await text) for s in family.samples}
    ready = ("moonlease_operator_policy_phase", (("namespace", "default"), ("phase", "Ready"), ("policy", "fleet")))
    return samples if samples.get(ready) == 1 else None


async def test_an_expired_token_is_refreshed_by_logging_in_again(kube: LocalApiServer) -> None:
    """A 401 (say, a rotated service-account token) makes the operator log in again and carry on."""
    await create_fleet(kube)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS) as operator:
        await kube.create(policy())
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
        # The next status write is refused with a 401: a spec edit makes the operator write one.
        fault = kube.inject_failures("mlp", NS, None, status=401, count=1, verbs=("patch",), subresource="status")
        await kube.patch("mlp", NS, "fleet", {"spec": {"rollout": {"stageTimeoutSeconds": 31}}})
        await kube.wait_for(lambda: fault.fired == 1, timeout=WAIT, what="the 401")
        await kube.wait_for(lambda: status(kube).get("observedGeneration") == 2, timeout=WAIT,
                            what="the edit reconciled after logging in again")
        registry = operator.metrics.registry
        assert registry is not None
        assert registry.get_sample_value("moonlease_operator_reconcile_errors_total", {"kind": "api_401"}) == 1
    assert phase(kube) == "Ready"


async def test_the_context_builds_a_new_client_from_the_new_login() -> None:
    logins = iter([kopf.ConnectionInfo(server="http://127.0.0.1:1"), kopf.ConnectionInfo(server="http://127.0.0.1:2")])
    context = OperatorContext()
    context.use_connection(next(logins), relogin=lambda: next(logins))
    first = context.client()
    assert context.client() is first and first.server.endswith(":1")
    await context.refresh_credentials()
    second = context.client()
    assert second is not first and second.server.endswith(":2")
    await context.close()


def reconciles_by(operator: OperatorThread) -> float:
    registry = operator.metrics.registry
    assert registry is not None
    return sum(registry.get_sample_value("moonlease_operator_reconciles_total", {"result": r}) or 0.0
               for r in ("success", "invalid", "error"))


async def test_two_replicas_one_acts_and_the_other_takes_over(kube: LocalApiServer) -> None:
    """Issue 15: two replicas against one API server, peering through kopf (each with its own
    priority, as `moonlease operator --peering` chooses at random): one acts, none of its
    writes is lost or made twice; when it stops, the other carries on."""
    for crd in build_peering_crds():
        await kube.create(crd)
    await kube.create(build_peering_object("moonlease"))
    originals = await create_fleet(kube)
    low = OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS, peering="moonlease", priority=100)
    high = OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS, peering="moonlease", priority=200)
    async with low:
        async with high:
            await kube.wait_for(lambda: len((kube.get("clusterkopfpeerings", None, "moonlease") or {})
                                            .get("status") or {}) == 2, timeout=WAIT, what="both replicas peering")
            await asyncio.sleep(0.5)  # the lower replica sees the higher one and pauses
            await kube.create(policy())
            await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
            await kube.wait_for(lambda: "RolloutComplete" in reasons(kube), what="the RolloutComplete event")
            assert reconciles_by(low) == 0 and reconciles_by(high) > 0
        # Every workload patched exactly once, every event posted once.
        assert all(len(template_versions(kube, name)) == 2 for name in WORKLOADS)
        assert reasons(kube) == [
            "RolloutStarted", "MasterRestart", "StageProgressing", "LoadFailurePolicyFail", "StageSucceeded",
            "StageProgressing",
            "StageSucceeded", "StageProgressing", "StageSucceeded", "RolloutComplete"]

        # The acting replica is gone: the other one resumes and rolls the next change out.
        await kube.patch("mlp", NS, "fleet", {"spec": {"connector": {"leaseMode": "leaseAll"}}})
        await kube.wait_for(lambda: status(kube).get("revision") == 2 and phase(kube) == "Ready", timeout=WAIT,
                            what="the other replica rolling out revision 2")
        assert reconciles_by(low) > 0
    # Revision 2 was live: only the settings files changed, no pod template (and no master).
    assert all(len(template_versions(kube, name)) == 2 for name in WORKLOADS)
    for name in ("llama-prefill", "llama-decode"):
        text = kube.get(CONFIGMAPS, NS, settings_config_map_name(name))["data"][SETTINGS_FILE_NAME]
        assert parse_settings_file(text, MoonleaseConnectorConfig()).lease_mode.value == "leaseAll"
    assert originals  # the fleet as created


async def test_deleted_targets_are_left_out_and_the_rest_carries_on(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    """Issue 15: one member's problem used to freeze the whole policy (Pending, no writes)."""
    await create_fleet(kube)
    await kube.create(policy())
    await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
    await kube.delete(DEPLOYMENTS, NS, "llama-prefill")  # named: reported on its target entry
    await kube.delete(STATEFULSETS, NS, "llama-decode")  # its selector now selects nothing
    await kube.create(copy.deepcopy(DECODE) | {"metadata": {**DECODE["metadata"], "name": "llama-decode-2"}})
    await kube.patch("mlp", NS, "fleet", {"spec": {"connector": {"leaseMode": "leaseAll"}}})
    try:
        await kube.wait_for(lambda: phase(kube) == "Degraded" and status(kube).get("revision") == 2, timeout=WAIT,
                            what="the rest rolled out, the deleted one reported")
    except TimeoutError:
        raise AssertionError(json.dumps(status(kube))[:3000]) from None
    new_decode = kube.get(STATEFULSETS, NS, "llama-decode-2")  # adopted, its settings file written
    assert kv_config(vllm_container(new_decode))["kv_connector_extra_config"]["mooncake_settings_file"] == \
        SETTINGS_FILE_PATH
    text = kube.get(CONFIGMAPS, NS, settings_config_map_name("llama-decode-2"))["data"][SETTINGS_FILE_NAME]
    assert parse_settings_file(text, MoonleaseConnectorConfig()).lease_mode.value == "leaseAll"
    degraded = condition(kube, "Degraded")
    assert degraded["reason"] == "MemberExcluded" and "Deployment/llama-prefill: not found" in degraded["message"]
    left = next(t for t in status(kube)["targets"] if t["name"] == "llama-prefill")
    assert left["phase"] == "Excluded" and left["message"] == "left out: not found"
    await kube.wait_for(lambda: "MemberExcluded" in reasons(kube), what="the MemberExcluded event")


async def test_a_refused_restore_holds_the_policy_and_the_others_are_given_back(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    originals = await create_fleet(kube)
    await kube.create(policy())
    await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
    refusal = kube.inject_failures(DEPLOYMENTS, NS, "llama-prefill", status=403, count=2, subresource=None)
    await kube.delete("mlp", NS, "fleet")
    await kube.wait_for(lambda: kube.get("mlp", NS, "fleet") is None, timeout=WAIT, what="the policy gone at last")
    assert refusal.fired == 2
    refused = [e for e in kube.events(NS, involved_name="fleet") if e["reason"] == "WriteRefused"]
    assert refused and all("PATCH Deployment/llama-prefill refused: 403 Forbidden" in e["message"] for e in refused)
    for name in ("llama-prefill", "llama-decode"):
        assert as_left_by_users(workload(kube, name)) == as_left_by_users(originals[name]), name
    # decode was given back on the first attempt, prefill only once the server let it through
    decode_back = first_rv(kube, "llama-decode", lambda v: POLICY_LABEL not in (v["metadata"].get("labels") or {})
                           and v["metadata"]["generation"] > 1)
    prefill_back = first_rv(kube, "llama-prefill", lambda v: POLICY_LABEL not in (v["metadata"].get("labels") or {})
                            and v["metadata"]["generation"] > 1)
    assert decode_back < prefill_back
