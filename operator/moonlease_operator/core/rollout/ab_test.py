"""The rollout seen through an A/B test (strategy ABTest): the test carried on by a reading, a
person's decision or a verb; the control held out of the rollout until the test promotes; the
treatment rolled back when the verdict says so; and the ABTestConcluded condition."""

from __future__ import annotations

import dataclasses
from typing import Any

from moonlease_operator.api import (
    AB_DECISION_ANNOTATION,
    ABTestPhase,
    ABTestStatus,
    ConditionStatus,
    ConditionType,
    Phase,
    Reason,
    StageName,
    StagePhase,
)
from moonlease_operator.core.ab_plan import (
    apply_decision_annotation,
    begin_test,
    decision_hint,
    record_measurement,
    start_measuring,
)
from moonlease_operator.core.ab_spec_checks import evaluate_arm_mix
from moonlease_operator.core.conditions import set_condition
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.fleet import Fleet
from moonlease_operator.core.rollout.common import Outcome
from moonlease_operator.core.rollout.context import PlanContext, Progress
from moonlease_operator.core.verbs import VerbEffect


def begin_ab_test(ctx: PlanContext, effect: VerbEffect) -> tuple[PlanContext, ABTestStatus | None,
                                                                  tuple[EventNote, ...]]:
    """With strategy ABTest: carry the test on (a reading, a human's decision, a verb) and
    hold the control out of the rollout until the test promotes (the context returned has it
    held, not in the fleet). Paused: no reading counts, no decision is taken."""
    spec = ctx.spec.rollout.ab_test
    if spec is None:
        return ctx, None, ()
    notes: list[EventNote] = []
    ab = begin_test(None if effect is VerbEffect.RETRY else ctx.previous.ab_test, ctx.desired_hash)
    reading = ctx.observed.ab_reading
    if ctx.paused_at is None:
        if ab.phase is ABTestPhase.MEASURING and reading is not None:
            ab, measured = record_measurement(ab, spec, reading, ctx.now,
                                              policy=ctx.policy.name, namespace=ctx.policy.namespace)
            notes.extend(measured)
        ab, decided = apply_decision_annotation(ab, ctx.policy.annotations.get(AB_DECISION_ANNOTATION), ctx.now)
        notes.extend(decided)
    if effect is VerbEffect.PROMOTE:
        ab = ab.model_copy(update={"phase": ABTestPhase.PROMOTING, "action": "Promote", "decided_at": ctx.now,
                                   "reason": f"promoted by a person after {ab.samples} samples; {ab.reason}"[:4096]})
    elif effect is VerbEffect.ABORT and ab.phase is not ABTestPhase.PROMOTING:
        # Aborting a promotion rolls back the control's stages instead (see `abort`): the test stays promoting.
        ab = ab.model_copy(update={"phase": ABTestPhase.ROLLING_BACK, "action": "RollBack", "decided_at": ctx.now,
                                   "reason": f"aborted by a person after {ab.samples} samples; {ab.reason}"[:4096]})
    if ab.phase not in (ABTestPhase.PROMOTING, ABTestPhase.PROMOTED):
        control = set(spec.control.workloads)
        fleet = ctx.fleet
        held = frozenset(m.key for m in fleet.members if m.target is not None and m.name in control)
        ctx = dataclasses.replace(ctx, held=held, fleet=Fleet(tuple(m for m in fleet.members if m.key not in held),
                                                              fleet.missing, fleet.unmatched))
    return ctx, ab, tuple(notes)


def arm_mix(ctx: PlanContext) -> str | None:
    """`UnbalancedArms`: the warning about the arms' prefill/decode mixes, or None."""
    spec = ctx.spec.rollout.ab_test
    assert spec is not None
    replicas: dict[str, tuple[str, int]] = {}
    for target in ctx.spec.targets:  # both arms: the held control is not among the fleet's members
        obj = ctx.observed.workloads.get((target.kind.value, target.name or ""))
        if obj is not None:
            replicas[target.name or ""] = (target.role.value, int((obj.get("spec") or {}).get("replicas", 1) or 0))
    return evaluate_arm_mix(spec, replicas)


def fail_treatment(ctx: PlanContext, progress: Progress) -> Progress:
    """The verdict rolls the treatment back: its last changed stage counts as failed, so the
    rollback machinery restores every treatment stage this attempt changed (never the
    master: both arms share it, so its settings were not under test)."""
    assert progress.ab is not None
    changed = [n for n in ctx.order if n is not StageName.MASTER
               and progress.stages[n].phase is StagePhase.SUCCEEDED]
    if not changed:
        return progress
    name = changed[-1]
    return progress.but(failed_stage=name).with_stage(name, progress.stages[name].model_copy(update={
        "phase": StagePhase.FAILED, "finished_at": ctx.now,
        "message": f"A/B test {progress.ab.verdict or 'decision'}: rolling the treatment back"}))


