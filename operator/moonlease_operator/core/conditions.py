"""Status conditions by Kubernetes conventions. Pure.

`lastTransitionTime` moves only when a condition's status flips: re-asserting the same status
(on every resume or re-evaluation) must not reset how long the state has held.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from moonlease_operator.api import Condition, ConditionStatus


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
