"""What every step of the planner shares: the outcome of a step, the stage groupings it tests
against, and the wording helpers that keep condition messages bounded."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from moonlease_operator.api import ConditionStatus, ConditionType, Phase, Reason, StageName, StagePhase
from moonlease_operator.core.fleet import Member
from moonlease_operator.core.health import WorkloadHealth

MAX_LISTED = 5  # problems named in one condition message

DONE = (StagePhase.SUCCEEDED, StagePhase.SKIPPED)
UNWINDING = (StagePhase.FAILED, StagePhase.ROLLING_BACK, StagePhase.ROLLED_BACK, StagePhase.ROLLBACK_FAILED)
WARNING_STAGES = (StagePhase.FAILED, StagePhase.ROLLING_BACK, StagePhase.ROLLBACK_FAILED)
AT_REST = (Phase.READY, Phase.ANALYZING, Phase.AWAITING_DECISION)  # drift here starts a new attempt


@dataclass(frozen=True)
class Outcome:
    """Where one reconcile leaves the policy: its phase, the stage it is at, and why."""

    phase: Phase
    stage: StageName | None
    reason: Reason
    message: str


_CONDITION_ORDER = {t.value: i for i, t in enumerate(
    (ConditionType.READY, ConditionType.PROGRESSING, ConditionType.DEGRADED, ConditionType.INVALID,
     ConditionType.AB_TEST_CONCLUDED))}


def ordered(conditions: Sequence[Any]) -> list[Any]:
    """Conditions in a fixed order (Ready first), so that re-planning writes the same status."""
    return sorted(conditions, key=lambda c: _CONDITION_ORDER.get(c.type, len(_CONDITION_ORDER)))


def flag(value: bool) -> ConditionStatus:
    return ConditionStatus.TRUE if value else ConditionStatus.FALSE


def join(lines: Sequence[str]) -> str:
    """At most `MAX_LISTED` lines, then how many more: a message stays readable at any scale."""
    shown = "; ".join(lines[:MAX_LISTED])
    return shown + (f"; and {len(lines) - MAX_LISTED} more" if len(lines) > MAX_LISTED else "")


def describe_health(items: Sequence[tuple[Member, WorkloadHealth]]) -> str:
    return join([f"{m.kind}/{m.name}: {h.message}" for m, h in items])


def failure_of(message: str) -> str:
    """A failed stage's message without what the rollback appended to it."""
    for suffix in ("; rolling back", "; rolled back", "; rollback did not complete", "; rollback waits for approval"):
        message = message.split(suffix)[0]
    return message


def ts(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
