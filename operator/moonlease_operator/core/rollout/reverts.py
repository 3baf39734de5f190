"""Another writer reverting what the operator wrote (a GitOps tool): the reverts counted on
every reconcile (`core.conflicts`), a target backing off left out of the plan, the master's
writes held, and the ConflictingWriter condition."""

from __future__ import annotations

import dataclasses
from typing import Any

from moonlease_operator.api import ConditionStatus, ConditionType, Reason, StagePhase
from moonlease_operator.core.conditions import set_condition
from moonlease_operator.core.conflicts import Revert, field_path, last_writer, track_reverts
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.fleet import Fleet, Member
from moonlease_operator.core.rollout.common import join
from moonlease_operator.core.rollout.context import PlanContext
from moonlease_operator.core.slots import differing_slots
from moonlease_operator.core.workload_args import find_container


def track_conflicts(ctx: PlanContext) -> tuple[PlanContext, tuple[EventNote, ...]]:
    """Count the workloads found reverted since the operator wrote them; the context returned
    has a target backing off left out (reported, the rest carries on) and the master's writes
    held (`master_held`)."""
    prev = ctx.previous
    reverted: list[Revert] = []
    if prev.revision is not None and prev.desired_config_hash == ctx.desired_hash:
        written = (StagePhase.PROGRESSING, StagePhase.SUCCEEDED, StagePhase.SKIPPED)
        refused = {(t.kind.value, t.name) for t in prev.targets if t.write_error}
        for member in ctx.fleet.members:
            stage = prev.stage(member.stage)
            if member.obj is None or stage is None or stage.phase not in written or member.key in refused \
                    or ctx.in_sync(member):
                continue
            reverted.append(_revert_of(ctx, member))
    decision = track_reverts(prev.conflicts, reverted, now=ctx.now, settings=ctx.conflict_settings)
    notes = [EventNote("Warning", Reason.CONFLICTING_WRITER.value, decision.held[(record.kind, record.name)])
             for record in decision.started]
    notes.extend(EventNote("Normal", Reason.CONFLICTING_WRITER.value,
                           f"{record.kind}/{record.name}: the backoff is over; writing it once more"
                           f" ({record.field} was reverted by"
                           f" {record.manager or 'a writer the API server does not name'})")
                 for record in decision.retried)
    ctx = dataclasses.replace(ctx, conflicts=decision)
    held = {m.key: m for m in ctx.fleet.members if m.key in decision.held}
    if not held:
        return ctx, tuple(notes)
    master = ctx.fleet.master.key
    master_held = decision.held[master] if master in held else None
    left_out = {key: (member, f"{Reason.CONFLICTING_WRITER.value}: {decision.held[key]}")
                for key, member in held.items() if key != master}
    fleet = Fleet(tuple(m for m in ctx.fleet.members if m.key not in left_out), ctx.fleet.missing,
                  ctx.fleet.unmatched)
    return dataclasses.replace(ctx, master_held=master_held, excluded={**ctx.excluded, **left_out},
                               fleet=fleet), tuple(notes)


def _revert_of(ctx: PlanContext, member: Member) -> Revert:
    """The first field found reverted in `member` (or its settings ConfigMap), and who wrote it."""
    for change in ctx.pending(ctx.apply_changes(member)):
        obj = ctx.object(change)
        slots = differing_slots(obj, change)
        place = change.place if change.kind == "ConfigMap" else \
            (find_container(obj, change.place) or {}).get("name", change.place)
        path = field_path(change.kind, place, slots[0] if slots else "annotation")
        if change.kind == "ConfigMap":
            path = f"ConfigMap/{change.name} {path}"
        return Revert(member.kind, member.name, path, last_writer(obj))
    raise AssertionError("a member out of sync has a pending change")


def conflict_condition(ctx: PlanContext, conditions: list[Any]) -> list[Any]:
    """ConflictingWriter: True while an object is left alone because another writer keeps
    reverting it, False once none is; absent for a policy that never met one."""
    kind = ConditionType.CONFLICTING_WRITER.value
    held = list(ctx.conflicts.held.values())
    if held:
        return set_condition(conditions, type_=kind, status=ConditionStatus.TRUE,
                             reason=Reason.CONFLICTING_WRITER.value, message=join(held),
                             generation=ctx.policy.generation, now=ctx.now)
    if not any(c.type == kind for c in conditions):
        return conditions
    return set_condition(conditions, type_=kind, status=ConditionStatus.FALSE,
                         reason=Reason.NO_CONFLICTING_WRITER.value,
                         message="No other writer reverts what the operator writes",
                         generation=ctx.policy.generation, now=ctx.now)
