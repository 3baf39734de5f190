"""Whether a policy's spec is accepted, and the status that says so. Pure.

This is the foundation's whole reconcile: the spec is parsed with the same rules as the CRD
(schema and CEL mirrors); an invalid spec gets phase Invalid, Invalid=True and one warning
event per generation; a valid one gets Invalid=False and Ready=False/Accepted in phase Pending,
because nothing has been rolled out to the workloads yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from moonlease_operator.api import (
    ConditionStatus,
    ConditionType,
    Phase,
    PolicySpec,
    PolicySpecError,
    PolicyStatus,
    Reason,
    parse_spec,
)
from moonlease_operator.core.conditions import set_condition

ACCEPTED_MESSAGE = "Policy accepted"


@dataclass(frozen=True)
class AcceptancePlan:
    """What to do about one spec.

    `spec` is None when the spec was refused (`problems` then says why). `warning` is the event
    message to post, or None when the same verdict was already reported for this generation
    (a resume after an operator restart must not repeat the event).
    """

    spec: PolicySpec | None
    problems: tuple[str, ...]
    status: PolicyStatus
    warning: str | None

    @property
    def accepted(self) -> bool:
        return self.spec is not None


def plan_acceptance(
    raw_spec: Mapping[str, Any],
    *,
    generation: int | None,
    previous: PolicyStatus,
    now: datetime,
) -> AcceptancePlan:
    """Judge `raw_spec` and build the status that reports the verdict."""
    try:
        spec: PolicySpec | None = parse_spec(raw_spec)
        problems: tuple[str, ...] = ()
    except PolicySpecError as exc:
        spec, problems = None, tuple(exc.problems)

    conditions = list(previous.conditions)
    if spec is None:
        message = "; ".join(problems)
        phase = Phase.INVALID
        conditions = set_condition(conditions, type_=ConditionType.INVALID.value, status=ConditionStatus.TRUE,
                                   reason=Reason.INVALID_SPEC.value, message=message,
                                   generation=generation, now=now)
        conditions = set_condition(conditions, type_=ConditionType.READY.value, status=ConditionStatus.FALSE,
                                   reason=Reason.INVALID_SPEC.value, message=message,
                                   generation=generation, now=now)
    else:
        phase = Phase.PENDING
        conditions = set_condition(conditions, type_=ConditionType.INVALID.value, status=ConditionStatus.FALSE,
                                   reason=Reason.SPEC_VALID.value, message="The spec is valid",
                                   generation=generation, now=now)
        conditions = set_condition(conditions, type_=ConditionType.READY.value, status=ConditionStatus.FALSE,
                                   reason=Reason.ACCEPTED.value, message=ACCEPTED_MESSAGE,
                                   generation=generation, now=now)

    status = previous.model_copy(update={
        "phase": phase,
        "observed_generation": generation,
        "conditions": conditions,
        "last_transition_time": previous.last_transition_time if previous.phase == phase else now,
    })
    already_reported = previous.phase == Phase.INVALID and previous.observed_generation == generation
    warning = "; ".join(problems) if spec is None and not already_reported else None
    return AcceptancePlan(spec=spec, problems=problems, status=status, warning=warning)


def read_status(raw: Mapping[str, Any] | None) -> PolicyStatus:
    """The stored status, or an empty one if it is absent or unreadable (we own it: rewrite it)."""
    try:
        return PolicyStatus.model_validate(dict(raw or {}))
    except ValueError:
        return PolicyStatus()


def dump_status(status: PolicyStatus) -> dict[str, Any]:
    """The status as the JSON to merge-patch into `.status`.

    Unset top-level fields are null, so the merge patch removes stale ones; nested unset fields
    are left out (lists are replaced whole by a merge patch anyway).
    """
    data = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    for name, info in PolicyStatus.model_fields.items():
        data.setdefault(info.alias or name, None)
    return data
