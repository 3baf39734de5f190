"""The bounded per-target status (issue 16): counts for the whole fleet, the targets that need
attention listed up to a limit, and a 5,000-target policy's status well under 64 KiB."""

from __future__ import annotations

import json

import pytest

from moonlease_operator.api import Phase, StageName, TargetPhase, TargetStatus, WorkloadKind, read_spec
from moonlease_operator.core.rollout import Observed, PolicyRef, plan_reconcile
from moonlease_operator.core.status import dump_status, read_status
from moonlease_operator.core.target_summary import LISTED_TEXT_LIMIT, build_target_summary, needs_attention
from moonlease_operator.core.write_failures import WriteFailure, record_write_failures
from tests.unit.test_rollout_plan import SPEC, T0, deployment, master_deployment

pytestmark = pytest.mark.unit

STATUS_LIMIT = 64 * 1024


def target(name: str, phase: TargetPhase, *, role: StageName = StageName.DECODE, message: str = "",
           write_error: str | None = None) -> TargetStatus:
    return TargetStatus(kind=WorkloadKind.DEPLOYMENT, name=name, role=role, phase=phase, message=message,
                        write_error=write_error)


def test_ready_targets_are_counted_and_the_others_listed_urgent_first_in_fleet_order() -> None:
    targets = [target("master", TargetPhase.READY, role=StageName.MASTER),
               *(target(f"p{i}", TargetPhase.PENDING, role=StageName.PREFILL) for i in range(3)),
               target("d0", TargetPhase.READY), target("d1", TargetPhase.READY, write_error="403 Forbidden"),
               target("d2", TargetPhase.FAILED, message="crash loop"), target("d3", TargetPhase.UPDATING)]
    summary = build_target_summary(targets, limit=3)
    # The refused write and the failure first, then the first pending one; shown in fleet order.
    assert [t.name for t in summary.listed] == ["p0", "d1", "d2"]
    assert summary.omitted == 3 and summary.total == 8
    assert [(c.role.value, c.phase.value, c.count) for c in summary.counts] == [
        ("master", "Ready", 1), ("prefill", "Pending", 3), ("decode", "Updating", 1), ("decode", "Ready", 2),
        ("decode", "Failed", 1)]
    assert not needs_attention(targets[0]) and needs_attention(targets[5])
    assert build_target_summary(targets, limit=0).listed == () and build_target_summary(targets, limit=0).omitted == 6
    with pytest.raises(ValueError):
        build_target_summary(targets, limit=-1)


def test_the_worst_status_of_5000_failed_targets_with_the_longest_texts_stays_bounded() -> None:
    """Every target Failed with a 32 KiB message and a 4 KiB write error: still 20 short entries."""
    targets = [target(f"vllm-decode-{i:05d}", TargetPhase.FAILED, message="x" * 32768, write_error="e" * 4096)
               for i in range(5000)]
    summary = build_target_summary(targets)
    assert len(summary.listed) == 20 and summary.omitted == 4980
    assert all(len(t.message) == LISTED_TEXT_LIMIT for t in summary.listed)
    status = read_status({}).model_copy(update={"targets": list(summary.listed), "target_counts": list(summary.counts),
                                                "targets_total": summary.total, "targets_omitted": summary.omitted})
    assert len(json.dumps(dump_status(status))) < STATUS_LIMIT


def test_a_5000_target_policy_plans_a_status_under_64_kib() -> None:
    """The planner itself, over 5,000 selected Deployments: the first reconcile (every target
    Pending) lists 20 and counts them all; a write refused for a workload beyond those 20 is
    listed nonetheless."""
    workloads = [master_deployment()] + [
        deployment(f"vllm-{role}-{i:04d}", labels={"fleet/role": role})
        for i in range(5000) for role in (("prefill",) if i % 2 == 0 else ("decode",))]
    spec = {**SPEC, "targets": [
        {"role": role, "mooncakeVersion": "0.3.14", "selector": {"matchLabels": {"fleet/role": role}}}
        for role in ("prefill", "decode")]}
    observed = Observed(workloads={(w["kind"], w["metadata"]["name"]): w for w in workloads})
    plan = plan_reconcile(spec=read_spec(spec), policy=PolicyRef("fleet", "ns", 1, "2026-01-01T00:00:00Z"),
                          previous=read_status({}), observed=observed, now=T0)
    status = plan.status
    assert status.phase is Phase.PROGRESSING and status.targets_total == 5001 and len(plan.all_targets) == 5001
    assert len(status.targets) == 20 and status.targets_omitted == 5000 - 20 + 1
    assert sum(c.count for c in status.target_counts) == 5001
    assert len(json.dumps(dump_status(status))) < STATUS_LIMIT

    failed = WriteFailure("Deployment", "vllm-decode-4999", 422, "Invalid", "metadata.annotations: Too long")
    final, notes = record_write_failures(status, [failed], generation=1, now=T0, all_targets=plan.all_targets,
                                         listed_targets=plan.listed_targets)
    assert [t.name for t in final.targets if t.write_error] == ["vllm-decode-4999"] and len(final.targets) == 20
    assert final.condition("WriteFailed") is not None and len(notes) == 1
    assert len(json.dumps(dump_status(final))) < STATUS_LIMIT
