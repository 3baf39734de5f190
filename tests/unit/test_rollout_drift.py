"""Continuous verification (issue 27): a finished stage is verified again on every reconcile, so
a `kubectl rollout undo` or a hand edit of its settings while a later stage runs reopens it
(named in the status, announced) instead of the policy ending Ready over old settings."""

from __future__ import annotations

import copy
import json

import pytest

from moonlease_settings.settings_file import SETTINGS_FILE_NAME
from moonlease_operator.api import APPROVE_MASTER_RESTART_ANNOTATION, Phase
from moonlease_operator.core.connector_delivery import settings_config_map_name
from tests.unit.test_rollout_plan import SPEC, fleet, rolled_to, spec_with, template

pytestmark = pytest.mark.unit


def test_a_hand_edit_of_a_finished_stages_settings_reopens_it() -> None:
    cluster = rolled_to("decode")
    name = settings_config_map_name("prefill")
    applied = copy.deepcopy(cluster.config_maps[name]["data"][SETTINGS_FILE_NAME])
    edited = {**json.loads(applied), "mooncake_lease_mode": "leaseAll"}
    cluster.config_maps[name]["data"][SETTINGS_FILE_NAME] = json.dumps(edited)
    cluster.settle("decode")
    cluster.reconcile(SPEC)
    status = cluster.status
    assert status.phase is Phase.PROGRESSING, "Ready while prefill runs settings nobody asked for"
    assert cluster.stage_phases()["prefill"] == "Progressing"
    ready = status.condition("Ready")
    assert ready is not None and ready.status.value == "False"
    assert "Stage prefill: re-applying to Deployment/prefill, which drifted" in ready.message
    drifted = [m for _, r, m in cluster.events if r == "StageDrifted"]
    assert drifted and drifted[0].startswith("Stage prefill drifted after it succeeded: Deployment/prefill")
    assert 'mooncake_lease_mode: "leaseAll" -> "selective"' in drifted[0]
    assert json.loads(cluster.config_maps[name]["data"][SETTINGS_FILE_NAME]) == json.loads(applied)
    assert cluster.run(SPEC).phase is Phase.READY
    assert status.revision == cluster.status.revision  # the same attempt, repaired in place


def test_a_rollout_undo_of_a_finished_stage_reopens_it() -> None:
    cluster = rolled_to("decode")
    adopted = copy.deepcopy(template(cluster, "prefill"))
    obj = cluster.obj("prefill")
    obj["spec"]["template"]["spec"]["containers"][0].pop("volumeMounts", None)  # `kubectl rollout undo`
    obj["metadata"]["generation"] += 1
    cluster.settle("prefill")
    cluster.settle("decode")
    cluster.reconcile(SPEC)
    assert cluster.status.phase is Phase.PROGRESSING and cluster.stage_phases()["prefill"] == "Progressing"
    assert "StageDrifted" in cluster.reasons()
    assert cluster.run(SPEC).phase is Phase.READY
    assert template(cluster, "prefill")["spec"] == adopted["spec"]


def test_a_drifted_master_waits_for_approval_before_it_restarts() -> None:
    spec = spec_with(**{"master.requireApprovalForRestart": True})
    cluster = fleet()
    cluster.reconcile(spec)
    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = cluster.status.pending_approval or ""
    cluster.reconcile(spec)
    cluster.settle("mooncake-master")
    cluster.reconcile(spec)
    assert cluster.stage_phases()["prefill"] == "Progressing"  # the rollout's approval given and used
    args = cluster.obj("mooncake-master")["spec"]["template"]["spec"]["containers"][0]["args"]
    args[:] = [a for a in args if not a.startswith("--eviction_ratio")] + ["--eviction_ratio=0.3"]
    cluster.obj("mooncake-master")["metadata"]["generation"] += 1
    cluster.settle("mooncake-master")
    cluster.writes.clear()
    cluster.reconcile(spec)
    status = cluster.status
    assert status.phase is Phase.AWAITING_APPROVAL and cluster.stage_phases()["master"] == "AwaitingApproval"
    assert ("Deployment", "mooncake-master") not in cluster.writes
    assert "--eviction_ratio: 0.3 -> 0.1" in (status.condition("Ready").message if status.condition("Ready") else "")


def test_a_settings_file_an_earlier_release_wrote_gets_the_one_lease_mode_key() -> None:
    """An operator of the previous release wrote the lease mode as booleans; this one owns them
    as absent: the file is rewritten once, with `mooncake_lease_mode` and without the aliases
    (the connector never sees the mode said twice), and the policy ends Ready."""
    cluster = fleet()
    assert cluster.run(SPEC).phase is Phase.READY
    data = cluster.config_maps[settings_config_map_name("decode")]["data"]
    current = json.loads(data[SETTINGS_FILE_NAME])
    old = {k: v for k, v in current.items() if k != "mooncake_lease_mode"}
    data[SETTINGS_FILE_NAME] = json.dumps({**old, "mooncake_selective_lease": True,
                                           "mooncake_kda_last_hit_only": False})
    cluster.writes.clear()
    assert cluster.run(SPEC).phase is Phase.READY
    assert cluster.writes == [("ConfigMap", settings_config_map_name("decode"))]
    rewritten = cluster.config_maps[settings_config_map_name("decode")]["data"][SETTINGS_FILE_NAME]
    assert json.loads(rewritten) == current
