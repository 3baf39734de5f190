"""The frozen facts one reconcile plans from (`PlanContext`: the admitted policy, this attempt's
revision, the workloads' health, who is held or left out), the questions the steps ask about a
member (is it in sync, what would bring it there, what would restore it), and the `Progress`
the steps hand on to each other: stages, changes and events so far, each step returning a new
one. Nothing here is written in place."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moonlease_settings.settings_file import SETTINGS_FILE_NAME
from moonlease_operator.api import ABTestStatus, StageName, StagePhase, StageStatus
from moonlease_operator.core.changes import ChangeAction, WorkloadChange
from moonlease_operator.core.config_hash import build_config_hash
from moonlease_operator.core.conflicts import ConflictDecision, ConflictSettings
from moonlease_operator.core.connector_delivery import (
    adoption_hash,
    build_settings_file_desired,
    settings_config_map_name,
    settings_config_map_stub,
)
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.fleet import Member, WorkloadKey
from moonlease_operator.core.health import WorkloadHealth
from moonlease_operator.core.master_restart import MasterRestart, RestartDirection, build_master_restart
from moonlease_operator.core.pod_set import PodSet
from moonlease_operator.core.rollout.admission import Admitted
from moonlease_operator.core.rollout.common import UNWINDING, WARNING_STAGES, failure_of
from moonlease_operator.core.settings import build_config_map_desired, build_master_desired, build_target_desired
from moonlease_operator.core.slots import (
    ORIGINAL_ANNOTATION,
    describe_update,
    needs_update,
    rollback_revision,
)
from moonlease_operator.core.target_summary import DEFAULT_LISTED_TARGETS
from moonlease_operator.core.verbs import VerbDecision


class _Memo:
    """Answers computed once per plan: the observed objects do not change while it plans, and
    the same member is asked about several times (the pods indexed once, each member's sync)."""

    def __init__(self) -> None:
        self.pod_set: PodSet | None = None
        self.in_sync: dict[WorkloadKey, bool] = {}
        self.rollback: dict[tuple[int, WorkloadKey], tuple[WorkloadChange, ...]] = {}


@dataclass(frozen=True)
class PlanContext(Admitted):
    """What one reconcile plans from, fixed before its first stage is looked at."""

    desired_hash: str = ""
    revision: int = 0
    """This attempt."""
    applied_revision: int | None = None
    """The last attempt that completed (as the status said before this reconcile)."""
    held: frozenset[WorkloadKey] = frozenset()
    """The control while an A/B test runs: covered, not changed."""
    master_held: str | None = None
    """Why the master's writes wait out a conflicting writer's backoff (None: they do not)."""
    conflicts: ConflictDecision = field(default_factory=lambda: ConflictDecision(records=()))
    health: Mapping[WorkloadKey, WorkloadHealth] = field(default_factory=dict)
    verb: VerbDecision | None = None
    """A verb annotation handled in this reconcile."""
    approval: VerbDecision | None = None
    """An approval annotation handled in this reconcile."""
    paused_at: datetime.datetime | None = None
    """Held by the pause verb."""
    listed_targets: int = DEFAULT_LISTED_TARGETS
    conflict_settings: ConflictSettings = field(default_factory=ConflictSettings)
    memo: _Memo = field(default_factory=_Memo, compare=False, repr=False)

    @property
    def order(self) -> tuple[StageName, ...]:
        return tuple(self.spec.rollout.stages)

    def pods(self) -> PodSet | None:
        """The observed pods, indexed once per plan (None: not fetched): each target's pods
        are found through the index, not by scanning every pod of the namespace."""
        if self.memo.pod_set is None and self.observed.pods is not None:
            self.memo.pod_set = PodSet(self.observed.pods, self.observed.pod_index)
        return self.memo.pod_set

    def apply_changes(self, member: Member) -> list[WorkloadChange]:
        """The changes that bring `member` to the policy (a master with a ConfigMap has two: the
        file first, then the pod template's hash annotation that restarts it)."""
        common: dict[str, Any] = {"policy": self.policy.name, "revision": self.revision,
                                  "applied_revision": self.applied_revision, "action": ChangeAction.APPLY}
        if member.stage is not StageName.MASTER:
            # The settings file first (created if need be), then the adoption of the workload,
            # which changes its pod template once and never again for a settings change.
            config_map = settings_config_map_name(member.name)
            namespace = (member.obj or {}).get("metadata", {}).get("namespace")
            file_change = WorkloadChange(kind="ConfigMap", name=config_map, place=SETTINGS_FILE_NAME,
                                         desired=build_settings_file_desired(self.connector.file),
                                         create_from=settings_config_map_stub(config_map, namespace), **common)
            desired = build_target_desired(member.obj or {}, member.container, config_map)
            return [file_change, WorkloadChange(kind=member.kind, name=member.name, place=member.container,
                                                desired=desired, config_hash=adoption_hash(config_map), **common)]
        if self.master.config_map is None:
            return [WorkloadChange(kind=member.kind, name=member.name, place=member.container,
                                   desired=build_master_desired(self.master), config_hash=self.master.config_hash,
                                   **common)]
        ref = self.master.config_map
        file_change = WorkloadChange(kind="ConfigMap", name=ref.name, place=ref.key,
                                     desired=build_config_map_desired(self.master), **common)
        current = self.observed.config_maps.get(ref.name) or {}
        owned = needs_update(current, file_change) or \
            ORIGINAL_ANNOTATION in ((current.get("metadata") or {}).get("annotations") or {})
        restart = WorkloadChange(kind=member.kind, name=member.name, place=member.container, desired={},
                                 config_hash=self.master.config_hash, require_annotation=owned, **common)
        return [file_change, restart]

    def master_restart(self, direction: RestartDirection, settings_hash: str,
                       lines: Sequence[str]) -> MasterRestart:
        master = self.fleet.master
        return build_master_restart(f"{master.kind}/{master.name}", direction, self.revision, settings_hash, lines)

    def forward_key(self, lines: Sequence[str]) -> str:
        """What a forward master restart's approval is keyed to: the settings, the flag changes
        from what the master runs now and its generation — so an approval given for the rollout
        never lets a later repair of the same attempt through (a stage reopened by drift)."""
        master = self.fleet.master.obj or {}
        return build_config_hash({"settings": self.master.config_hash, "changes": sorted(lines),
                                  "generation": (master.get("metadata") or {}).get("generation")})

    def describe(self, changes: Sequence[WorkloadChange]) -> list[str]:
        """Human lines for what `changes` alter (`--eviction_ratio: 0.05 -> 0.1`)."""
        return [line for c in changes for line in describe_update(self.object(c), c)]

    def object(self, change: WorkloadChange) -> Mapping[str, Any]:
        """The observed object `change` is about (a ConfigMap not there yet: the one it creates)."""
        if change.kind == "ConfigMap":
            return self.observed.config_maps.get(change.name) or change.create_from or {}
        return self.observed.workloads.get(change.ref) or {}

    def pending(self, changes: Sequence[WorkloadChange]) -> list[WorkloadChange]:
        return [c for c in changes if needs_update(self.object(c), c)]

    def in_sync(self, member: Member) -> bool:
        # Asked several times per member per plan; the answer does not depend on the revision.
        if member.key not in self.memo.in_sync:
            self.memo.in_sync[member.key] = not self.pending(self.apply_changes(member))
        return self.memo.in_sync[member.key]

    def rollback_pending(self, member: Member) -> tuple[WorkloadChange, ...]:
        """What restoring `member` still has to write (computed once per plan, as `in_sync`)."""
        key = (self.revision, member.key)
        if key not in self.memo.rollback:
            self.memo.rollback[key] = tuple(self.pending(self.rollback_changes(member)))
        return self.memo.rollback[key]

    def rollback_changes(self, member: Member) -> list[WorkloadChange]:
        changes = [WorkloadChange(kind=member.kind, name=member.name, action=ChangeAction.ROLLBACK,
                                  policy=self.policy.name, revision=self.revision)]
        config_map = self.config_map_of(member)
        if config_map is not None:
            changes.insert(0, WorkloadChange(kind="ConfigMap", name=config_map, action=ChangeAction.ROLLBACK,
                                             policy=self.policy.name, revision=self.revision))
        return changes

    def config_map_of(self, member: Member) -> str | None:
        """The ConfigMap a member's settings live in: the master's file, or a target's settings."""
        if member.stage is StageName.MASTER:
            return None if self.master.config_map is None else self.master.config_map.name
        return settings_config_map_name(member.name)

    def changed_in_attempt(self, member: Member) -> bool:
        # A live settings change touches only the ConfigMap: it counts as changing the workload.
        config_map = self.config_map_of(member)
        return rollback_revision(member.obj or {}) == self.revision or (
            config_map is not None and member.stage is not StageName.MASTER
            and rollback_revision(self.observed.config_maps.get(config_map) or {}) == self.revision)


@dataclass(frozen=True)
class Progress:
    """What the steps of one reconcile decided so far; each step returns a new one."""

    stages: Mapping[StageName, StageStatus]
    changes: tuple[WorkloadChange, ...] = ()
    notes: tuple[EventNote, ...] = ()
    """Events, in the order things happen."""
    failed_stage: StageName | None = None
    pending_approval: str | None = None
    master_kept: str | None = None
    """Why the master was not rolled back with the targets."""
    aborting: bool = False
    """The abort verb failed the attempt in this reconcile."""
    ab: ABTestStatus | None = None
    """The A/B test, with strategy ABTest."""

    def but(self, **changes: Any) -> Progress:
        return dataclasses.replace(self, **changes)

    def noted(self, *notes: EventNote) -> Progress:
        return dataclasses.replace(self, notes=(*self.notes, *notes))

    def changing(self, changes: Sequence[WorkloadChange]) -> Progress:
        return dataclasses.replace(self, changes=(*self.changes, *changes))

    def with_stage(self, name: StageName, stage: StageStatus) -> Progress:
        return dataclasses.replace(self, stages={**self.stages, name: stage})


def set_stage(ctx: PlanContext, progress: Progress, name: StageName, phase: StagePhase, message: str, *,
              started: bool = False, finished: bool = False) -> Progress:
    """Move a stage; every transition is announced by an event, in the order it happens."""
    old = progress.stages[name]
    if phase is not old.phase and phase is not StagePhase.PENDING:
        progress = progress.noted(EventNote("Warning" if phase in WARNING_STAGES else "Normal", f"Stage{phase.value}",
                                            f"Stage {name.value}: {message}"))
    return progress.with_stage(name, old.model_copy(update={
        "phase": phase, "message": message,
        "started_at": ctx.now if started else old.started_at,
        "finished_at": ctx.now if finished else (None if started else old.finished_at),
    }))


def write_error(ctx: PlanContext, progress: Progress, member: Member) -> str | None:
    """The refusal recorded for `member`'s last write, while that write is still to be done."""
    previous = next((t for t in ctx.previous.targets if (t.kind.value, t.name) == member.key), None)
    if previous is None or not previous.write_error:
        return None
    stage = progress.stages.get(member.stage)
    rolling_back = stage is not None and stage.phase in UNWINDING
    pending = ctx.rollback_pending(member) if rolling_back else not ctx.in_sync(member)
    return previous.write_error if pending else None


def rolled_back_message(progress: Progress, name: StageName, what: str) -> str:
    if name is progress.failed_stage:
        return f"{failure_of(progress.stages[name].message)}; {what}"
    return what


def past_deadline(ctx: PlanContext, stage: StageStatus) -> bool:
    """Whether `stage` (Progressing or Rolling back) has run past `stageTimeoutSeconds`;
    asked only about a stage that still waits for something."""
    started = stage.started_at or ctx.now
    return ctx.now - started > datetime.timedelta(seconds=ctx.spec.rollout.stage_timeout_seconds)
