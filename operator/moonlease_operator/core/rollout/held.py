"""Plans that change nothing in the cluster: a refused policy (Invalid) or one waiting for its
workloads (Pending). The verbs are still heard, and recorded once, by every plan."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

from moonlease_operator.api import (
    APPROVE_MASTER_RESTART_ANNOTATION,
    VERB_ANNOTATION,
    ConditionStatus,
    ConditionType,
    Phase,
    PolicyStatus,
    Reason,
)
from moonlease_operator.core.conditions import set_condition
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.rollout.common import join, ordered
from moonlease_operator.core.rollout.inputs import PolicyRef, ReconcilePlan
from moonlease_operator.core.verbs import (
    VerbDecision,
    VerbEffect,
    VerbSituation,
    plan_approval,
    plan_verb,
    read_new_value,
)


def refused(previous: PolicyStatus, policy: PolicyRef, reason: Reason, problems: Sequence[str],
            now: datetime.datetime) -> ReconcilePlan:
    """Phase Invalid: nothing changes in the cluster; the rollout state is kept for later."""
    message = join(problems)
    conditions = list(previous.conditions)
    conditions = set_condition(conditions, type_=ConditionType.INVALID.value, status=ConditionStatus.TRUE,
                               reason=reason.value, message=message, generation=policy.generation, now=now)
    for type_ in (ConditionType.READY, ConditionType.PROGRESSING):
        conditions = set_condition(conditions, type_=type_.value, status=ConditionStatus.FALSE, reason=reason.value,
                                   message=message, generation=policy.generation, now=now)
    return _held(previous, policy, Phase.INVALID, conditions, now, "Warning", reason, message)


def waiting_for_workloads(previous: PolicyStatus, policy: PolicyRef, missing: Sequence[str],
                          now: datetime.datetime) -> ReconcilePlan:
    """Phase Pending: the spec is fine, the workloads are not there (yet)."""
    message = "Waiting for " + join(missing)
    reason = Reason.WORKLOAD_NOT_FOUND
    conditions = list(previous.conditions)
    conditions = set_condition(conditions, type_=ConditionType.INVALID.value, status=ConditionStatus.FALSE,
                               reason=Reason.SPEC_VALID.value, message="The spec is valid",
                               generation=policy.generation, now=now)
    for type_ in (ConditionType.READY, ConditionType.PROGRESSING):
        conditions = set_condition(conditions, type_=type_.value, status=ConditionStatus.FALSE, reason=reason.value,
                                   message=message, generation=policy.generation, now=now)
    return _held(previous, policy, Phase.PENDING, conditions, now, "Warning", reason, message)


def _held(previous: PolicyStatus, policy: PolicyRef, phase: Phase, conditions: list[Any], now: datetime.datetime,
          event_type: str, reason: Reason, message: str) -> ReconcilePlan:
    """Refused or waiting: nothing changes in the cluster; verbs are still heard (only pause and
    resume can apply here: nothing is rolling out)."""
    situation = VerbSituation(
        phase=phase, ab_phase=previous.ab_test.phase if previous.ab_test is not None else None,
        revision=previous.revision, config_hash=previous.desired_config_hash, paused=previous.paused_at is not None,
        spec_paused=False, pending_approval=None)
    verb, approval = plan_verbs(policy, previous, situation)
    effect = verb.effect if verb is not None else VerbEffect.NONE
    status = previous.model_copy(update={
        "phase": phase, "observed_generation": policy.generation, "conditions": ordered(conditions),
        "last_transition_time": previous.last_transition_time if previous.phase == phase else now,
        "paused_at": now if effect is VerbEffect.PAUSE else None if effect is VerbEffect.RESUME else previous.paused_at,
        **verb_records(verb, approval, now),
    })
    old = previous.condition(ConditionType.READY)
    repeated = (previous.phase == phase and previous.observed_generation == policy.generation
                and old is not None and old.reason == reason.value and old.message == message)
    events = () if repeated else (EventNote(event_type, reason.value, message),)
    verb_notes = tuple(d.note() for d in (verb, approval) if d is not None)
    return ReconcilePlan(status=status, events=verb_notes + events, changes=())


def plan_verbs(policy: PolicyRef, previous: PolicyStatus,
               situation: VerbSituation) -> tuple[VerbDecision | None, VerbDecision | None]:
    """The verb and approval annotation values not handled yet, decided (None: nothing new)."""
    verb_value = read_new_value(policy.annotations, VERB_ANNOTATION, previous.last_verb)
    approval_value = read_new_value(policy.annotations, APPROVE_MASTER_RESTART_ANNOTATION, previous.last_approval)
    return (plan_verb(verb_value, situation) if verb_value is not None else None,
            plan_approval(approval_value, situation) if approval_value is not None else None)


def verb_records(verb: VerbDecision | None, approval: VerbDecision | None,
                 now: datetime.datetime) -> dict[str, Any]:
    """Status fields recording the annotation values handled now (each is acted on once)."""
    records: dict[str, Any] = {}
    if verb is not None:
        records["last_verb"] = verb.record(now)
    if approval is not None:
        records["last_approval"] = approval.record(now)
    return records
