"""One reconcile of one policy, step by step: admit the policy (`admission`), fix the facts of
this attempt (verbs, the A/B test, health, conflicting writers, the revision, verified
settings), then walk the stages forward or back and report. Each step takes the frozen context
and the progress so far and returns the next progress."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence

from moonlease_operator.api import (
    ABTestPhase,
    Phase,
    PolicySpec,
    PolicySpecError,
    PolicyStatus,
    Reason,
    StageName,
    StagePhase,
    StageStatus,
)
from moonlease_operator.core.config_hash import build_config_hash
from moonlease_operator.core.conflicts import ConflictSettings
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.health import evaluate_health
from moonlease_operator.core.rollout.ab_test import ab_outcome, begin_ab_test, fail_treatment
from moonlease_operator.core.rollout.admission import Admitted, admit
from moonlease_operator.core.rollout.backward import unwind
from moonlease_operator.core.rollout.common import AT_REST, UNWINDING, Outcome
from moonlease_operator.core.rollout.context import PlanContext, Progress
from moonlease_operator.core.rollout.forward import abort, advance, paused, shift_stage_clocks, with_excluded
from moonlease_operator.core.rollout.held import plan_verbs
from moonlease_operator.core.rollout.inputs import Observed, PolicyRef, ReconcilePlan
from moonlease_operator.core.rollout.orphans import hold_orphan_restart, release_orphans
from moonlease_operator.core.rollout.report import build_status, phase_events
from moonlease_operator.core.rollout.reverts import track_conflicts
from moonlease_operator.core.rollout.verification import verify_settings
from moonlease_operator.core.target_summary import DEFAULT_LISTED_TARGETS
from moonlease_operator.core.verbs import VerbEffect, VerbSituation


def plan_reconcile(*, spec: PolicySpec | PolicySpecError, policy: PolicyRef, previous: PolicyStatus,
                   observed: Observed, now: datetime.datetime,
                   prometheus_allowlist: Sequence[str] | None = None,
                   listed_targets: int = DEFAULT_LISTED_TARGETS,
                   conflicts: ConflictSettings | None = None) -> ReconcilePlan:
    """Decide one reconcile of one policy (see the package docstring); `spec` as `read_spec`
    returned it, read once for the whole reconcile.

    `prometheus_allowlist`: the operator's allowed Prometheus URLs (None: not checked, for
    callers that never fetch). `listed_targets`: how many targets that need attention the
    status lists (`core.target_summary`; the rest are counted). `conflicts`: when to back off
    from another writer that keeps reverting what the operator wrote (`core.conflicts`)."""
    admitted = admit(spec=spec, policy=policy, previous=previous, observed=observed, now=now,
                     prometheus_allowlist=prometheus_allowlist)
    if isinstance(admitted, Admitted):
        return decide(plan_context(admitted, listed_targets=listed_targets,
                                   conflict_settings=conflicts or ConflictSettings()))
    return admitted


def plan_context(admitted: Admitted, *, listed_targets: int = DEFAULT_LISTED_TARGETS,
                 conflict_settings: ConflictSettings | None = None) -> PlanContext:
    """The context of an admitted policy before its attempt is decided: the configuration it
    wants and the revision the status holds."""
    fields = {f.name: getattr(admitted, f.name) for f in dataclasses.fields(Admitted)}
    return PlanContext(**fields, listed_targets=listed_targets,
                       conflict_settings=conflict_settings or ConflictSettings(),
                       desired_hash=build_config_hash({"master": admitted.master.config_hash,
                                                       "connector": admitted.connector.config_hash}),
                       revision=admitted.previous.revision or 0,
                       applied_revision=admitted.previous.applied_revision)


def decide(ctx: PlanContext) -> ReconcilePlan:
    """The plan of an admitted policy."""
    prev, desired_hash = ctx.previous, ctx.desired_hash
    verb, approval = plan_verbs(ctx.policy, prev, _verb_situation(ctx))
    effect = verb.effect if verb is not None else VerbEffect.NONE
    ctx = dataclasses.replace(ctx, verb=verb, approval=approval, paused_at=(
        ctx.now if effect is VerbEffect.PAUSE else
        None if effect in (VerbEffect.RESUME, VerbEffect.ABORT) else prev.paused_at))
    ctx, ab, ab_notes = begin_ab_test(ctx, effect)
    ctx = dataclasses.replace(ctx, health={m.key: evaluate_health(m.obj or {}, ctx.pods()) for m in ctx.fleet.members})
    ctx, conflict_notes = track_conflicts(ctx)
    notes = [*ab_notes, *conflict_notes]
    out_of_sync = [m for m in ctx.fleet.members if not ctx.in_sync(m)
                   and not (m.stage is StageName.MASTER and ctx.master_held is not None)]
    # At rest: Ready, or Degraded only because targets were left out (no stage failed), so a
    # target that comes back is brought in by a new attempt.
    at_rest = prev.phase in AT_REST or (prev.phase is Phase.DEGRADED and prev.failed_stage is None)
    drifted = at_rest and bool(out_of_sync)
    retrying = effect in (VerbEffect.RETRY, VerbEffect.PROMOTE)
    if prev.desired_config_hash != desired_hash or prev.revision is None or drifted or retrying:
        ctx = dataclasses.replace(ctx, revision=ctx.revision + 1)
        stages = [StageStatus(name=s, phase=StagePhase.PENDING) for s in ctx.spec.rollout.stages]
        failed_stage = None
        promoting = ab is not None and ab.phase is ABTestPhase.PROMOTING
        what = ("promoting the A/B treatment's configuration to the control" if promoting and (drifted or retrying)
                else "retrying the same configuration" if retrying else
                "re-applying to workloads that drifted or joined" if drifted and
                prev.desired_config_hash == desired_hash else f"configuration {desired_hash}")
        notes.append(EventNote("Normal", Reason.ROLLOUT_STARTED.value,
                               f"Rollout {ctx.revision}: {what}; stages "
                               + " -> ".join(s.value for s in ctx.spec.rollout.stages)))
    else:
        stages = [prev.stage(s) or StageStatus(name=s, phase=StagePhase.PENDING) for s in ctx.spec.rollout.stages]
        failed_stage = prev.failed_stage
    by_name = {s.name: s for s in stages}
    health, verify_notes = verify_settings(ctx, by_name)
    ctx = dataclasses.replace(ctx, health=health)
    progress = Progress(stages=by_name, notes=(*notes, *verify_notes), failed_stage=failed_stage, ab=ab)
    progress, orphan_restart = release_orphans(ctx, progress)
    if effect is VerbEffect.RESUME and prev.paused_at is not None:
        progress = shift_stage_clocks(progress, ctx.now - prev.paused_at)
    if effect is VerbEffect.ABORT:
        progress = abort(ctx, progress)
    outcome, progress = _walk(ctx, progress)
    if progress.ab is not None and outcome.reason is not Reason.PAUSED_BY_VERB:
        outcome, progress = ab_outcome(ctx, progress, outcome)
    if ctx.excluded or ctx.fleet.unmatched:
        outcome, progress = with_excluded(ctx, progress, outcome)
    applied_hash, applied_revision = prev.applied_config_hash, ctx.applied_revision
    if outcome.phase is Phase.READY:
        applied_hash, applied_revision = desired_hash, ctx.revision
    outcome, progress = hold_orphan_restart(ctx, progress, orphan_restart, outcome)
    status, all_targets, progress = build_status(ctx, progress, outcome, applied_hash=applied_hash,
                                                 applied_revision=applied_revision)
    verb_notes = [d.note() for d in (ctx.verb, ctx.approval) if d is not None]
    events = (*verb_notes, *progress.notes, *phase_events(prev, status))
    return ReconcilePlan(status=status, events=tuple(events), changes=progress.changes,
                         all_targets=all_targets, listed_targets=ctx.listed_targets)


def _walk(ctx: PlanContext, progress: Progress) -> tuple[Outcome, Progress]:
    """Back (a failed stage, an A/B verdict against the treatment), held (paused), or forward."""
    if progress.ab is not None and progress.ab.phase is ABTestPhase.ROLLING_BACK and \
            not any(s.phase in UNWINDING for s in progress.stages.values()):
        progress = fail_treatment(ctx, progress)
    if any(s.phase in UNWINDING for s in progress.stages.values()):
        return unwind(ctx, progress)  # a rollback is never paused
    if ctx.paused_at is not None:
        return paused(ctx), progress
    return advance(ctx, progress)


def _verb_situation(ctx: PlanContext) -> VerbSituation:
    prev, ab_spec = ctx.previous, ctx.spec.rollout.ab_test
    ab_phase = None
    if ab_spec is not None:
        ab_phase = prev.ab_test.phase if prev.ab_test is not None and prev.ab_test.config_hash == ctx.desired_hash \
            else ABTestPhase.DEPLOYING
    return VerbSituation(phase=prev.phase, ab_phase=ab_phase, revision=prev.revision, config_hash=ctx.desired_hash,
                         paused=prev.paused_at is not None, spec_paused=ctx.spec.rollout.paused,
                         pending_approval=prev.pending_approval)
