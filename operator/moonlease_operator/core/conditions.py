"""Status conditions by Kubernetes conventions. Pure.

`lastTransitionTime` moves only when a condition's status flips: re-asserting the same status
(on every resume or re-evaluation) must not reset how long the state has held.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from moonlease_operator.api import Condition, ConditionStatus, Reason
from moonlease_operator.core.events import EventNote


def set_condition(
    conditions: Sequence[Condition],
    *,
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    generation: int | None,
    now: datetime,
) -> list[Condition]:
    """`conditions` with the one of `type_` replaced (or appended), keeping the list's order."""
    old = next((c for c in conditions if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == status else now
    new = Condition(type=type_, status=status, reason=reason, message=message,
                    last_transition_time=since, observed_generation=generation)
    if old is None:
        return [*conditions, new]
    return [new if c.type == type_ else c for c in conditions]


def set_warning_condition(
    conditions: Sequence[Condition],
    *,
    type_: str,
    reason: str,
    message: str | None,
    cleared: str,
    generation: int | None,
    now: datetime,
) -> tuple[list[Condition], EventNote | None]:
    """A warning the operator posts without holding the rollout: True with `message` (and a
    Warning event of `reason` when that message is new — a standing warning is posted once, not
    on every reconcile), False with `cleared` once `message` is None; absent for a policy that
    never had it."""
    old = next((c for c in conditions if c.type == type_), None)
    if message is not None:
        message = message[:32768]
        updated = set_condition(conditions, type_=type_, status=ConditionStatus.TRUE, reason=reason,
                                message=message, generation=generation, now=now)
        repeated = old is not None and old.status is ConditionStatus.TRUE and old.message == message
        return updated, None if repeated else EventNote("Warning", reason, message)
    if old is None:
        return list(conditions), None
    return set_condition(conditions, type_=type_, status=ConditionStatus.FALSE, reason=Reason.AS_EXPECTED.value,
                         message=cleared, generation=generation, now=now), None
