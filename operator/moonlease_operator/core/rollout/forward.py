"""Forward through the stages: a stage already in sync is Skipped, one that is not is patched
(Progressing, a master restart announced and approved first if need be) and Succeeds once its
workloads are verified; a finished stage that drifted is reopened; a stage that fails hands over
to the rollback (`backward`) or halts. Also the verbs that hold or end the walk: pause, resume
and abort."""

from __future__ import annotations

import datetime

from moonlease_operator.api import FailurePolicy, Phase, Reason, StageName, StagePhase, TargetPhase
from moonlease_operator.core.changes import ChangeAction
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.fleet import Member
from moonlease_operator.core.health import Health
from moonlease_operator.core.master_restart import RestartDirection
from moonlease_operator.core.rollout.backward import unwind
from moonlease_operator.core.rollout.common import DONE, Outcome, describe_health, join, ts
from moonlease_operator.core.rollout.context import PlanContext, Progress, past_deadline, set_stage, write_error


def advance(ctx: PlanContext, progress: Progress) -> tuple[Outcome, Progress]:
    """Walk the stages in order; stop at the first one that is not done."""
    rollout = ctx.spec.rollout
    last_finished: datetime.datetime | None = None
    for name in ctx.order:
        stage = progress.stages[name]
        members = ctx.fleet.in_stage(name)
        drifted: list[Member] = []
        if name is StageName.MASTER and ctx.master_held is not None and not ctx.in_sync(ctx.fleet.master):
            return Outcome(Phase.DEGRADED, name, Reason.CONFLICTING_WRITER,
                           f"The master is left alone while another writer reverts it: {ctx.master_held}"), progress
        if stage.phase in DONE:
            # A finished stage is verified again on every reconcile (each watch event of its
            # workloads and settings ConfigMaps wakes one): a `kubectl rollout undo` or a hand
            # edit while a later stage runs reopens it, never a Ready over old settings.
            drifted = [m for m in members if not ctx.in_sync(m)]
            if not drifted:
                if stage.phase is StagePhase.SUCCEEDED:
                    last_finished = stage.finished_at
                continue
            progress = _reopen(ctx, progress, name, drifted)
            stage = progress.stages[name]
        if stage.phase in (StagePhase.PENDING, StagePhase.AWAITING_APPROVAL):
            pending = [m for m in members if not ctx.in_sync(m)]
            if not pending:
                progress = set_stage(ctx, progress, name, StagePhase.SKIPPED, "nothing to change", finished=True)
                continue
            if last_finished is not None and rollout.pause_between_stages_seconds:
                resume = last_finished + datetime.timedelta(seconds=rollout.pause_between_stages_seconds)
                if ctx.now < resume:
                    return Outcome(Phase.PROGRESSING, name, Reason.PAUSE_BETWEEN_STAGES,
                                   f"Stage {name.value} starts at {ts(resume)} (pause between stages)"), progress
            if rollout.paused:
                return Outcome(Phase.PAUSED, name, Reason.PAUSED,
                               f"Paused by spec.rollout.paused before stage {name.value}"), progress
            lines = ctx.describe([c for m in pending for c in ctx.pending(ctx.apply_changes(m))])
            restart = None
            if name is StageName.MASTER:
                restart = ctx.master_restart(RestartDirection.FORWARD, ctx.forward_key(lines), lines)
                if ctx.spec.master.require_approval_for_restart and not restart.approved_by(ctx.policy.annotations):
                    message = restart.approval_request(ctx.policy.name)
                    progress = set_stage(ctx, progress.but(pending_approval=restart.approval_key), name,
                                         StagePhase.AWAITING_APPROVAL, message)
                    return Outcome(Phase.AWAITING_APPROVAL, name, Reason.AWAITING_APPROVAL, message), progress
                progress = progress.noted(restart.note())
            for member in pending:
                progress = progress.changing(ctx.pending(ctx.apply_changes(member)))
            # The status says what is about to happen (a master restart in so many words).
            doing = (restart.describe() if restart is not None else
                     f"re-applying to {join([f'{m.kind}/{m.name}' for m in drifted])}, which drifted"
                     if drifted else f"updating {len(pending)} workload(s)")
            progress = set_stage(ctx, progress, name, StagePhase.PROGRESSING, doing, started=True)
            return Outcome(Phase.PROGRESSING, name, Reason.STAGE_PROGRESSING, f"Stage {name.value}: {doing}"), progress
        # Progressing: re-apply what is not there (a write that failed), then verify. A master
        # still to be patched is announced again: the last announcement may be all that got out.
        for member in members:
            again = ctx.pending(ctx.apply_changes(member))
            if again and name is StageName.MASTER:
                progress = progress.noted(ctx.master_restart(RestartDirection.FORWARD, ctx.master.config_hash,
                                                             ()).note(retry=True))
            progress = progress.changing(again)
        failed = [(m, ctx.health[m.key]) for m in members if ctx.health[m.key].health is Health.FAILED]
        refused = [f"{m.kind}/{m.name}: {error}" for m in members if (error := write_error(ctx, progress, m))]
        waiting = [(m, ctx.health[m.key]) for m in members
                   if ctx.health[m.key].health is not Health.COMPLETE or not ctx.in_sync(m)]
        # Completion first: a stage whose workloads are done is verified and succeeds however
        # late it is looked at (an operator away longer than the timeout never fails, nor rolls
        # back, work that finished meanwhile); the deadline fails only what is still waiting.
        if refused or failed or (waiting and past_deadline(ctx, stage)):
            why = (join(refused) if refused else describe_health(failed) if failed else
                   f"not ready within {rollout.stage_timeout_seconds}s: {describe_health(waiting)}")
            progress = set_stage(ctx, progress.but(failed_stage=name), name, StagePhase.FAILED, why, finished=True)
            progress = progress.but(changes=tuple(c for c in progress.changes if c.action is not ChangeAction.APPLY))
            if rollout.on_failure is FailurePolicy.HALT:
                return Outcome(Phase.DEGRADED, name, Reason.HALTED,
                               f"Stage {name.value} failed ({why}); halted as spec.rollout.onFailure says"), progress
            return unwind(ctx, progress)
        if waiting:
            return Outcome(Phase.PROGRESSING, name, Reason.STAGE_PROGRESSING,
                           f"Stage {name.value}: {describe_health(waiting)}"), progress
        progress = set_stage(ctx, progress, name, StagePhase.SUCCEEDED, f"{len(members)} workload(s) updated and verified",
                             finished=True)
        last_finished = ctx.now
    return Outcome(Phase.READY, ctx.order[-1], Reason.ROLLOUT_COMPLETE,
                   f"Every stage runs configuration {ctx.desired_hash}"), progress


