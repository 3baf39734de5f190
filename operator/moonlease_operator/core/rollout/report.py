"""What one reconcile reports: the policy status (conditions, stages, the targets that need
attention and the counts of the rest) and the events that announce a change of phase."""

from __future__ import annotations

from typing import Any

from moonlease_operator.api import (
    ConditionStatus,
    ConditionType,
    Phase,
    PolicyStatus,
    Reason,
    StagePhase,
    StageStatus,
    TargetPhase,
    TargetStatus,
    WorkloadKind,
)
from moonlease_operator.core.conditions import set_condition
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.fleet import Member
from moonlease_operator.core.health import Health, WorkloadHealth, evaluate_health
from moonlease_operator.core.load_failure_policy import load_failure_warning, set_load_failure_condition
from moonlease_operator.core.rollout.ab_test import ab_condition
from moonlease_operator.core.rollout.common import MAX_LISTED, Outcome, flag, ordered
from moonlease_operator.core.rollout.context import PlanContext, Progress, write_error
from moonlease_operator.core.rollout.held import verb_records
from moonlease_operator.core.rollout.reverts import conflict_condition
from moonlease_operator.core.shared_store_evict import set_shared_store_evict_condition, shared_store_evict_warning
from moonlease_operator.core.slots import template_config_hash
from moonlease_operator.core.target_summary import build_target_summary
from moonlease_operator.core.write_failures import set_write_condition


def build_status(ctx: PlanContext, progress: Progress, outcome: Outcome, *, applied_hash: str | None,
                 applied_revision: int | None) -> tuple[PolicyStatus, tuple[TargetStatus, ...], Progress]:
    """The status to write, every target's state (of which the status lists those that need
    attention) and the progress with the LoadFailuresFailRequests event, if any."""
    prev, generation = ctx.previous, ctx.policy.generation
    conditions = list(prev.conditions)
    conditions = set_condition(conditions, type_=ConditionType.INVALID.value, status=ConditionStatus.FALSE,
                               reason=Reason.SPEC_VALID.value, message="The spec is valid and the fleet can run it",
                               generation=generation, now=ctx.now)
    ready = outcome.phase is Phase.READY
    progressing = outcome.phase in (Phase.PROGRESSING, Phase.ROLLING_BACK, Phase.ANALYZING)
    degraded = outcome.phase in (Phase.DEGRADED, Phase.ROLLING_BACK)
    for type_, value in ((ConditionType.READY, ready), (ConditionType.PROGRESSING, progressing)):
        conditions = set_condition(conditions, type_=type_.value, status=flag(value), reason=outcome.reason.value,
                                   message=outcome.message, generation=generation, now=ctx.now)
    conditions = set_condition(conditions, type_=ConditionType.DEGRADED.value, status=flag(degraded),
                               reason=outcome.reason.value if degraded else Reason.AS_EXPECTED.value,
                               message=outcome.message if degraded else "", generation=generation, now=ctx.now)
    conditions = ab_condition(ctx, progress.ab, conditions)
    conditions = conflict_condition(ctx, conditions)
    targets = _targets(ctx, progress) + _excluded_targets(ctx)
    conditions = set_write_condition(conditions, targets, generation=generation, now=ctx.now)
    conditions, progress = _load_failure_condition(ctx, progress, conditions)
    conditions, progress = _shared_store_evict_condition(ctx, progress, conditions)
    summary = build_target_summary(targets, ctx.listed_targets)
    status = prev.model_copy(update={
        "ab_test": progress.ab,
        "phase": outcome.phase,
        "observed_generation": generation,
        "conditions": ordered(conditions),
        "current_stage": outcome.stage,
        "stages": [progress.stages[name] for name in ctx.order],
        "targets": list(summary.listed),
        "target_counts": list(summary.counts),
        "targets_total": summary.total,
        "targets_omitted": summary.omitted,
        "desired_config_hash": ctx.desired_hash,
        "applied_config_hash": applied_hash,
        "revision": ctx.revision,
        "applied_revision": applied_revision,
        "failed_stage": progress.failed_stage,
        "pending_approval": progress.pending_approval,
        "last_transition_time": prev.last_transition_time if prev.phase == outcome.phase else ctx.now,
        "paused_at": ctx.paused_at,
        "conflicts": list(ctx.conflicts.records),
        **verb_records(ctx.verb, ctx.approval, ctx.now),
    })
    return status, tuple(targets), progress


