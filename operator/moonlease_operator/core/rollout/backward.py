"""Backward: with `onFailure: rollback` (or the abort verb, or an A/B verdict against the
treatment) every stage the attempt changed is restored, last stage first, each through its
workload's own rolling update (so `maxUnavailable` holds). Rolling the master back restarts it
and empties the store: after a target stage failed it keeps its new settings unless that is
approved."""

from __future__ import annotations

from moonlease_operator.api import ABTestPhase, FailurePolicy, Phase, Reason, StageName, StagePhase
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.health import Health
from moonlease_operator.core.master_restart import MasterRestart, RestartDirection
from moonlease_operator.core.rollout.common import Outcome, describe_health, failure_of, join
from moonlease_operator.core.rollout.context import (
    PlanContext,
    Progress,
    past_deadline,
    rolled_back_message,
    set_stage,
    write_error,
)


def unwind(ctx: PlanContext, progress: Progress) -> tuple[Outcome, Progress]:
    """Roll back, last stage first, every stage this attempt changed."""
    failed = progress.failed_stage
    failure = failure_of(progress.stages[failed].message) if failed is not None and failed in progress.stages else ""
    ab = progress.ab
    ab_rollback = ab is not None and ab.phase in (ABTestPhase.ROLLING_BACK, ABTestPhase.ROLLED_BACK)
    if not ab_rollback and not progress.aborting and ctx.spec.rollout.on_failure is FailurePolicy.HALT and not any(
            s.phase in (StagePhase.ROLLING_BACK, StagePhase.ROLLED_BACK) for s in progress.stages.values()):
        name = failed or ctx.order[-1]
        return Outcome(Phase.DEGRADED, name, Reason.HALTED,
                       f"Stage {name.value} failed ({failure}); halted as spec.rollout.onFailure says"), progress
    for name in reversed(ctx.order):
        stage = progress.stages[name]
        if ab_rollback and name is StageName.MASTER:
            continue  # shared by both arms: not under test
        members = [m for m in ctx.fleet.in_stage(name) if ctx.changed_in_attempt(m)]
        if stage.phase in (StagePhase.SUCCEEDED, StagePhase.FAILED, StagePhase.PROGRESSING):
            changes = [c for m in members for c in ctx.rollback_pending(m)]
            if not changes:
                progress = set_stage(ctx, progress, name, StagePhase.ROLLED_BACK,
                                     rolled_back_message(progress, name, "nothing to restore"), finished=True)
                continue
            if name is StageName.MASTER:
                restart = ctx.master_restart(RestartDirection.ROLLBACK, ctx.master.config_hash, ctx.describe(changes))
                held, progress = _hold_master_rollback(ctx, progress, restart, failed, failure)
                if held is not None:
                    return held, progress
                if progress.master_kept is not None:
                    continue
                progress = progress.noted(restart.note())
            progress = progress.changing(changes)
            progress = set_stage(ctx, progress, name, StagePhase.ROLLING_BACK,
                                 rolled_back_message(progress, name, "rolling back"), started=True)
            return Outcome(Phase.ROLLING_BACK, name, Reason.ROLLING_BACK,
                           f"Stage {(failed or name).value} failed ({failure}); rolling back stage {name.value}"), progress
        if stage.phase is StagePhase.ROLLING_BACK:
            changes = [c for m in members for c in ctx.rollback_pending(m)]
            if changes and name is StageName.MASTER:
                progress = progress.noted(ctx.master_restart(RestartDirection.ROLLBACK, ctx.master.config_hash,
                                                             ()).note(retry=True))
            progress = progress.changing(changes)
            health = [(m, ctx.health[m.key]) for m in members]
            broken = [(m, h) for m, h in health if h.health is Health.FAILED]
            refused = [f"{m.kind}/{m.name}: {error}" for m in members if (error := write_error(ctx, progress, m))]
            waiting = [(m, h) for m, h in health if h.health is not Health.COMPLETE]
            if refused or broken or ((changes or waiting) and past_deadline(ctx, stage)):
                keys = {m.key for m in members}
                progress = progress.but(changes=tuple(c for c in progress.changes if not refused or c.ref not in keys))
                progress = set_stage(ctx, progress, name, StagePhase.ROLLBACK_FAILED, rolled_back_message(
                    progress, name, "rollback did not complete: " + (join(refused) or describe_health(broken or waiting))),
                    finished=True)
                continue
            if changes or waiting:
                return Outcome(Phase.ROLLING_BACK, name, Reason.ROLLING_BACK,
                               f"Stage {(failed or name).value} failed ({failure}); rolling back stage"
                               f" {name.value}: {describe_health(waiting) or 'restoring'}"), progress
            progress = set_stage(ctx, progress, name, StagePhase.ROLLED_BACK,
                                 rolled_back_message(progress, name, "rolled back"), finished=True)
    incomplete = [n.value for n in ctx.order if progress.stages[n].phase is StagePhase.ROLLBACK_FAILED]
    name = failed or ctx.order[-1]
    if progress.master_kept is not None:
        return Outcome(Phase.DEGRADED, name, Reason.ROLLED_BACK,
                       f"Stage {name.value} failed ({failure}); the targets were rolled back; "
                       + progress.master_kept), progress
    if incomplete:
        return Outcome(Phase.DEGRADED, name, Reason.ROLLBACK_INCOMPLETE,
                       f"Stage {name.value} failed ({failure}); rollback incomplete for stage(s)"
                       f" {', '.join(incomplete)}"), progress
    return Outcome(Phase.DEGRADED, name, Reason.ROLLED_BACK,
                   f"Stage {name.value} failed ({failure}); every changed stage was rolled back"), progress


def _hold_master_rollback(ctx: PlanContext, progress: Progress, restart: MasterRestart, failed: StageName | None,
                          failure: str) -> tuple[Outcome | None, Progress]:
    """Whether rolling the master back must wait: a failure in a target stage leaves the
    master's new settings in place unless that rollback is approved; a failure of the master's
    own stage rolls it back, approved first if `requireApprovalForRestart`. Sets
    `pending_approval` (and `master_kept`) when it holds; returns the outcome when the rollback
    stops here."""
    own_failure = failed is StageName.MASTER
    if restart.approved_by(ctx.policy.annotations) or (
            own_failure and not ctx.spec.master.require_approval_for_restart):
        return None, progress
    progress = progress.but(pending_approval=restart.approval_key)
    request = restart.approval_request(ctx.policy.name)
    if own_failure:
        progress = set_stage(ctx, progress, StageName.MASTER, progress.stages[StageName.MASTER].phase,
                             f"{failure_of(progress.stages[StageName.MASTER].message)}; rollback waits for approval:"
                             f" {request}")
        return Outcome(Phase.AWAITING_APPROVAL, StageName.MASTER, Reason.AWAITING_APPROVAL,
                       f"Stage master failed ({failure}); rolling it back waits for approval: {request}"), progress
    master_kept = ("the master keeps its new settings (its own stage succeeded) unless you approve"
                   f" rolling it back: {request}")
    progress = progress.but(master_kept=master_kept)
    if ctx.previous.pending_approval != restart.approval_key:
        progress = progress.noted(EventNote("Normal", Reason.AWAITING_APPROVAL.value, master_kept))
    stage = progress.stages[StageName.MASTER]
    return None, progress.with_stage(StageName.MASTER, stage.model_copy(update={"message": master_kept}))
