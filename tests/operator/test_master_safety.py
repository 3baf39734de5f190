"""No master restart nobody approved and no rollback of finished work (issue 27), with kopf
against the local API server: a renamed `spec.master.name` leaves the old master as it is (or
restores it only once approved), deleting a policy whose spec the operator refuses never
restarts the master, an operator away longer than the stage timeout verifies what finished, and a
finished stage that drifts while a later one runs is caught on the watch event."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from moonlease_dev.testbed.kube import CONFIGMAPS, DEPLOYMENTS, LocalApiServer, is_rollout_complete
from moonlease_settings.settings_file import SETTINGS_FILE_NAME
from moonlease_operator.api import APPROVE_MASTER_RESTART_ANNOTATION
from moonlease_operator.core.connector_delivery import settings_config_map_name
from moonlease_operator.core.slots import POLICY_LABEL
from moonlease_operator.runner import OperatorThread
from tests.fixtures.kube import FAST_OPTIONS
from tests.operator.fleet import (
    MASTER,
    NS,
    ManualClock,
    condition,
    configured,
    create_fleet,
    describe_policy,
    let_reconcile,
    phase,
    policy,
    reasons,
    stage_phases,
    status,
    wait_for_stage_start,
    workload,
)

pytestmark = pytest.mark.operator

WAIT = 15.0
NEW_MASTER = "mooncake-master-2"


def events(kube: LocalApiServer, reason: str) -> list[dict[str, Any]]:
    return [e for e in kube.events(NS, involved_name="fleet") if e["reason"] == reason]


def old_master_restarts(kube: LocalApiServer) -> list[dict[str, Any]]:
    """Announced restarts of the old master other than its first rollout."""
    return [e for e in events(kube, "MasterRestart")
            if "Deployment/mooncake-master " in e["message"] and "apply its new settings" not in e["message"]]


async def ready_with_a_second_master(kube: LocalApiServer, **changes: Any) -> dict[str, Any]:
    """The fleet rolled out; a second master Deployment waiting to take over. Returns the old
    master as the rollout left it."""
    await create_fleet(kube)
    second = copy.deepcopy(MASTER)
    second["metadata"]["name"] = NEW_MASTER
    await kube.create(second)
    await kube.create(policy(**changes))
    await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
    return workload(kube, "mooncake-master")


def old_template(kube: LocalApiServer) -> dict[str, Any]:
    return workload(kube, "mooncake-master")["spec"]["template"]


async def test_renaming_the_master_leaves_the_old_one_running_its_settings(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    before = await ready_with_a_second_master(kube)
    restarts = len(events(kube, "MasterRestart"))
    await kube.patch("mlp", NS, "fleet", {"spec": {"master": {"name": NEW_MASTER}}})
    await kube.wait_for(lambda: status(kube).get("observedGeneration") == 2 and phase(kube) == "Ready",
                        timeout=WAIT, what="Ready on the new master")
    await kube.wait_for(lambda: POLICY_LABEL not in workload(kube, "mooncake-master")["metadata"]["labels"],
                        timeout=WAIT, what="the old master forgotten")
    await let_reconcile(2)
    assert old_template(kube) == before["spec"]["template"], "the old master restarted: the store emptied"
    assert not old_master_restarts(kube)
    assert len(events(kube, "MasterRestart")) == restarts + 1  # the new master's own, announced
    assert any("nothing restarts" in e["message"] for e in events(kube, "Released"))


async def test_renaming_the_master_with_restore_waits_for_approval(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    before = await ready_with_a_second_master(kube, **{"master.onDelete": "restore"})
    # Approvals on (the default; the fleet's SPEC turns them off for the rollout tests).
    await kube.patch("mlp", NS, "fleet", {"spec": {"master": {"name": NEW_MASTER, "requireApprovalForRestart": True}}})
    await kube.wait_for(lambda: (status(kube).get("pendingApproval") or "").startswith("forward:"),
                        timeout=WAIT, what="the new master's restart waiting for approval")
    forward = status(kube)["pendingApproval"]
    await kube.patch("mlp", NS, "fleet", {"metadata": {"annotations": {APPROVE_MASTER_RESTART_ANNOTATION: forward}}})
    await kube.wait_for(lambda: (status(kube).get("pendingApproval") or "").startswith("restore:"),
                        timeout=WAIT, what="the old master's restore waiting for approval")
    await let_reconcile(2)
    assert phase(kube) == "AwaitingApproval"
    ready = condition(kube, "Ready")
    assert ready["status"] == "False" and "Deployment/mooncake-master" in ready["message"]
    assert old_template(kube) == before["spec"]["template"] and not old_master_restarts(kube)
    assert events(kube, "AwaitingApproval")

    pending = status(kube)["pendingApproval"]
    await kube.patch("mlp", NS, "fleet", {"metadata": {"annotations": {APPROVE_MASTER_RESTART_ANNOTATION: pending}}})
    await kube.wait_for(lambda: phase(kube) == "Ready" and old_template(kube) != before["spec"]["template"],
                        timeout=WAIT, what="the approved restore")
    args = old_template(kube)["spec"]["containers"][0]["args"]
    assert "--eviction_ratio=0.05" in args and "--eviction_ratio=0.1" not in args
    assert POLICY_LABEL not in workload(kube, "mooncake-master")["metadata"]["labels"]
    assert old_master_restarts(kube)[0]["type"] == "Warning"


async def test_deleting_a_policy_the_operator_refuses_never_restarts_the_master(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    await create_fleet(kube)
    await kube.create(policy(**{"master.onDelete": "restore"}))
    await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
    assert not status(kube).get("targets")  # at rest the status lists no target
    configured_master = workload(kube, "mooncake-master")["spec"]
    # A spec the CEL rules refuse on a real cluster reaches the operator from a CRD installed
    # without its rules (or one older than them): the operator refuses it.
    kube.emulator.cel_rules = False
    await kube.patch("mlp", NS, "fleet", {"spec": {"connector": {"leaseMode": "lastHitOnly"}}})
    await kube.wait_for(lambda: phase(kube) == "Invalid", timeout=WAIT, what="phase Invalid")
    await kube.delete("mlp", NS, "fleet")
    await kube.wait_for(lambda: kube.get("mlp", NS, "fleet") is None, timeout=WAIT, what="the policy gone")
    master = kube.get(DEPLOYMENTS, NS, "mooncake-master") or {}
    assert master["spec"] == configured_master and POLICY_LABEL not in master["metadata"]["labels"]
    assert is_rollout_complete(master)
    assert len(events(kube, "MasterRestart")) == 1  # the rollout's; none for the deletion
    released = events(kube, "Released")
    assert released and "the spec is invalid" in released[-1]["message"]


async def test_an_operator_away_longer_than_the_stage_timeout_verifies_what_finished(
        kube: LocalApiServer) -> None:
    """Stopped mid-stage for longer than stageTimeoutSeconds (30 s): the stage that finished
    meanwhile is verified and succeeds; nothing is failed or rolled back."""
    await create_fleet(kube)
    kube.simulator.stall("Deployment", NS, "llama-prefill", when=configured)
    clock = ManualClock()
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS, clock=clock):
        await kube.create(policy())
        await wait_for_stage_start(kube, "prefill", "llama-prefill")
    kube.simulator.heal("Deployment", NS, "llama-prefill")
    await kube.wait_for(lambda: is_rollout_complete(workload(kube, "llama-prefill")), what="prefill to finish")
    clock.advance(120)  # the outage: four times the stage timeout
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS, clock=clock):
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready",
                            describe=lambda: describe_policy(kube))
    assert stage_phases(kube) == {"master": "Succeeded", "prefill": "Succeeded", "decode": "Succeeded"}
    assert not {"StageFailed", "StageRollingBack", "RolledBack"} & set(reasons(kube))
    assert configured(workload(kube, "llama-prefill")["spec"]["template"])


async def test_a_hand_edit_of_a_finished_stage_while_a_later_one_runs_is_caught_at_once(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    """Prefill done, decode still rolling: someone edits prefill's settings file. The watch event
    reopens the prefill stage (a StageDrifted warning naming it), the file is put back, and the
    policy is Ready only once both stages run the policy's settings (it used to end Ready over
    the edit, repaired only by a new attempt after the next resync)."""
    await create_fleet(kube)
    kube.simulator.stall("StatefulSet", NS, "llama-decode", when=configured)
    await kube.create(policy())
    await wait_for_stage_start(kube, "decode", "llama-decode")
    name = settings_config_map_name("llama-prefill")
    applied = kube.get(CONFIGMAPS, NS, name)["data"][SETTINGS_FILE_NAME]
    edited = json.dumps({**json.loads(applied), "mooncake_lease_mode": "leaseAll"})
    await kube.patch(CONFIGMAPS, NS, name, {"data": {SETTINGS_FILE_NAME: edited}})
    await kube.wait_for(lambda: bool(events(kube, "StageDrifted")), timeout=WAIT,
                        what="the drift noticed while decode still runs")
    assert "Stage prefill drifted after it succeeded: Deployment/llama-prefill" in \
        events(kube, "StageDrifted")[0]["message"]
    await kube.wait_for(lambda: json.loads(kube.get(CONFIGMAPS, NS, name)["data"][SETTINGS_FILE_NAME])
                        == json.loads(applied), timeout=WAIT, what="prefill's file put back")
    assert phase(kube) == "Progressing" and condition(kube, "Ready")["status"] == "False"
    kube.simulator.heal("StatefulSet", NS, "llama-decode")
    await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
    assert stage_phases(kube) == {"master": "Succeeded", "prefill": "Succeeded", "decode": "Succeeded"}


async def test_a_rollout_undo_of_a_finished_stage_while_a_later_one_runs_is_caught_at_once(
        kube: LocalApiServer, running_operator: OperatorThread) -> None:
    """Prefill done, decode still rolling: `kubectl rollout undo deployment/llama-prefill`. The
    local API server keeps no ReplicaSets yet, so the undo is emulated as kubectl does it: the
    previous pod template (the one before the operator's adoption) is patched back onto the
    Deployment. The watch event reopens the prefill stage (StageDrifted naming the settings volume),
    the adoption is put back, and the policy is Ready only once both stages run the policy's
    settings (it used to stay Ready over the undo until the next resync)."""
    await create_fleet(kube)
    kube.simulator.stall("StatefulSet", NS, "llama-decode", when=configured)
    await kube.create(policy())
    await wait_for_stage_start(kube, "decode", "llama-decode")
    assert stage_phases(kube)["prefill"] == "Succeeded"
    templates = [v["spec"]["template"] for v in kube.history(DEPLOYMENTS, NS, "llama-prefill") if v is not None]
    before = next(t for t in reversed(templates) if not configured(t))  # the revision before the operator's
    await kube.patch(DEPLOYMENTS, NS, "llama-prefill", [{"op": "replace", "path": "/spec/template", "value": before}],
                     patch_type="json")
    await kube.wait_for(lambda: bool(events(kube, "StageDrifted")), timeout=WAIT,
                        what="the undo noticed while decode still runs")
    drifted = events(kube, "StageDrifted")[0]["message"]
    assert "Stage prefill drifted after it succeeded: Deployment/llama-prefill" in drifted
    assert "moonlease-connector-settings" in drifted
    await kube.wait_for(lambda: configured(workload(kube, "llama-prefill")["spec"]["template"]), timeout=WAIT,
                        what="prefill adopted again")
    assert phase(kube) == "Progressing" and condition(kube, "Ready")["status"] == "False"
    kube.simulator.heal("StatefulSet", NS, "llama-decode")
    await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
    assert stage_phases(kube) == {"master": "Succeeded", "prefill": "Succeeded", "decode": "Succeeded"}
