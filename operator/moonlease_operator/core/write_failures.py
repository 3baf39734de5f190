"""Writes the API server refused: shown on the workload, in a condition and an event. Pure.

The handler applies the planner's changes after writing the status; a PATCH answered with a
4xx (other than 404 and 409, which the adapter handles) is a `WriteFailure`. `record_write_failures`
puts it into the status just written (`status.targets[].writeError`, the `WriteFailed`
condition) with a warning event, at once; the next plan reads it back from the status and fails
the stage with the refusal as the reason (instead of a timeout much later), and clears it once
the change is written.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

from moonlease_operator.api import Condition, ConditionStatus, ConditionType, PolicyStatus, Reason, StageName, TargetStatus
from moonlease_operator.core.conditions import set_condition
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.target_summary import DEFAULT_LISTED_TARGETS, build_target_summary


@dataclass(frozen=True)
class WriteFailure:
    """One change the API server refused."""

    kind: str
    name: str
    status: int
    reason: str
    message: str

    def describe(self) -> str:
        return f"PATCH {self.kind}/{self.name} refused: {self.status} {self.reason}: {self.message}"[:4096]


def record_write_failures(status: PolicyStatus, failures: Sequence[WriteFailure], *, generation: int | None,
                          now: datetime.datetime, all_targets: Sequence[TargetStatus] | None = None,
                          listed_targets: int = DEFAULT_LISTED_TARGETS) -> tuple[PolicyStatus, list[EventNote]]:
    """`status` with each failure on its workload (a ConfigMap's on the master) and the
    `WriteFailed` condition set, plus one warning event per failure. `all_targets`: every
    target of the plan (the status lists only some, `core.target_summary`); the listing is
    made again from them, refused writes first."""
    every = list(all_targets) if all_targets else list(status.targets)
    errors: dict[tuple[str, str], str] = {}
    for failure in failures:
        key = (failure.kind, failure.name)
        if failure.kind == "ConfigMap":
            master = next((t for t in every if t.role is StageName.MASTER), None)
            key = (master.kind.value, master.name) if master is not None else key
        errors[key] = "; ".join(filter(None, (errors.get(key), failure.describe())))[:4096]
    targets = [t.model_copy(update={"write_error": errors[(t.kind.value, t.name)]})
               if (t.kind.value, t.name) in errors else t for t in every]
    conditions = set_write_condition(status.conditions, targets, generation=generation, now=now)
    notes = [EventNote("Warning", Reason.WRITE_REFUSED.value, f.describe()) for f in failures]
    if not all_targets:  # a plan that did not look at the targets: mark the listed ones
        return status.model_copy(update={"targets": targets, "conditions": conditions}), notes
    summary = build_target_summary(targets, listed_targets)
    return status.model_copy(update={"targets": list(summary.listed), "target_counts": list(summary.counts),
                                     "targets_total": summary.total, "targets_omitted": summary.omitted,
                                     "conditions": conditions}), notes


def set_write_condition(conditions: Sequence[Condition], targets: Sequence[TargetStatus], *,
                        generation: int | None, now: datetime.datetime) -> list[Condition]:
    """`WriteFailed`: True while a workload's change is refused, False once written again;
    absent for a policy whose writes never failed."""
    kind = ConditionType.WRITE_FAILED.value
    refused = [f"{t.kind.value}/{t.name}: {t.write_error}" for t in targets if t.write_error]
    if refused:
        return set_condition(conditions, type_=kind, status=ConditionStatus.TRUE,
                             reason=Reason.WRITE_REFUSED.value, message="; ".join(refused)[:32768],
                             generation=generation, now=now)
    if not any(c.type == kind for c in conditions):
        return list(conditions)
    return set_condition(conditions, type_=kind, status=ConditionStatus.FALSE,
                         reason=Reason.AS_EXPECTED.value, message="Every change was written",
                         generation=generation, now=now)
