"""What the policy changed but no longer covers (a target no longer selected, a master or its
file renamed in the spec) gets its original back; a master no longer covered is still the store
the engines use, so it follows `master.onDelete` and waits for approval when restoring it
restarts it."""

from __future__ import annotations

from moonlease_operator.api import MasterDeletionPolicy, Phase, Reason
from moonlease_operator.core.changes import ChangeAction, WorkloadChange
from moonlease_operator.core.connector_delivery import settings_config_map_name
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.fleet import managed_keys
from moonlease_operator.core.master_identity import declared_master, is_master_object
from moonlease_operator.core.master_restart import MasterRestart, RestartDirection, build_master_restart
from moonlease_operator.core.rollout.common import Outcome
from moonlease_operator.core.rollout.context import PlanContext, Progress
from moonlease_operator.core.slots import (
    build_update,
    describe_update,
    managed_by,
    needs_update,
    policy_label_value,
    template_config_hash,
)


def release_orphans(ctx: PlanContext, progress: Progress) -> tuple[Progress, MasterRestart | None]:
    """Workloads this policy changed but no longer covers get their original back. A master
    no longer covered (`spec.master.name` renamed) keeps its settings (`master.onDelete:
    keep`), or restoring it restarts it like any other master restart, approved first when
    `requireApprovalForRestart`: then it is returned, held, and restored once approved."""
    declared = declared_master(ctx.spec, ctx.previous)
    changes: list[WorkloadChange] = []
    notes: list[EventNote] = []
    orphan_restart: MasterRestart | None = None
    for key in managed_keys(policy_label_value(ctx.policy.name), ctx.observed.workloads, ctx.observed.index):
        obj = ctx.observed.workloads[key]
        if key in ctx.fleet.keys or key in ctx.held or key in ctx.excluded:
            continue
        master = is_master_object(obj, declared)
        keep = master and ctx.spec.master.on_delete is MasterDeletionPolicy.KEEP
        change = WorkloadChange(kind=key[0], name=key[1], action=ChangeAction.FORGET if keep else
                                ChangeAction.RELEASE, policy=ctx.policy.name)
        if not needs_update(obj, change):
            continue
        if keep:
            changes.append(change)
            notes.append(EventNote("Normal", Reason.RELEASED.value,
                                   f"{key[0]}/{key[1]} is no longer the master: it keeps its settings"
                                   " (master.onDelete: keep), nothing restarts"))
            continue
        new = build_update(obj, change) or obj
        if master and (new.get("spec") or {}).get("template") != (obj.get("spec") or {}).get("template"):
            restart = build_master_restart(f"{key[0]}/{key[1]}", RestartDirection.RESTORE, ctx.revision,
                                           template_config_hash(obj) or "", describe_update(obj, change))
            if ctx.spec.master.require_approval_for_restart and not restart.approved_by(ctx.policy.annotations):
                orphan_restart = restart
                continue
            notes.append(restart.note())
        changes.append(change)
        notes.append(EventNote("Normal", Reason.RELEASED.value,
                               f"{key[0]}/{key[1]} is no longer covered: restoring its original configuration"))
    # The ConfigMaps before the workloads they configure (a master restored reads its file).
    file_changes, file_notes = _release_orphan_config_maps(ctx, declared, orphan_restart)
    return progress.changing([*file_changes, *changes]).noted(*notes, *file_notes), orphan_restart


def _release_orphan_config_maps(ctx: PlanContext, declared: frozenset[tuple[str, str]],
                                orphan_restart: MasterRestart | None
                                ) -> tuple[list[WorkloadChange], list[EventNote]]:
    """ConfigMaps this policy labelled that it no longer uses: a master file no longer named
    (`spec.master.configMap` or `spec.master.name` renamed) follows `master.onDelete` like its
    master — kept as it is and forgotten, or given back its content from before the policy,
    with the master's own restore when that waits for approval; a settings file of a workload
    no longer covered gets its content from before the policy, like its workload."""
    label = policy_label_value(ctx.policy.name)
    in_use = {settings_config_map_name(key[1]) for key in (*ctx.fleet.keys, *ctx.held, *ctx.excluded)}
    if ctx.master.config_map is not None:
        in_use.add(ctx.master.config_map.name)
    changes, notes = [], []
    for name, obj in sorted(ctx.observed.config_maps.items()):
        if name in in_use or managed_by(obj) != label:
            continue
        master = is_master_object(obj, declared)
        keep = master and ctx.spec.master.on_delete is MasterDeletionPolicy.KEEP
        if master and not keep and orphan_restart is not None:
            continue  # given back with its master, once that restore is approved
        change = WorkloadChange(kind="ConfigMap", name=name, action=ChangeAction.FORGET if keep else
                                ChangeAction.RELEASE, policy=ctx.policy.name)
        if not needs_update(obj, change):
            continue
        changes.append(change)
        notes.append(EventNote("Normal", Reason.RELEASED.value,
                               f"ConfigMap/{name} is no longer used by the policy: "
                               + ("it keeps its content (master.onDelete: keep)" if keep else
                                  "restoring its content from before the policy")))
    return changes, notes


def hold_orphan_restart(ctx: PlanContext, progress: Progress, restart: MasterRestart | None,
                        outcome: Outcome) -> tuple[Outcome, Progress]:
    """A master no longer covered waits for approval before it is restored: the policy is
    not Ready meanwhile (its old master would restart later, emptying the store)."""
    if restart is None or progress.pending_approval is not None or outcome.phase is not Phase.READY:
        return outcome, progress
    return (Outcome(Phase.AWAITING_APPROVAL, outcome.stage, Reason.AWAITING_APPROVAL,
                    f"{restart.workload} is no longer the policy's master (master.onDelete: restore):"
                    f" {restart.approval_request(ctx.policy.name)}"),
            progress.but(pending_approval=restart.approval_key))
