"""One answer to "which object is the master", and no master restart without approval on any
path that may restore it: a renamed `spec.master.name`, a deletion with a spec the operator
refuses (issue 27)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from moonlease_operator.api import APPROVE_MASTER_RESTART_ANNOTATION, Phase, PolicyStatus, read_spec
from moonlease_operator.core.changes import ChangeAction
from moonlease_operator.core.master_identity import declared_master, is_master_object
from moonlease_operator.core.rollout import PolicyRef, plan_release
from moonlease_operator.core.slots import POLICY_LABEL, build_update
from tests.unit.test_rollout_plan import SPEC, T0, Cluster, deployment, fleet, master_deployment, spec_with

pytestmark = pytest.mark.unit


def second_master() -> dict[str, Any]:
    obj = master_deployment()
    obj["metadata"]["name"] = "mooncake-master-2"
    return obj


def renamed(**changes: Any) -> dict[str, Any]:
    return spec_with(**{"master.name": "mooncake-master-2", **changes})


def rolled_out_with_two_masters() -> Cluster:
    cluster = Cluster(master_deployment(), second_master(), deployment("prefill"), deployment("decode"))
    assert cluster.run(SPEC).phase is Phase.READY
    cluster.events.clear()
    return cluster


def test_the_master_is_known_by_what_it_runs_whatever_the_spec_says() -> None:
    cluster = rolled_out_with_two_masters()
    master, prefill = cluster.obj("mooncake-master"), cluster.obj("prefill")
    assert is_master_object(master) and not is_master_object(prefill)
    # A wrapper the operator cannot read as mooncake_master: its snapshot's master flags say so.
    wrapped = copy.deepcopy(master)
    wrapped["spec"]["template"]["spec"]["containers"][0].update(command=["/entry"], image="reg/store:1")
    assert is_master_object(wrapped)
    assert ("Deployment", "other") in declared_master(read_spec(renamed(**{"master.name": "other"})), PolicyStatus())
    assert declared_master(read_spec({"master": {}}), PolicyStatus()) == frozenset()


def test_renaming_the_master_keeps_the_old_one_as_it_is_by_default() -> None:
    cluster = rolled_out_with_two_masters()
    old = copy.deepcopy(cluster.obj("mooncake-master"))
    cluster.writes.clear()
    status = cluster.run(renamed())
    assert status.phase is Phase.READY
    after = cluster.obj("mooncake-master")
    assert after["spec"] == old["spec"], "the old master restarted (the store emptied)"
    assert POLICY_LABEL not in after["metadata"]["labels"]
    assert not [m for _, r, m in cluster.events if r == "MasterRestart" and "Deployment/mooncake-master " in m]
    released = [m for _, r, m in cluster.events if r == "Released"]
    assert released and "nothing restarts" in released[-1]


def test_renaming_the_master_with_restore_waits_for_approval_then_warns() -> None:
    cluster = rolled_out_with_two_masters()
    spec = renamed(**{"master.onDelete": "restore", "master.requireApprovalForRestart": True})
    old = copy.deepcopy(cluster.obj("mooncake-master"))
    # The new master's forward restart is approved like any other.
    cluster.reconcile(spec)
    assert cluster.status.phase is Phase.AWAITING_APPROVAL
    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = cluster.status.pending_approval or ""
    cluster.events.clear()
    status = cluster.run(spec)
    assert status.phase is Phase.AWAITING_APPROVAL, status.conditions
    assert status.pending_approval is not None and status.pending_approval.startswith("restore:")
    assert cluster.obj("mooncake-master")["spec"] == old["spec"], "restored before approval"
    ready = status.condition("Ready")
    assert ready is not None and ready.status.value == "False"
    assert "Deployment/mooncake-master" in ready.message and "empties the Mooncake store" in ready.message
    assert "AwaitingApproval" in cluster.reasons()
    assert not [m for _, r, m in cluster.events if r == "MasterRestart" and "Deployment/mooncake-master " in m]

    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = status.pending_approval
    status = cluster.run(spec)
    assert status.phase is Phase.READY
    restarts = [m for _, r, m in cluster.events if r == "MasterRestart"]
    assert restarts and "Deployment/mooncake-master restarts to get its settings back" in restarts[-1]
    assert "--eviction_ratio=0.05" in cluster.obj("mooncake-master")["spec"]["template"]["spec"]["containers"][0]["args"]


def test_deleting_a_policy_with_an_invalid_spec_at_rest_never_restarts_the_master() -> None:
    cluster = fleet()
    cluster.run(spec_with(**{"master.onDelete": "restore"}))
    status = cluster.status
    assert status.phase is Phase.READY and not status.targets  # at rest: the status lists no target
    configured = copy.deepcopy(cluster.obj("mooncake-master")["spec"])
    invalid = read_spec({**SPEC, "master": {"name": "mooncake-master", "evictionRatio": 7}})
    plan = plan_release(policy=PolicyRef("fleet", "ns", 1, ""), spec=invalid, previous=status,
                        managed=list(cluster.workloads.values()), now=T0)
    actions = {c.name: c.action for c in plan.changes}
    assert actions == {"mooncake-master": ChangeAction.FORGET, "prefill": ChangeAction.RELEASE,
                       "decode": ChangeAction.RELEASE}
    assert "MasterRestart" not in [e.reason for e in plan.events]
    kept = build_update(cluster.obj("mooncake-master"), next(c for c in plan.changes if c.name == "mooncake-master"))
    assert kept is not None and kept["spec"] == configured


def test_deleting_a_policy_whose_old_master_was_renamed_away_asks_before_restoring_it() -> None:
    cluster = rolled_out_with_two_masters()
    spec = renamed(**{"master.onDelete": "restore", "master.requireApprovalForRestart": True})
    # The old master is still labelled (its restore waits): deleting the policy must not restore
    # it unasked just because the spec now names another master.
    plan = plan_release(policy=PolicyRef("fleet", "ns", 1, ""), spec=read_spec(spec), previous=cluster.status,
                        managed=list(cluster.workloads.values()), now=T0)
    assert "mooncake-master" not in [c.name for c in plan.changes]
    assert plan.pending_approval is not None and [e.reason for e in plan.events][0] == "AwaitingApproval"


def with_master_file(cluster: Cluster, *names: str) -> None:
    cluster.obj("mooncake-master")["spec"]["template"]["spec"]["containers"][0]["args"] = ["--config_path=/etc/m.json"]
    for name in names:
        cluster.config_maps[name] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
                                     "data": {"m.json": '{"rpc_port": 50051}'}}


def master_file_spec(config_map: str, **changes: Any) -> dict[str, Any]:
    return spec_with(master={"name": "mooncake-master", "version": "0.3.14", "evictionRatio": 0.2,
                             "configMap": {"name": config_map, "key": "m.json"}, "requireApprovalForRestart": False,
                             **changes})


@pytest.mark.parametrize("on_delete", ["keep", "restore"])
def test_a_master_file_no_longer_named_is_forgotten_or_given_back(on_delete: str) -> None:
    """`spec.master.configMap` renamed: the old file carried the policy's label and snapshots for
    ever (and a later deletion, which reads the file the spec names, never gave it back)."""
    cluster = fleet()
    with_master_file(cluster, "cfg", "cfg-2")
    assert cluster.run(master_file_spec("cfg", onDelete=on_delete)).phase is Phase.READY
    assert cluster.config_maps["cfg"]["metadata"]["labels"][POLICY_LABEL] == "fleet"
    written = cluster.config_maps["cfg"]["data"]["m.json"]
    cluster.events.clear()
    assert cluster.run(master_file_spec("cfg-2", onDelete=on_delete)).phase is Phase.READY
    old = cluster.config_maps["cfg"]
    assert POLICY_LABEL not in (old["metadata"].get("labels") or {})
    assert not set(old["metadata"].get("annotations") or {}) & {"moonlease.io/original", "moonlease.io/rollback"}
    expected = written if on_delete == "keep" else '{"rpc_port": 50051}'
    assert json.loads(old["data"]["m.json"]) == json.loads(expected)
    released = [m for _, r, m in cluster.events if r == "Released" and "ConfigMap/cfg " in m]
    assert released and ("keeps its content" if on_delete == "keep" else "restoring its content") in released[0]
    assert cluster.config_maps["cfg-2"]["metadata"]["labels"][POLICY_LABEL] == "fleet"


def test_the_file_of_a_renamed_away_master_waits_with_its_master_for_approval() -> None:
    cluster = Cluster(master_deployment(), second_master(), deployment("prefill"), deployment("decode"))
    with_master_file(cluster, "cfg", "cfg-2")
    cluster.obj("mooncake-master-2")["spec"]["template"]["spec"]["containers"][0]["args"] = ["--config_path=/x.json"]
    assert cluster.run(master_file_spec("cfg", onDelete="restore")).phase is Phase.READY
    written = cluster.config_maps["cfg"]["data"]["m.json"]
    spec = master_file_spec("cfg-2", onDelete="restore", requireApprovalForRestart=True, name="mooncake-master-2")
    cluster.reconcile(spec)
    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = cluster.status.pending_approval or ""
    status = cluster.run(spec)
    assert status.phase is Phase.AWAITING_APPROVAL and (status.pending_approval or "").startswith("restore:")
    assert cluster.config_maps["cfg"]["data"]["m.json"] == written, "the old master's file restored before approval"
    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = status.pending_approval or ""
    cluster.writes.clear()
    assert cluster.run(spec).phase is Phase.READY
    assert json.loads(cluster.config_maps["cfg"]["data"]["m.json"]) == {"rpc_port": 50051}
    assert cluster.writes.index(("ConfigMap", "cfg")) < cluster.writes.index(("Deployment", "mooncake-master"))