def _reopen(ctx: PlanContext, progress: Progress, name: StageName, drifted: list[Member]) -> Progress:
    """A finished stage whose workloads no longer hold the configuration goes back to
    Pending, announced with what changed (`StageDrifted`), and is applied again in order."""
    what = join([f"{m.kind}/{m.name}" + (f" ({'; '.join(lines)})" if (lines := ctx.describe(
        ctx.pending(ctx.apply_changes(m)))) else "") for m in drifted])
    message = f"drifted after it {progress.stages[name].phase.value.lower()}: {what}"
    progress = progress.noted(EventNote("Warning", Reason.STAGE_DRIFTED.value, f"Stage {name.value} {message}"))
    return progress.with_stage(name, progress.stages[name].model_copy(update={
        "phase": StagePhase.PENDING, "message": message[:32768], "finished_at": None}))


def paused(ctx: PlanContext) -> Outcome:
    """Held by the pause verb: nothing starts, times out or is measured."""
    assert ctx.paused_at is not None
    stage = ctx.previous.current_stage or (ctx.order[0] if ctx.order else None)
    return Outcome(Phase.PAUSED, stage, Reason.PAUSED_BY_VERB,
                   f"Paused by a person since {ts(ctx.paused_at)}: nothing starts, times out or is measured;"
                   f" resume with: moonlease resume {ctx.policy.name} -n {ctx.policy.namespace}")


def shift_stage_clocks(progress: Progress, paused_for: datetime.timedelta) -> Progress:
    """On resume: a stage's timeout does not count the time the pause held it."""
    for name, stage in progress.stages.items():
        if stage.phase is StagePhase.PROGRESSING and stage.started_at is not None:
            progress = progress.with_stage(name, stage.model_copy(update={"started_at": stage.started_at + paused_for}))
    return progress


def abort(ctx: PlanContext, progress: Progress) -> Progress:
    """The abort verb: the stage under way (else the last one done, else the first) fails,
    so the rollback machinery restores what this attempt changed, whatever onFailure says."""
    under_way = [n for n in ctx.order if progress.stages[n].phase in (StagePhase.PROGRESSING,
                                                                     StagePhase.AWAITING_APPROVAL)]
    done = [n for n in ctx.order if progress.stages[n].phase is StagePhase.SUCCEEDED]
    name = (under_way or done[-1:] or list(ctx.order))[0]
    return set_stage(ctx, progress.but(failed_stage=name, aborting=True), name, StagePhase.FAILED,
                     "aborted by a person (moonlease abort)", finished=True)


def with_excluded(ctx: PlanContext, progress: Progress, outcome: Outcome) -> tuple[Outcome, Progress]:
    """Targets left out are reported on themselves and announced once; the rest carried on.
    What would be Ready is Degraded (`MembersExcluded`) while any is left out."""
    before = {(s.kind.value, s.name) for s in ctx.previous.targets if s.phase is TargetPhase.EXCLUDED}
    lines = [f"{m.kind}/{m.name}: {why}" for m, why in ctx.excluded.values()] + list(ctx.fleet.unmatched)
    for key, (member, why) in sorted(ctx.excluded.items()):
        if key not in before and key not in ctx.conflicts.held:  # announced as ConflictingWriter
            progress = progress.noted(EventNote("Warning", Reason.MEMBER_EXCLUDED.value,
                                                f"{member.kind}/{member.name} left out, the others carry on: {why}"))
    if outcome.phase is not Phase.READY:
        return outcome, progress
    reason = Reason.CONFLICTING_WRITER if set(ctx.excluded) & set(ctx.conflicts.held) else Reason.MEMBER_EXCLUDED
    return Outcome(Phase.DEGRADED, outcome.stage, reason,
                   f"Every other workload runs configuration {ctx.desired_hash}; left out: {join(lines)}"), progress