def ab_outcome(ctx: PlanContext, progress: Progress, outcome: Outcome) -> tuple[Outcome, Progress]:
    """The rollout's outcome seen through the A/B test, which moves on when the rollout
    settles: measuring once the treatment is ready, promoted once the control is."""
    ab, spec = progress.ab, ctx.spec.rollout.ab_test
    assert ab is not None and spec is not None
    if ab.phase is ABTestPhase.ROLLING_BACK:
        if outcome.phase is Phase.ROLLING_BACK:
            return Outcome(Phase.ROLLING_BACK, outcome.stage, Reason.AB_TEST_ROLLING_BACK,
                           f"A/B test {ab.verdict}: rolling the treatment back ({outcome.message})"), progress
        restored = outcome.phase is Phase.DEGRADED and outcome.reason is Reason.ROLLED_BACK
        what = ("the treatment was rolled back to what it ran before the test" if restored else
                "the treatment ran this configuration before the test: there is nothing to roll back to"
                if outcome.phase is Phase.READY else "rolling the treatment back did not complete")
        ab = ab.model_copy(update={"phase": ABTestPhase.ROLLED_BACK, "reason": f"{ab.reason}; {what}"[:4096]})
        progress = progress.but(ab=ab)
    if ab.phase is ABTestPhase.ROLLED_BACK:
        if outcome.reason is Reason.ROLLBACK_INCOMPLETE:
            return outcome, progress
        return Outcome(Phase.DEGRADED, outcome.stage, Reason.AB_TEST_ROLLED_BACK,
                       f"A/B test {ab.verdict}: {ab.reason} (change the spec to test again)"), progress
    if outcome.phase is not Phase.READY:
        return outcome, progress  # the rollout (of the treatment, or of the control's promotion) is under way
    if ab.phase is ABTestPhase.DEPLOYING:
        ab, notes = start_measuring(ab, spec, list(spec.control.workloads), list(spec.treatment.workloads), ctx.now)
        progress = progress.but(ab=ab).noted(*notes)
        unbalanced = arm_mix(ctx)
        if unbalanced is not None:
            progress = progress.noted(EventNote("Warning", Reason.UNBALANCED_ARMS.value, f"A/B test: {unbalanced}"))
    if ab.phase is ABTestPhase.MEASURING:
        return Outcome(Phase.ANALYZING, outcome.stage, Reason.AB_TEST_MEASURING,
                       f"A/B test: {ab.samples} of {spec.min_samples} samples; {ab.reason}"), progress
    if ab.phase is ABTestPhase.AWAITING_DECISION:
        return Outcome(Phase.AWAITING_DECISION, outcome.stage, Reason.AB_TEST_AWAITING_DECISION,
                       f"A/B test {ab.verdict}: {ab.reason}. "
                       f"{decision_hint(ab, ctx.policy.name, ctx.policy.namespace)}"), progress
    if ab.phase is ABTestPhase.PROMOTING:
        ab = ab.model_copy(update={"phase": ABTestPhase.PROMOTED})
        progress = progress.but(ab=ab).noted(EventNote(
            "Normal", Reason.AB_TEST_PROMOTED.value,
            f"A/B test {ab.verdict}: the control runs the treatment's configuration {ab.config_hash}"))
    return Outcome(Phase.READY, outcome.stage, Reason.AB_TEST_PROMOTED,
                   f"A/B test {ab.verdict}: promoted; every stage runs configuration {ctx.desired_hash}"), progress


def ab_condition(ctx: PlanContext, ab: ABTestStatus | None, conditions: list[Any]) -> list[Any]:
    """ABTestConcluded: False while the test measures (why no verdict yet: measuring, no
    data, failed measurements), True once it decided; absent without an A/B test."""
    kind = ConditionType.AB_TEST_CONCLUDED.value
    if ab is None:
        return [c for c in conditions if c.type != kind]
    if ab.phase in (ABTestPhase.DEPLOYING, ABTestPhase.MEASURING):
        reason = (Reason.MEASUREMENT_FAILED if ab.consecutive_errors else
                  Reason.AB_TEST_NO_DATA if ab.verdict == "NoData" else Reason.AB_TEST_MEASURING)
        message = ("Deploying the treatment" if ab.phase is ABTestPhase.DEPLOYING else
                   f"{ab.samples} of {ctx.spec.rollout.ab_test.min_samples if ctx.spec.rollout.ab_test else 0}"
                   f" samples; {ab.reason}")
        unbalanced = arm_mix(ctx)
        if unbalanced is not None:
            message = f"{message}. Warning ({Reason.UNBALANCED_ARMS.value}): {unbalanced}"
        return set_condition(conditions, type_=kind, status=ConditionStatus.FALSE, reason=reason.value,
                             message=message, generation=ctx.policy.generation, now=ctx.now)
    reason = {ABTestPhase.PROMOTING: Reason.AB_TEST_PROMOTING, ABTestPhase.PROMOTED: Reason.AB_TEST_PROMOTED,
              ABTestPhase.ROLLING_BACK: Reason.AB_TEST_ROLLING_BACK,
              ABTestPhase.ROLLED_BACK: Reason.AB_TEST_ROLLED_BACK,
              ABTestPhase.AWAITING_DECISION: Reason.AB_TEST_AWAITING_DECISION}[ab.phase]
    return set_condition(conditions, type_=kind, status=ConditionStatus.TRUE, reason=reason.value,
                         message=f"{ab.verdict} after {ab.samples} samples: {ab.reason}",
                         generation=ctx.policy.generation, now=ctx.now)
