"""Deadlines from observed progress (issue 27): completion is checked before the deadline, so an
operator that was away longer than `stageTimeoutSeconds` verifies the work that finished
meanwhile instead of failing it and rolling it back; after a rollback that did not complete, the
members it did restore are reported restored."""

from __future__ import annotations

import datetime

import pytest

from moonlease_operator.api import Phase, StageName
from tests.unit.test_rollout_plan import (
    SPEC,
    Cluster,
    deployment,
    master_deployment,
    rolled_to,
)

pytestmark = pytest.mark.unit

AWAY = datetime.timedelta(seconds=3600)  # far past stageTimeoutSeconds (60)


def test_a_stage_that_finished_while_the_operator_was_away_succeeds() -> None:
    cluster = rolled_to("decode")
    # The operator is down; decode finishes; the operator comes back an hour later.
    cluster.settle("decode")
    cluster.now += AWAY
    cluster.reconcile(SPEC)
    status = cluster.status
    assert cluster.stage_phases() == {"master": "Succeeded", "prefill": "Succeeded", "decode": "Succeeded"}
    assert status.phase is Phase.READY and status.failed_stage is None
    assert "StageFailed" not in cluster.reasons() and "StageRollingBack" not in cluster.reasons()


def test_a_stage_still_waiting_past_its_deadline_fails_naming_what_waits() -> None:
    cluster = rolled_to("prefill")
    cluster.observe_only("prefill")
    cluster.now += AWAY
    cluster.reconcile(SPEC)
    stage = cluster.status.stage(StageName.PREFILL)
    assert stage is not None and stage.phase.value in ("RollingBack", "Failed")
    assert "not ready within 60s: Deployment/prefill" in stage.message  # never an empty list


def test_a_rollback_that_finished_while_the_operator_was_away_is_rolled_back_not_failed() -> None:
    cluster = rolled_to("prefill")
    cluster.observe_only("prefill")
    cluster.now += datetime.timedelta(seconds=61)
    cluster.reconcile(SPEC)
    assert cluster.stage_phases()["prefill"] == "RollingBack"
    cluster.settle("prefill")  # the restore completes while nobody watches
    cluster.now += AWAY
    cluster.reconcile(SPEC)
    assert cluster.stage_phases()["prefill"] == "RolledBack"
    assert "StageRollbackFailed" not in cluster.reasons()


def test_after_a_failed_rollback_the_members_that_were_restored_are_reported_restored() -> None:
    """Two decode workloads; the rollback restores one, the other never finishes: the stage is
    RollbackFailed, and its targets say which is back (RolledBack) and which is not (Failed)."""
    spec = {**SPEC, "targets": [*SPEC["targets"], {"name": "decode-b", "role": "decode", "mooncakeVersion": "0.3.14"}]}
    cluster = rolled_to("decode", spec, Cluster(master_deployment(), deployment("prefill"), deployment("decode"),
                                                deployment("decode-b")))
    cluster.settle("decode")
    cluster.observe_only("decode-b")  # decode-b never rolls out ...
    cluster.now += datetime.timedelta(seconds=61)
    cluster.reconcile(spec)
    assert cluster.stage_phases()["decode"] == "RollingBack"
    cluster.settle("decode")  # ... decode is restored, decode-b never finishes its restore either
    cluster.observe_only("decode-b")
    cluster.now += datetime.timedelta(seconds=61)
    for _ in range(3):
        cluster.reconcile(spec)
    assert cluster.stage_phases()["decode"] == "RollbackFailed"
    phases = {t.name: t.phase.value for t in cluster.status.targets}
    assert phases["decode"] == "RolledBack" and phases["decode-b"] == "Failed"
