"""Deleting the policy: every object carrying its label gets its state from before the policy;
the master (and its file) follows `spec.master.onDelete`, announced first and approved first
when restoring it restarts it."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moonlease_operator.api import (
    ConditionStatus,
    ConditionType,
    MasterDeletionPolicy,
    Phase,
    PolicySpec,
    PolicySpecError,
    PolicyStatus,
    Reason,
)
from moonlease_operator.core.changes import ChangeAction, WorkloadChange
from moonlease_operator.core.conditions import set_condition
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.master_identity import declared_master, is_master_object
from moonlease_operator.core.master_restart import MasterRestart, RestartDirection, build_master_restart
from moonlease_operator.core.rollout.common import join, ordered
from moonlease_operator.core.rollout.inputs import PolicyRef
from moonlease_operator.core.settings import build_master_settings
from moonlease_operator.core.slots import build_update, describe_update


@dataclass(frozen=True)
class ReleasePlan:
    """What deleting the policy does: restore what it changed (the master per
    `spec.master.onDelete`), announced first; `pending_approval` is set while restoring the
    master waits for approval (the handler keeps the finalizer and retries)."""

    events: tuple[EventNote, ...]
    changes: tuple[WorkloadChange, ...]
    pending_approval: str | None = None
    status: PolicyStatus | None = None
    """The status to write (only while waiting for approval: pendingApproval and the phase)."""


def plan_release(*, policy: PolicyRef, spec: PolicySpec | PolicySpecError, previous: PolicyStatus,
                 managed: Sequence[Mapping[str, Any]], now: datetime.datetime) -> ReleasePlan:
    """Give back every object carrying this policy's label.

    Targets get their state from before the policy, all at once: each workload's own rolling
    update paces its restart (maxUnavailable holds), and a deletion is an explicit request to
    undo. The master (and its ConfigMap) follow `spec.master.onDelete`: `keep` drops only our
    bookkeeping, so nothing restarts; `restore` brings its settings back, which restarts it and
    empties the store: announced, and approved first when `requireApprovalForRestart`.
    """
    declared = declared_master(spec, previous)
    restore_master = not isinstance(spec, PolicySpecError) and spec.master.on_delete is MasterDeletionPolicy.RESTORE
    needs_approval = isinstance(spec, PolicySpecError) or spec.master.require_approval_for_restart
    settings_hash = "" if isinstance(spec, PolicySpecError) else build_master_settings(spec.master).config_hash
    changes: list[WorkloadChange] = []
    held: list[WorkloadChange] = []
    restart: MasterRestart | None = None
    for obj in sorted(managed, key=lambda o: (str(o.get("kind")), str((o.get("metadata") or {}).get("name")))):
        meta = obj.get("metadata") or {}
        ref = (str(obj.get("kind")), str(meta.get("name")))
        is_master = is_master_object(obj, declared)
        action = ChangeAction.FORGET if is_master and not restore_master else ChangeAction.RELEASE
        change = WorkloadChange(kind=ref[0], name=ref[1], action=action, policy=policy.name)
        new = build_update(obj, change)
        if new is None:
            continue
        if is_master and action is ChangeAction.RELEASE:
            held.append(change)
            if ref[0] != "ConfigMap" and (new.get("spec") or {}).get("template") != (obj.get("spec") or {}).get("template"):
                restart = build_master_restart(f"{ref[0]}/{ref[1]}", RestartDirection.RESTORE, previous.revision or 0,
                                               settings_hash, describe_update(obj, change))
            continue
        changes.append(change)
    events: list[EventNote] = []
    pending = None
    if restart is not None and needs_approval and not restart.approved_by(policy.annotations):
        pending = restart.approval_key
        if previous.pending_approval != pending:
            events.append(EventNote("Normal", Reason.AWAITING_APPROVAL.value,
                                    f"Policy deleted (master.onDelete: restore): {restart.approval_request(policy.name)}"))
    else:
        changes = held + changes  # the ConfigMap before the master it restarts
        if restart is not None:
            events.append(restart.note())
    restored = [c for c in changes if c.action is ChangeAction.RELEASE]
    if restored:
        events.append(EventNote("Normal", Reason.RESTORED.value,
                                "Policy deleted: restoring " + join([f"{c.kind}/{c.name}" for c in restored])
                                + " to their configuration before the policy"))
    if any(c.action is ChangeAction.FORGET for c in changes):
        why = ("the spec is invalid, so master.onDelete cannot be read: nothing restarts"
               if isinstance(spec, PolicySpecError) else "master.onDelete: keep")
        events.append(EventNote("Normal", Reason.RELEASED.value,
                                f"Policy deleted: the master keeps its settings ({why})"))
    status = None
    if pending is not None and previous.pending_approval != pending:
        # Not Ready: the targets are being given back and the master waits (no false Ready).
        assert restart is not None
        message = f"Policy deleted: the targets are restored; {restart.approval_request(policy.name)}"
        conditions = list(previous.conditions)
        for type_ in (ConditionType.READY, ConditionType.PROGRESSING):
            conditions = set_condition(conditions, type_=type_.value, status=ConditionStatus.FALSE,
                                       reason=Reason.AWAITING_APPROVAL.value, message=message,
                                       generation=policy.generation, now=now)
        status = previous.model_copy(update={"pending_approval": pending, "phase": Phase.AWAITING_APPROVAL,
                                             "conditions": ordered(conditions)})
    return ReleasePlan(events=tuple(events), changes=tuple(changes), pending_approval=pending, status=status)