def phase_events(previous: PolicyStatus, status: PolicyStatus) -> list[EventNote]:
    """The event that announces a change of phase (Ready, Degraded, Paused, AwaitingApproval)."""
    if status.phase == previous.phase:
        return []
    ready = status.condition(ConditionType.READY)
    message = ready.message if ready is not None else ""
    match status.phase:
        case Phase.READY:
            return [EventNote("Normal", Reason.ROLLOUT_COMPLETE.value, message)]
        case Phase.DEGRADED:
            degraded = status.condition(ConditionType.DEGRADED)
            return [EventNote("Warning", degraded.reason if degraded else Reason.ROLLED_BACK.value, message)]
        case Phase.PAUSED:
            return [EventNote("Normal", Reason.PAUSED.value, message)]
        case Phase.AWAITING_APPROVAL:
            return [EventNote("Normal", Reason.AWAITING_APPROVAL.value, message)]
    return []


def _load_failure_condition(ctx: PlanContext, progress: Progress,
                            conditions: list[Any]) -> tuple[list[Any], Progress]:
    """LoadFailuresFailRequests: the vLLM workloads whose failed store loads would fail
    requests (`core.load_failure_policy`), with a Warning event when that list changes."""
    warnings = [w for m in ctx.fleet.members if m.target is not None and m.obj is not None
                and (w := load_failure_warning(m.obj, m.container)) is not None]
    conditions, note = set_load_failure_condition(conditions, warnings, listed=MAX_LISTED,
                                                  generation=ctx.policy.generation, now=ctx.now)
    return conditions, progress if note is None else progress.noted(note)


def _shared_store_evict_condition(ctx: PlanContext, progress: Progress,
                                  conditions: list[Any]) -> tuple[list[Any], Progress]:
    """EvictOnSharedStore: per-engine evict on a store the policy's engines share
    (`core.shared_store_evict`), with a Warning event when the message changes."""
    members = [(m.obj, m.container) for m in ctx.fleet.members if m.target is not None and m.obj is not None]
    warning = shared_store_evict_warning(ctx.spec.connector.retention_evict, [obj for obj, _ in members],
                                         listed=MAX_LISTED, containers=[name for _, name in members])
    conditions, note = set_shared_store_evict_condition(conditions, warning, generation=ctx.policy.generation,
                                                        now=ctx.now)
    return conditions, progress if note is None else progress.noted(note)


def _targets(ctx: PlanContext, progress: Progress) -> list[TargetStatus]:
    result = []
    for member in ctx.fleet.members:
        stage = progress.stages.get(member.stage)
        health = ctx.health[member.key]
        phase = _target_phase(ctx, member, stage, health)
        result.append(TargetStatus(
            kind=WorkloadKind(member.kind), name=member.name, role=member.stage, phase=phase,
            observed_generation=health.generation, replicas=health.replicas, updated_replicas=health.updated,
            ready_replicas=health.ready, config_hash=template_config_hash(member.obj or {}),
            message=health.message, write_error=write_error(ctx, progress, member)))
    return result


def _excluded_targets(ctx: PlanContext) -> list[TargetStatus]:
    result = []
    for member, why in ctx.excluded.values():
        health = evaluate_health(member.obj, ctx.pods()) if member.obj is not None else None
        result.append(TargetStatus(
            kind=WorkloadKind(member.kind), name=member.name, role=member.stage, phase=TargetPhase.EXCLUDED,
            observed_generation=health.generation if health else None,
            replicas=health.replicas if health else None, updated_replicas=health.updated if health else None,
            ready_replicas=health.ready if health else None,
            config_hash=template_config_hash(member.obj) if member.obj is not None else None,
            message=f"left out: {why}"[:32768]))
    return result


def _target_phase(ctx: PlanContext, member: Member, stage: StageStatus | None,
                  health: WorkloadHealth) -> TargetPhase:
    stage_phase = stage.phase if stage is not None else StagePhase.PENDING
    if stage_phase in (StagePhase.ROLLING_BACK, StagePhase.ROLLED_BACK, StagePhase.ROLLBACK_FAILED):
        if not ctx.changed_in_attempt(member):
            return TargetPhase.READY if health.health is Health.COMPLETE else TargetPhase.UPDATING
        restored = not ctx.rollback_pending(member) and health.health is Health.COMPLETE
        if stage_phase is StagePhase.ROLLBACK_FAILED:
            # Its stage's rollback failed, but this member may be back: verified in the
            # reconcile that ended the rollback (its pods were read), or reported so since.
            previous = ctx.previous.stage(member.stage)
            verified = previous is not None and previous.phase is StagePhase.ROLLING_BACK
            was = next((t.phase for t in ctx.previous.targets if (t.kind.value, t.name) == member.key), None)
            return TargetPhase.ROLLED_BACK if restored and (verified or was is TargetPhase.ROLLED_BACK) \
                else TargetPhase.FAILED
        return TargetPhase.ROLLED_BACK if restored else TargetPhase.ROLLING_BACK
    if health.health is Health.FAILED:
        return TargetPhase.FAILED
    if not ctx.in_sync(member):
        return TargetPhase.PENDING
    return TargetPhase.READY if health.health is Health.COMPLETE else TargetPhase.UPDATING
