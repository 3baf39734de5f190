"""The rollout state machine: given the policy, what the cluster shows and the last status,
what to change now, what the status becomes, and which events say so. Pure.

The kopf timer (`handlers.py`) calls `plan_fetch` (what to read), then `plan_reconcile`, then
writes the status, posts the events and applies the changes — in that order, so that the status
and an event announce every change (a master restart above all) before it happens. State lives in
the policy status (stages, revision) and in the workloads' own annotations (rollback snapshots),
so a restarted operator resumes where the last one stopped, and re-planning an applied policy
yields the same status and no changes: no writes.

A rollout attempt (`status.revision`) walks `spec.rollout.stages` in order. A stage whose
workloads already hold the desired configuration is Skipped (nothing restarts: the master only
restarts when its settings change); otherwise it is patched (Progressing) and Succeeds once every
workload's controller reports the rollout complete, its pods run the new configuration hash and,
for vLLM workloads, every Ready pod's running connector reports the settings hash the policy
expects (`core.connector_delivery`: connector settings travel in a ConfigMap per workload and
apply live; only adopting a workload changes its pod template).
A stage that times out, or whose pods fail, Fails; with `onFailure: rollback` every stage the
attempt changed is then restored, last stage first, each through its workload's own rolling
update (so `maxUnavailable` holds; Dynamo #13620), and the policy is Degraded until its spec
changes. `onFailure: halt` leaves everything where it stopped.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moonlease_operator.api import (
    AB_DECISION_ANNOTATION,
    APPROVE_MASTER_RESTART_ANNOTATION,
    ABTestPhase,
    ABTestStatus,
    ConditionStatus,
    ConditionType,
    FailurePolicy,
    MasterDeletionPolicy,
    Phase,
    PolicySpec,
    PolicySpecError,
    PolicyStatus,
    Reason,
    StageName,
    StagePhase,
    StageStatus,
    TargetPhase,
    TargetStatus,
    VERB_ANNOTATION,
    WorkloadKind,
    parse_spec,
    read_spec,
)
from moonlease_operator.core.ab_plan import (
    ABDesign,
    ABReading,
    build_ab_design,
    apply_decision_annotation,
    begin_test,
    decision_hint,
    evaluate_arm_mix,
    evaluate_arm_roles,
    evaluate_arm_selectors,
    evaluate_custom_query_counters,
    evaluate_custom_query_windows,
    measurement_due,
    record_measurement,
    start_measuring,
)
from moonlease_operator.core.compatibility import VersionSource, container_image, evaluate_compatibility
from moonlease_operator.core.conditions import set_condition
from moonlease_operator.core.conflicts import (
    ConflictDecision,
    ConflictSettings,
    Revert,
    field_path,
    last_writer,
    track_reverts,
)
from moonlease_operator.core.config_hash import build_config_hash
from moonlease_operator.core.changes import ChangeAction, WorkloadChange
from moonlease_connector.settings import SETTINGS_FILE_NAME
from moonlease_operator.core.connector_delivery import (
    SettingsReport,
    adoption_hash,
    build_settings_file_desired,
    evaluate_pod_settings,
    expected_settings_hash,
    file_settings_hash,
    refused_expected,
    settings_config_map_name,
    settings_config_map_stub,
    settings_file_text,
    settings_pods,
    template_reads_settings_file,
    unmounted_pod_problem,
)
from moonlease_operator.core.master_identity import declared_master, is_master_object
from moonlease_operator.core.master_restart import MasterRestart, RestartDirection, build_master_restart
from moonlease_operator.core.load_failure_policy import load_failure_warning, set_load_failure_condition
from moonlease_operator.core.manageability import evaluate_config_map, evaluate_master, evaluate_target
from moonlease_operator.core.settings import (
    ConnectorSettings,
    MasterSettings,
    build_config_map_desired,
    build_connector_settings,
    build_master_desired,
    build_master_settings,
    build_target_desired,
)
from moonlease_operator.core.target_summary import DEFAULT_LISTED_TARGETS, build_target_summary
from moonlease_operator.core.workload_args import find_container
from moonlease_operator.core.write_failures import set_write_condition
from moonlease_operator.core.slots import (
    ORIGINAL_ANNOTATION,
    build_update,
    describe_update,
    differing_slots,
    needs_update,
    managed_by,
    policy_label_value,
    rollback_revision,
    template_config_hash,
)
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.fleet import (
    Claim,
    Fleet,
    Member,
    WorkloadIndex,
    WorkloadKey,
    build_claim,
    evaluate_claims,
    managed_keys,
    resolve_fleet,
)
from moonlease_operator.core.health import (
    Health,
    WorkloadHealth,
    current_ready_pods,
    evaluate_health,
    evaluate_master_pod,
    restored_master_flags,
)
from moonlease_operator.core.label_index import LabelIndex
from moonlease_operator.core.pod_set import PodSet
from moonlease_operator.core.url_allowlist import evaluate_prometheus_url
from moonlease_operator.core.verbs import (
    VerbDecision,
    VerbEffect,
    VerbSituation,
    plan_approval,
    plan_verb,
    read_new_value,
)

MAX_LISTED = 5  # problems named in one condition message

_DONE = (StagePhase.SUCCEEDED, StagePhase.SKIPPED)
_UNWINDING = (StagePhase.FAILED, StagePhase.ROLLING_BACK, StagePhase.ROLLED_BACK, StagePhase.ROLLBACK_FAILED)
_WARNING_STAGES = (StagePhase.FAILED, StagePhase.ROLLING_BACK, StagePhase.ROLLBACK_FAILED)
_AT_REST = (Phase.READY, Phase.ANALYZING, Phase.AWAITING_DECISION)  # drift here starts a new attempt


# --------------------------------------------------------------------------------------------
# Inputs and outputs
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PolicyRef:
    """The policy's identity and metadata, as the planner needs them."""

    name: str
    namespace: str
    generation: int | None
    created: str
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FetchPlan:
    """What to read before planning: ConfigMaps by name, and the namespace's pods (only while a
    stage or rollback is verifying, so that a policy at rest costs no pod listing)."""

    config_maps: tuple[str, ...]
    pods: bool
    ab_due: bool = False
    """An A/B test is measuring and its interval has passed: read the arms' metrics."""
    spec: PolicySpec | None = None
    """The spec whose vLLM workloads' settings ConfigMaps to read, by name, once the workloads
    are listed (`settings_config_maps_to_read`); None: none (an invalid spec plans nothing)."""
    policy_label: str | None = None
    """Read too every (cached) ConfigMap carrying this value of the policy label: a master file
    the policy changed but no longer names (renamed) is given back (`_release_orphans`)."""


@dataclass(frozen=True)
class Observed:
    """What the cluster showed. `workloads` holds every Deployment and StatefulSet of the
    namespace; `policies` every MooncakeLeasePolicy (raw objects, this one included); `pods` is
    None when not fetched."""

    workloads: Mapping[WorkloadKey, Mapping[str, Any]]
    config_maps: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    policies: Sequence[Mapping[str, Any]] = ()
    pods: Sequence[Mapping[str, Any]] | None = None
    ab_reading: ABReading | None = None
    """The arms' metrics, read because `FetchPlan.ab_due` asked for them."""
    settings_reports: Mapping[str, SettingsReport] | None = None
    """Pod name -> what its connector's settings endpoint said; read with the pods."""
    index: WorkloadIndex | None = None
    """The watch caches' label index of `workloads` (`core.label_index`): selecting costs what
    it selects; None: every selector scans `workloads` (same answer)."""
    pod_index: LabelIndex | None = None
    """The pod cache's label index of `pods` (one namespace), if it keeps one: `PodSet` uses it
    when it agrees with `pods`, else indexes them itself (same answer)."""


@dataclass(frozen=True)
class ReconcilePlan:
    """The decision: the status to write, the events to post, then the changes to apply."""

    status: PolicyStatus
    events: tuple[EventNote, ...]
    changes: tuple[WorkloadChange, ...]
    all_targets: tuple[TargetStatus, ...] = ()
    """Every target's state, of which the status lists only those that need attention
    (`core.target_summary`); empty for a plan that did not look at the targets (refused,
    waiting)."""
    listed_targets: int = DEFAULT_LISTED_TARGETS
    """The limit the status was bounded with (for `record_write_failures`)."""


def plan_fetch(spec: PolicySpec | PolicySpecError, previous: PolicyStatus,
               now: datetime.datetime | None = None, policy: str | None = None) -> FetchPlan:
    """What to read for this reconcile (`spec` as `read_spec` returned it; `policy`: its name,
    to read the ConfigMaps it labelled)."""
    if isinstance(spec, PolicySpecError):
        return FetchPlan(config_maps=(), pods=False)
    config_map = spec.master.config_map
    verifying = any(s.phase in (StagePhase.PROGRESSING, StagePhase.ROLLING_BACK) for s in previous.stages)
    ab = spec.rollout.ab_test
    due = now is not None and previous.paused_at is None and measurement_due(previous.ab_test, ab, now)
    scraping = due and ab is not None and ab.prometheus is None
    return FetchPlan(config_maps=() if config_map is None else (config_map.name,), pods=verifying or scraping,
                     ab_due=due, spec=spec, policy_label=None if policy is None else policy_label_value(policy))


def settings_config_maps_to_read(spec: PolicySpec, workloads: Mapping[WorkloadKey, Mapping[str, Any]],
                                 index: WorkloadIndex | None = None) -> tuple[str, ...]:
    """The settings ConfigMaps of the policy's vLLM workloads (`<workload>-moonlease`): read one
    by one by name, so the operator needs `get` on ConfigMaps, never `list` (least privilege)."""
    return tuple(settings_config_map_name(m.name) for m in resolve_fleet(spec, workloads, index).members
                 if m.stage is not StageName.MASTER)


def config_maps_to_restore(spec: PolicySpec | PolicySpecError, workloads: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """The ConfigMaps a deleted policy may have changed, by name (read with `get`; the caller
    keeps those that carry the policy's label): the settings ConfigMap of every workload of the
    namespace (a live settings change labels the ConfigMap, not its workload) and the master's
    file. An invalid spec names no master file: one the policy changed is then left as it is."""
    names = [settings_config_map_name(obj["metadata"]["name"]) for obj in workloads]
    if isinstance(spec, PolicySpec) and spec.master.config_map is not None:
        names.append(spec.master.config_map.name)
    return tuple(dict.fromkeys(names))


# --------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------

def plan_reconcile(*, spec: PolicySpec | PolicySpecError, policy: PolicyRef, previous: PolicyStatus,
                   observed: Observed, now: datetime.datetime,
                   prometheus_allowlist: Sequence[str] | None = None,
                   listed_targets: int = DEFAULT_LISTED_TARGETS,
                   conflicts: ConflictSettings | None = None) -> ReconcilePlan:
    """Decide one reconcile of one policy (see the module docstring); `spec` as `read_spec`
    returned it, read once for the whole reconcile.

    `prometheus_allowlist`: the operator's allowed Prometheus URLs (None: not checked, for
    callers that never fetch). `listed_targets`: how many targets that need attention the
    status lists (`core.target_summary`; the rest are counted). `conflicts`: when to back off
    from another writer that keeps reverting what the operator wrote (`core.conflicts`)."""
    prepared = _prepare(spec=spec, policy=policy, previous=previous, observed=observed, now=now,
                        prometheus_allowlist=prometheus_allowlist)
    if isinstance(prepared, _Planner):
        prepared.listed_targets = listed_targets
        prepared.conflict_settings = conflicts or ConflictSettings()
        return prepared.plan()
    return prepared


def _prepare(*, spec: PolicySpec | PolicySpecError, policy: PolicyRef, previous: PolicyStatus, observed: Observed,
             now: datetime.datetime, prometheus_allowlist: Sequence[str] | None) -> ReconcilePlan | _Planner:
    """The refusals and waits (a finished plan), or the planner of a policy the fleet can run."""
    if isinstance(spec, PolicySpecError):
        return _refused(previous, policy, Reason.INVALID_SPEC, spec.problems, now)
    mismatched = evaluate_arm_roles(spec)
    if mismatched is not None:
        return _refused(previous, policy, Reason.MISMATCHED_ARMS, [mismatched], now)
    for reason, evaluate in ((Reason.OVERLAPPING_WINDOWS, evaluate_custom_query_windows),
                             (Reason.COUNTER_WITHOUT_RATE, evaluate_custom_query_counters),
                             (Reason.IDENTICAL_ARM_SELECTORS, evaluate_arm_selectors)):
        refusal = evaluate(spec)
        if refusal is not None:
            return _refused(previous, policy, reason, [refusal], now)
    ab_source = spec.rollout.ab_test.prometheus if spec.rollout.ab_test is not None else None
    if prometheus_allowlist is not None and ab_source is not None:
        refused = evaluate_prometheus_url(ab_source.url, prometheus_allowlist)
        if refused is not None:
            return _refused(previous, policy, Reason.PROMETHEUS_URL_NOT_ALLOWED, [refused], now)

    # Before the first rollout a problem refuses the whole policy (nothing changes); once it has
    # rolled out, a problem with one target is reported on that target and the rollout,
    # rollback or drift repair goes on for the rest (issue 15). The master is never optional.
    started = previous.revision is not None
    fleet = resolve_fleet(spec, observed.workloads, observed.index)
    if fleet.missing and (not started or fleet.master.obj is None):
        return _waiting_for_workloads(previous, policy, fleet.missing, now)
    claims = evaluate_claims(name=policy.name, created=policy.created, fleet=fleet,
                             others=_other_claims(policy, observed), workloads=observed.workloads)
    master_key = fleet.master.key
    if claims and (not started or master_key in claims):
        return _refused(previous, policy, Reason.CONFLICTING_POLICY, list(claims.values()), now)

    connector = build_connector_settings(spec.connector, spec.master.eviction_high_watermark_ratio)
    master = build_master_settings(spec.master)
    excluded: dict[WorkloadKey, str] = {m.key: "not found" for m in fleet.members if m.obj is None}
    excluded.update(claims)
    members = {m.key: m for m in fleet.members}
    problems: dict[Reason, list[str]] = {}
    for member in fleet.members:
        if member.obj is None or member.key in excluded:
            continue
        problem = (evaluate_master(member.obj, member.container, master) if member.stage is StageName.MASTER
                   else evaluate_target(member.obj, member.container,
                                        field=f"spec.targets[{member.target}].container"))
        if problem is None:
            continue
        if started and member.key != master_key:
            excluded[member.key] = f"{problem.reason.value}: {problem.message}"
        else:
            problems.setdefault(problem.reason, []).append(problem.message)
    if master.config_map is not None:
        config_map = observed.config_maps.get(master.config_map.name)
        if config_map is None:
            return _waiting_for_workloads(previous, policy, [f"ConfigMap/{master.config_map.name} (master) not found"],
                                          now)
        problem = evaluate_config_map(config_map, master.config_map.key)
        if problem is not None:
            problems.setdefault(Reason.UNMANAGEABLE_WORKLOAD, []).append(problem.message)
    sources = [VersionSource(m.stage, m.kind, m.name,
                             spec.master.version if m.target is None else spec.targets[m.target].mooncake_version,
                             container_image(m.obj or {}, m.container)) for m in fleet.members if m.key not in excluded]
    incompatible = evaluate_compatibility(spec, sources)
    if incompatible:
        problems.setdefault(Reason.INCOMPATIBLE, []).extend(incompatible)
    # A workload that is not what the policy says (wrong program, ambiguous container) first:
    # whether its connector or version would do is moot until the right workload is named.
    for reason in (Reason.UNMANAGEABLE_WORKLOAD, Reason.FOREIGN_CONNECTOR, Reason.INCOMPATIBLE):
        if reason in problems:
            return _refused(previous, policy, reason, problems[reason], now)
    if excluded:
        fleet = Fleet(tuple(m for m in fleet.members if m.key not in excluded), fleet.missing, fleet.unmatched)
    left_out = {key: (members[key], why) for key, why in excluded.items()}

    return _Planner(spec=spec, policy=policy, previous=previous, observed=observed, now=now,
                    fleet=fleet, connector=connector, master=master, excluded=left_out)


# --------------------------------------------------------------------------------------------
# Dry run (`moonlease plan -f`)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkloadPreview:
    """What the policy would do to one workload, over the whole rollout."""

    stage: StageName
    kind: str
    name: str
    changes: tuple[str, ...]
    """Human lines (`--eviction_ratio: 0.05 -> 0.1`); empty when the workload is in sync."""
    restarts: bool
    """Its pod template changes, so its pods are replaced (the master's restart empties the store)."""
    arm: str = ""
    """control / treatment with strategy ABTest (the control changes only when the test promotes)."""
    held: bool = False
    """A control workload of an A/B test not (yet) promoted: nothing changes now; `changes` is
    what promotion would do, and `restarts` is False."""
    restarts_if_promoted: bool = False
    """A held workload whose pods the promotion would replace."""


@dataclass(frozen=True)
class PolicyPreview:
    """A dry run of a policy against the cluster: the next reconcile's verdict, then every
    workload the whole rollout would change, and how."""

    phase: Phase
    reason: str
    message: str
    refused: bool
    """Invalid (refused: nothing would change) or Pending (workloads missing)."""
    desired_config_hash: str | None
    workloads: tuple[WorkloadPreview, ...] = ()
    events: tuple[EventNote, ...] = ()
    """What the first reconcile would announce."""
    ab_design: ABDesign | None = None
    """With strategy ABTest: the test's conditions, error rate, looks and detectable effects."""

    @property
    def master_restarts(self) -> bool:
        return any(w.restarts for w in self.workloads if w.stage is StageName.MASTER)

    @property
    def changes(self) -> bool:
        """Whether any workload changes now (a held control changes only if the test promotes)."""
        return any(w.changes for w in self.workloads if not w.held)


def plan_preview(*, raw_spec: Mapping[str, Any], policy: PolicyRef, previous: PolicyStatus, observed: Observed,
                 now: datetime.datetime, prometheus_allowlist: Sequence[str] | None = None) -> PolicyPreview:
    """What applying `raw_spec` would do, decided by the operator's own planner: the next
    reconcile (refused, waiting, which stage starts) and, per workload of every stage, the
    settings that change and whether its pods restart. Pure; writes nothing."""
    spec = read_spec(raw_spec)
    first = plan_reconcile(spec=spec, policy=policy, previous=previous, observed=observed, now=now,
                           prometheus_allowlist=prometheus_allowlist)
    ready = first.status.condition(ConditionType.READY)
    invalid = first.status.condition(ConditionType.INVALID)
    headline = invalid if first.status.phase is Phase.INVALID and invalid is not None else ready
    reason, message = (headline.reason, headline.message) if headline is not None else ("", "")
    prepared = _prepare(spec=spec, policy=policy, previous=previous, observed=observed, now=now,
                        prometheus_allowlist=prometheus_allowlist)
    if not isinstance(prepared, _Planner):
        return PolicyPreview(phase=first.status.phase or Phase.PENDING, reason=reason, message=message, refused=True,
                             desired_config_hash=None, events=first.events)
    ab = prepared.spec.rollout.ab_test
    arms = {**({n: "control" for n in ab.control.workloads} if ab else {}),
            **({n: "treatment" for n in ab.treatment.workloads} if ab else {})}
    # The control is held until this configuration's test promotes: until then it changes nothing.
    promoting = (previous.ab_test is not None and previous.ab_test.phase in (ABTestPhase.PROMOTING, ABTestPhase.PROMOTED)
                 and previous.ab_test.config_hash == first.status.desired_config_hash)
    rank = {name: i for i, name in enumerate(prepared.spec.rollout.stages)}
    workloads = []
    for member in sorted(prepared.fleet.members, key=lambda m: (rank.get(m.stage, len(rank)), m.kind, m.name)):
        pending = prepared._pending(prepared._apply_changes(member))
        lines = tuple(line for change in pending for line in describe_update(prepared._object(change), change))
        restarts = False
        for change in pending:
            if change.kind == "ConfigMap":
                continue
            current = prepared._object(change)
            new = build_update(current, change) or current
            restarts = restarts or (new.get("spec") or {}).get("template") != (current.get("spec") or {}).get("template")
        held = arms.get(member.name) == "control" and not promoting
        workloads.append(WorkloadPreview(stage=member.stage, kind=member.kind, name=member.name, changes=lines,
                                         restarts=restarts and not held, arm=arms.get(member.name, ""), held=held,
                                         restarts_if_promoted=restarts and held))
    return PolicyPreview(phase=first.status.phase or Phase.PENDING, reason=reason, message=message, refused=False,
                         desired_config_hash=first.status.desired_config_hash, workloads=tuple(workloads),
                         events=first.events, ab_design=build_ab_design(ab) if ab is not None else None)


def _other_claims(policy: PolicyRef, observed: Observed) -> list[Claim]:
    claims = []
    for raw in observed.policies:
        meta = raw.get("metadata") or {}
        if meta.get("name") == policy.name:
            continue
        try:
            spec = parse_spec(raw.get("spec") or {})
        except PolicySpecError:
            continue  # a refused policy claims nothing
        claims.append(build_claim(meta.get("name", ""), meta.get("creationTimestamp", ""), spec, observed.workloads,
                                  observed.index))
    return claims


@dataclass
class _Planner:
    """One planning pass (mutable scratch state; the result is frozen)."""

    spec: PolicySpec
    policy: PolicyRef
    previous: PolicyStatus
    observed: Observed
    now: datetime.datetime
    fleet: Fleet
    connector: ConnectorSettings
    master: MasterSettings
    # Filled in by plan() and the steps it takes:
    changes: list[WorkloadChange] = field(default_factory=list)
    notes: list[EventNote] = field(default_factory=list)  # events, in the order things happen
    desired_hash: str = ""
    revision: int = 0  # this attempt
    applied_revision: int | None = None  # the last attempt that completed
    applied_hash: str | None = None
    failed_stage: StageName | None = None
    pending_approval: str | None = None
    master_kept: str | None = None  # why the master was not rolled back with the targets
    order: list[StageName] = field(default_factory=list)
    stages: dict[StageName, StageStatus] = field(default_factory=dict)
    health: dict[WorkloadKey, WorkloadHealth] = field(default_factory=dict)
    ab: ABTestStatus | None = None  # the A/B test, with strategy ABTest
    held: frozenset[WorkloadKey] = frozenset()  # the control while an A/B test runs: covered, not changed
    excluded: Mapping[WorkloadKey, tuple[Member, str]] = field(default_factory=dict)
    """Targets left out of this plan, each with why (deleted, claimed, unmanageable): reported on
    the target; the rest carries on, and the policy cannot be Ready meanwhile."""
    verb: VerbDecision | None = None  # a verb annotation handled in this reconcile
    approval: VerbDecision | None = None  # an approval annotation handled in this reconcile
    paused_at: datetime.datetime | None = None  # held by the pause verb
    aborting: bool = False  # the abort verb failed the attempt in this reconcile
    orphan_restart: MasterRestart | None = None  # a master no longer covered, restored once approved
    _sync_cache: dict[WorkloadKey, bool] = field(default_factory=dict)
    _rollback_cache: dict[WorkloadKey, tuple[WorkloadChange, ...]] = field(default_factory=dict)
    listed_targets: int = DEFAULT_LISTED_TARGETS
    all_targets: list[TargetStatus] = field(default_factory=list)  # filled by _status
    conflict_settings: ConflictSettings = field(default_factory=ConflictSettings)
    conflicts: ConflictDecision = field(default_factory=lambda: ConflictDecision(records=()))
    master_held: str | None = None  # the master's writes wait out a conflicting writer's backoff
    _pod_set: PodSet | None = None

    def _pods(self) -> PodSet | None:
        """The observed pods, indexed once per plan (None: not fetched): each target's pods
        are found through the index, not by scanning every pod of the namespace."""
        if self._pod_set is None and self.observed.pods is not None:
            self._pod_set = PodSet(self.observed.pods, self.observed.pod_index)
        return self._pod_set

    def plan(self) -> ReconcilePlan:
        desired_hash = build_config_hash({"master": self.master.config_hash, "connector": self.connector.config_hash})
        self.desired_hash = desired_hash
        prev = self.previous
        self.revision = prev.revision or 0
        self.applied_revision = prev.applied_revision
        self.verb, self.approval = _plan_verbs(self.policy, prev, self._verb_situation(desired_hash))
        effect = self.verb.effect if self.verb is not None else VerbEffect.NONE
        self.paused_at = (self.now if effect is VerbEffect.PAUSE else
                          None if effect in (VerbEffect.RESUME, VerbEffect.ABORT) else prev.paused_at)
        self._begin_ab_test(desired_hash, effect)
        self.health = {m.key: evaluate_health(m.obj or {}, self._pods()) for m in self.fleet.members}
        self._track_conflicts(desired_hash)
        out_of_sync = [m for m in self.fleet.members if not self._in_sync(m)
                       and not (m.stage is StageName.MASTER and self.master_held is not None)]
        # At rest: Ready, or Degraded only because targets were left out (no stage failed), so a
        # target that comes back is brought in by a new attempt.
        at_rest = prev.phase in _AT_REST or (prev.phase is Phase.DEGRADED and prev.failed_stage is None)
        drifted = at_rest and bool(out_of_sync)
        retrying = effect in (VerbEffect.RETRY, VerbEffect.PROMOTE)
        if prev.desired_config_hash != desired_hash or prev.revision is None or drifted or retrying:
            self.revision += 1
            stages = [StageStatus(name=s, phase=StagePhase.PENDING) for s in self.spec.rollout.stages]
            self.failed_stage = None
            promoting = self.ab is not None and self.ab.phase is ABTestPhase.PROMOTING
            what = ("promoting the A/B treatment's configuration to the control" if promoting and (drifted or retrying)
                    else "retrying the same configuration" if retrying else
                    "re-applying to workloads that drifted or joined" if drifted and
                    prev.desired_config_hash == desired_hash else f"configuration {desired_hash}")
            self.notes.append(EventNote("Normal", Reason.ROLLOUT_STARTED.value,
                                        f"Rollout {self.revision}: {what}; stages "
                                        + " -> ".join(s.value for s in self.spec.rollout.stages)))
        else:
            stages = [prev.stage(s) or StageStatus(name=s, phase=StagePhase.PENDING) for s in self.spec.rollout.stages]
            self.failed_stage = prev.failed_stage
        self.stages = {s.name: s for s in stages}
        self._verify_settings()
        self.order = list(self.spec.rollout.stages)
        self.pending_approval = None
        self.applied_hash = prev.applied_config_hash
        self._release_orphans()
        if effect is VerbEffect.RESUME and prev.paused_at is not None:
            self._shift_stage_clocks(self.now - prev.paused_at)
        if effect is VerbEffect.ABORT:
            self._abort()

        if self.ab is not None and self.ab.phase is ABTestPhase.ROLLING_BACK and \
                not any(s.phase in _UNWINDING for s in self.stages.values()):
            self._fail_treatment()
        if any(s.phase in _UNWINDING for s in self.stages.values()):
            outcome = self._unwind()  # a rollback is never paused
        elif self.paused_at is not None:
            outcome = self._paused()
        else:
            outcome = self._advance()
        if self.ab is not None and outcome.reason is not Reason.PAUSED_BY_VERB:
            outcome = self._ab_outcome(outcome)
        if self.excluded or self.fleet.unmatched:
            outcome = self._with_excluded(outcome)
        if outcome.phase is Phase.READY:
            self.applied_hash, self.applied_revision = desired_hash, self.revision
        outcome = self._hold_orphan_restart(outcome)
        status = self._status(outcome, desired_hash)
        verb_notes = [d.note() for d in (self.verb, self.approval) if d is not None]
        events = (*verb_notes, *self.notes, *_phase_events(prev, status))
        return ReconcilePlan(status=status, events=tuple(events), changes=tuple(self.changes),
                             all_targets=tuple(self.all_targets), listed_targets=self.listed_targets)

    # ---- A/B test ----------------------------------------------------------------------------

    def _begin_ab_test(self, desired_hash: str, effect: VerbEffect) -> None:
        """With strategy ABTest: carry the test on (a reading, a human's decision, a verb) and
        hold the control out of the rollout until the test promotes. Paused: no reading counts,
        no decision is taken."""
        spec = self.spec.rollout.ab_test
        if spec is None:
            return
        ab = begin_test(None if effect is VerbEffect.RETRY else self.previous.ab_test, desired_hash)
        reading = self.observed.ab_reading
        if self.paused_at is None:
            if ab.phase is ABTestPhase.MEASURING and reading is not None:
                ab, notes = record_measurement(ab, spec, reading, self.now,
                                               policy=self.policy.name, namespace=self.policy.namespace)
                self.notes.extend(notes)
            ab, notes = apply_decision_annotation(ab, self.policy.annotations.get(AB_DECISION_ANNOTATION), self.now)
            self.notes.extend(notes)
        if effect is VerbEffect.PROMOTE:
            ab = ab.model_copy(update={"phase": ABTestPhase.PROMOTING, "action": "Promote", "decided_at": self.now,
                                       "reason": f"promoted by a person after {ab.samples} samples; {ab.reason}"[:4096]})
        elif effect is VerbEffect.ABORT and ab.phase is not ABTestPhase.PROMOTING:
            # Aborting a promotion rolls back the control's stages instead (see _abort): the test stays promoting.
            ab = ab.model_copy(update={"phase": ABTestPhase.ROLLING_BACK, "action": "RollBack", "decided_at": self.now,
                                       "reason": f"aborted by a person after {ab.samples} samples; {ab.reason}"[:4096]})
        self.ab = ab
        if ab.phase not in (ABTestPhase.PROMOTING, ABTestPhase.PROMOTED):
            control = set(spec.control.workloads)
            self.held = frozenset(m.key for m in self.fleet.members if m.target is not None and m.name in control)
            self.fleet = Fleet(tuple(m for m in self.fleet.members if m.key not in self.held), self.fleet.missing,
                               self.fleet.unmatched)

    def _arm_mix(self) -> str | None:
        """`UnbalancedArms`: the warning about the arms' prefill/decode mixes, or None."""
        spec = self.spec.rollout.ab_test
        assert spec is not None
        replicas: dict[str, tuple[str, int]] = {}
        for target in self.spec.targets:  # both arms: the held control is not among the fleet's members
            obj = self.observed.workloads.get((target.kind.value, target.name or ""))
            if obj is not None:
                replicas[target.name or ""] = (target.role.value, int((obj.get("spec") or {}).get("replicas", 1) or 0))
        return evaluate_arm_mix(spec, replicas)

    def _arm_names(self) -> tuple[list[str], list[str]]:
        spec = self.spec.rollout.ab_test
        assert spec is not None
        return list(spec.control.workloads), list(spec.treatment.workloads)

    def _fail_treatment(self) -> None:
        """The verdict rolls the treatment back: its last changed stage counts as failed, so the
        rollback machinery restores every treatment stage this attempt changed (never the
        master: both arms share it, so its settings were not under test)."""
        assert self.ab is not None
        changed = [n for n in self.order if n is not StageName.MASTER and self.stages[n].phase is StagePhase.SUCCEEDED]
        if not changed:
            return
        name = changed[-1]
        self.failed_stage = name
        self.stages[name] = self.stages[name].model_copy(update={
            "phase": StagePhase.FAILED, "finished_at": self.now,
            "message": f"A/B test {self.ab.verdict or 'decision'}: rolling the treatment back"})

    # ---- verbs -------------------------------------------------------------------------------

    def _verb_situation(self, desired_hash: str) -> VerbSituation:
        prev, ab_spec = self.previous, self.spec.rollout.ab_test
        ab_phase = None
        if ab_spec is not None:
            ab_phase = prev.ab_test.phase if prev.ab_test is not None and prev.ab_test.config_hash == desired_hash \
                else ABTestPhase.DEPLOYING
        return VerbSituation(phase=prev.phase, ab_phase=ab_phase, revision=prev.revision, config_hash=desired_hash,
                             paused=prev.paused_at is not None, spec_paused=self.spec.rollout.paused,
                             pending_approval=prev.pending_approval)

    def _abort(self) -> None:
        """The abort verb: the stage under way (else the last one done, else the first) fails,
        so the rollback machinery restores what this attempt changed, whatever onFailure says."""
        under_way = [n for n in self.order if self.stages[n].phase in (StagePhase.PROGRESSING,
                                                                     StagePhase.AWAITING_APPROVAL)]
        done = [n for n in self.order if self.stages[n].phase is StagePhase.SUCCEEDED]
        name = (under_way or done[-1:] or self.order)[0]
        self.failed_stage, self.aborting = name, True
        self._set_stage(name, StagePhase.FAILED, "aborted by a person (moonlease abort)", finished=True)

    def _shift_stage_clocks(self, paused_for: datetime.timedelta) -> None:
        """On resume: a stage's timeout does not count the time the pause held it."""
        for name, stage in self.stages.items():
            if stage.phase is StagePhase.PROGRESSING and stage.started_at is not None:
                self.stages[name] = stage.model_copy(update={"started_at": stage.started_at + paused_for})

    def _paused(self) -> _Outcome:
        assert self.paused_at is not None
        stage = self.previous.current_stage or (self.order[0] if self.order else None)
        return _Outcome(Phase.PAUSED, stage, Reason.PAUSED_BY_VERB,
                        f"Paused by a person since {_ts(self.paused_at)}: nothing starts, times out or is measured;"
                        f" resume with: moonlease resume {self.policy.name} -n {self.policy.namespace}")

    def _ab_outcome(self, outcome: _Outcome) -> _Outcome:
        """The rollout's outcome seen through the A/B test, which moves on when the rollout
        settles: measuring once the treatment is ready, promoted once the control is."""
        ab, spec = self.ab, self.spec.rollout.ab_test
        assert ab is not None and spec is not None
        if ab.phase is ABTestPhase.ROLLING_BACK:
            if outcome.phase is Phase.ROLLING_BACK:
                return _Outcome(Phase.ROLLING_BACK, outcome.stage, Reason.AB_TEST_ROLLING_BACK,
                                f"A/B test {ab.verdict}: rolling the treatment back ({outcome.message})")
            restored = outcome.phase is Phase.DEGRADED and outcome.reason is Reason.ROLLED_BACK
            what = ("the treatment was rolled back to what it ran before the test" if restored else
                    "the treatment ran this configuration before the test: there is nothing to roll back to"
                    if outcome.phase is Phase.READY else "rolling the treatment back did not complete")
            self.ab = ab = ab.model_copy(update={"phase": ABTestPhase.ROLLED_BACK,
                                                 "reason": f"{ab.reason}; {what}"[:4096]})
        if ab.phase is ABTestPhase.ROLLED_BACK:
            if outcome.reason is Reason.ROLLBACK_INCOMPLETE:
                return outcome
            return _Outcome(Phase.DEGRADED, outcome.stage, Reason.AB_TEST_ROLLED_BACK,
                            f"A/B test {ab.verdict}: {ab.reason} (change the spec to test again)")
        if outcome.phase is not Phase.READY:
            return outcome  # the rollout (of the treatment, or of the control's promotion) is under way
        if ab.phase is ABTestPhase.DEPLOYING:
            self.ab, notes = start_measuring(ab, spec, *self._arm_names(), self.now)
            self.notes.extend(notes)
            unbalanced = self._arm_mix()
            if unbalanced is not None:
                self.notes.append(EventNote("Warning", Reason.UNBALANCED_ARMS.value, f"A/B test: {unbalanced}"))
            ab = self.ab
        if ab.phase is ABTestPhase.MEASURING:
            return _Outcome(Phase.ANALYZING, outcome.stage, Reason.AB_TEST_MEASURING,
                            f"A/B test: {ab.samples} of {spec.min_samples} samples; {ab.reason}")
        if ab.phase is ABTestPhase.AWAITING_DECISION:
            return _Outcome(Phase.AWAITING_DECISION, outcome.stage, Reason.AB_TEST_AWAITING_DECISION,
                            f"A/B test {ab.verdict}: {ab.reason}. {decision_hint(ab, self.policy.name, self.policy.namespace)}")
        if ab.phase is ABTestPhase.PROMOTING:
            self.ab = ab = ab.model_copy(update={"phase": ABTestPhase.PROMOTED})
            self.notes.append(EventNote("Normal", Reason.AB_TEST_PROMOTED.value,
                                        f"A/B test {ab.verdict}: the control runs the treatment's configuration"
                                        f" {ab.config_hash}"))
        return _Outcome(Phase.READY, outcome.stage, Reason.AB_TEST_PROMOTED,
                        f"A/B test {ab.verdict}: promoted; every stage runs configuration {self.desired_hash}")

    # ---- another writer reverting ours (GitOps) -------------------------------------------

    def _track_conflicts(self, desired_hash: str) -> None:
        """Count the workloads found reverted since the operator wrote them (`core.conflicts`);
        a target backing off is left out of this plan (reported, the rest carries on), the
        master's writes wait (`master_held`)."""
        prev = self.previous
        reverted: list[Revert] = []
        if prev.revision is not None and prev.desired_config_hash == desired_hash:
            written = (StagePhase.PROGRESSING, StagePhase.SUCCEEDED, StagePhase.SKIPPED)
            refused = {(t.kind.value, t.name) for t in prev.targets if t.write_error}
            for member in self.fleet.members:
                stage = prev.stage(member.stage)
                if member.obj is None or stage is None or stage.phase not in written or member.key in refused \
                        or self._in_sync(member):
                    continue
                reverted.append(self._revert_of(member))
        self.conflicts = decision = track_reverts(prev.conflicts, reverted, now=self.now,
                                                  settings=self.conflict_settings)
        for record in decision.started:
            self.notes.append(EventNote("Warning", Reason.CONFLICTING_WRITER.value,
                                        decision.held[(record.kind, record.name)]))
        for record in decision.retried:
            self.notes.append(EventNote("Normal", Reason.CONFLICTING_WRITER.value,
                                        f"{record.kind}/{record.name}: the backoff is over; writing it once more"
                                        f" ({record.field} was reverted by"
                                        f" {record.manager or 'a writer the API server does not name'})"))
        held = {m.key: m for m in self.fleet.members if m.key in decision.held}
        if not held:
            return
        master = self.fleet.master.key
        if master in held:
            self.master_held = decision.held[master]
        left_out = {key: (member, f"{Reason.CONFLICTING_WRITER.value}: {decision.held[key]}")
                    for key, member in held.items() if key != master}
        self.excluded = {**self.excluded, **left_out}
        self.fleet = Fleet(tuple(m for m in self.fleet.members if m.key not in left_out), self.fleet.missing,
                           self.fleet.unmatched)

    def _revert_of(self, member: Member) -> Revert:
        """The first field found reverted in `member` (or its settings ConfigMap), and who wrote it."""
        for change in self._pending(self._apply_changes(member)):
            obj = self._object(change)
            slots = differing_slots(obj, change)
            place = change.place if change.kind == "ConfigMap" else \
                (find_container(obj, change.place) or {}).get("name", change.place)
            path = field_path(change.kind, place, slots[0] if slots else "annotation")
            if change.kind == "ConfigMap":
                path = f"ConfigMap/{change.name} {path}"
            return Revert(member.kind, member.name, path, last_writer(obj))
        raise AssertionError("a member out of sync has a pending change")

    def _conflict_condition(self, conditions: list[Any]) -> list[Any]:
        """ConflictingWriter: True while an object is left alone because another writer keeps
        reverting it, False once none is; absent for a policy that never met one."""
        kind = ConditionType.CONFLICTING_WRITER.value
        held = list(self.conflicts.held.values())
        if held:
            return set_condition(conditions, type_=kind, status=ConditionStatus.TRUE,
                                 reason=Reason.CONFLICTING_WRITER.value, message=_join(held),
                                 generation=self.policy.generation, now=self.now)
        if not any(c.type == kind for c in conditions):
            return conditions
        return set_condition(conditions, type_=kind, status=ConditionStatus.FALSE,
                             reason=Reason.NO_CONFLICTING_WRITER.value,
                             message="No other writer reverts what the operator writes",
                             generation=self.policy.generation, now=self.now)

    # ---- connector settings: delivered live, verified on the pods ---------------------------

    def _verify_settings(self) -> None:
        """A workload of a Progressing stage is complete only once its running pods show the
        settings: every Ready vLLM pod's connector reports the settings hash the policy expects,
        and every Ready master pod runs the master's flags. A workload of a stage Rolling back is
        restored only once its pods run what the restored objects say. Until then it counts as
        progressing, with the per-pod reasons as its message (and an event when they change); a
        connector that refused exactly these settings fails it at once (it will not change its
        answer)."""
        previous = {(t.kind.value, t.name): t.message for t in self.previous.targets}
        for member in self.fleet.members:
            stage = self.stages.get(member.stage)
            health = self.health[member.key]
            if stage is None or health.health is not Health.COMPLETE:
                continue
            if stage.phase is StagePhase.PROGRESSING and self._in_sync(member):
                forward = True  # (not written yet: re-applied and reported as such)
            elif stage.phase is StagePhase.ROLLING_BACK and self._changed_in_attempt(member) \
                    and not self._rollback_pending(member):
                forward = False
            else:
                continue
            refused = False
            if member.target is None:
                problems = self._master_problems(member, restored=not forward)
                what = "master flags not verified: " if forward else "restored master flags not verified: "
            else:
                problems, refused = self._settings_problems(member, restored=not forward)
                what = ("connector settings not verified: " if forward
                        else "restored connector settings not verified: ")
            if not problems:
                continue
            message = what + _join(problems)
            self.health[member.key] = dataclasses.replace(
                health, health=Health.FAILED if refused else Health.PROGRESSING, message=message)
            if previous.get(member.key) != message:
                self.notes.append(EventNote("Warning", Reason.SETTINGS_NOT_VERIFIED.value,
                                            f"{member.kind}/{member.name}: {message}"))

    def _master_problems(self, member: Member, *, restored: bool = False) -> list[str]:
        """Ready master pods whose running pod spec lacks the policy's flags — or, `restored`,
        the flags its restored pod template gives back (with a config file, its content is
        covered by the template's hash, which the pods carry)."""
        if self.master.config_map is None and self.observed.pods is not None:
            obj = member.obj or {}
            flags: Mapping[str, str | None] = (
                restored_master_flags(obj, member.container, self.master.flags) if restored else self.master.flags)
            return [problem for pod in current_ready_pods(obj, self._pods() or ())
                    if (problem := evaluate_master_pod(pod, member.container, flags)) is not None]
        return []

    def _settings_problems(self, member: Member, *, restored: bool = False) -> tuple[list[str], bool]:
        """Per-pod reasons the connectors do not run the expected settings, and whether one of
        them refused exactly those. Forward, the policy's file is expected; `restored`, the file
        the rolled-back ConfigMap holds — and nothing of a workload whose restored template no
        longer reads a file (its pods restarted on their start-up settings: health said so)."""
        obj = member.obj or {}
        if restored:
            if not template_reads_settings_file(obj):
                return [], False
            config_map = settings_config_map_name(member.name)
            text = settings_file_text(self.observed.config_maps.get(config_map))
            expected = file_settings_hash(obj, member.container, text)
            if expected is None:
                return [f"ConfigMap {config_map} holds no settings file the connector accepts after the restore;"
                        " its pods keep the settings they run"], False
        else:
            expected = expected_settings_hash(obj, member.container, self.connector.file)
        if self.observed.pods is None:
            return ["pods not read"], False
        reports = self.observed.settings_reports or {}
        chosen = settings_pods(obj, self._pods() or ())
        # A pod that can never read the file fails the stage now: waiting would not change it.
        problems, refused = [unmounted_pod_problem(p) for p in chosen.unmounted], bool(chosen.unmounted)
        for pod in chosen.report:
            name = str((pod.get("metadata") or {}).get("name"))
            problem = evaluate_pod_settings(name, reports.get(name), expected)
            if problem is not None:
                problems.append(problem)
                refused = refused or refused_expected(reports.get(name), expected)
        return problems, refused

    # ---- per-member decisions ---------------------------------------------------------------

    def _apply_changes(self, member: Member) -> list[WorkloadChange]:
        """The changes that bring `member` to the policy (a master with a ConfigMap has two: the
        file first, then the pod template's hash annotation that restarts it)."""
        common: dict[str, Any] = {"policy": self.policy.name, "revision": self.revision, "applied_revision": self.applied_revision,
                  "action": ChangeAction.APPLY}
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

    def _master_restart(self, direction: RestartDirection, settings_hash: str,
                        lines: Sequence[str]) -> MasterRestart:
        master = self.fleet.master
        return build_master_restart(f"{master.kind}/{master.name}", direction, self.revision, settings_hash, lines)

    def _forward_key(self, lines: Sequence[str]) -> str:
        """What a forward master restart's approval is keyed to: the settings, the flag changes
        from what the master runs now and its generation — so an approval given for the rollout
        never lets a later repair of the same attempt through (a stage reopened by drift)."""
        master = self.fleet.master.obj or {}
        return build_config_hash({"settings": self.master.config_hash, "changes": sorted(lines),
                                  "generation": (master.get("metadata") or {}).get("generation")})

    def _describe(self, changes: Sequence[WorkloadChange]) -> list[str]:
        """Human lines for what `changes` alter (`--eviction_ratio: 0.05 -> 0.1`)."""
        return [line for c in changes for line in describe_update(self._object(c), c)]

    def _object(self, change: WorkloadChange) -> Mapping[str, Any]:
        if change.kind == "ConfigMap":
            return self.observed.config_maps.get(change.name) or change.create_from or {}
        return self.observed.workloads.get(change.ref) or {}

    def _pending(self, changes: Sequence[WorkloadChange]) -> list[WorkloadChange]:
        return [c for c in changes if needs_update(self._object(c), c)]

    def _in_sync(self, member: Member) -> bool:
        # Asked several times per member per plan; the observed objects do not change meanwhile.
        if member.key not in self._sync_cache:
            self._sync_cache[member.key] = not self._pending(self._apply_changes(member))
        return self._sync_cache[member.key]

    def _rollback_pending(self, member: Member) -> tuple[WorkloadChange, ...]:
        """What restoring `member` still has to write (cached per plan, as `_in_sync`)."""
        if member.key not in self._rollback_cache:
            self._rollback_cache[member.key] = tuple(self._pending(self._rollback_changes(member)))
        return self._rollback_cache[member.key]

    def _rollback_changes(self, member: Member) -> list[WorkloadChange]:
        changes = [WorkloadChange(kind=member.kind, name=member.name, action=ChangeAction.ROLLBACK,
                                  policy=self.policy.name, revision=self.revision)]
        config_map = self._config_map_of(member)
        if config_map is not None:
            changes.insert(0, WorkloadChange(kind="ConfigMap", name=config_map, action=ChangeAction.ROLLBACK,
                                             policy=self.policy.name, revision=self.revision))
        return changes

    def _config_map_of(self, member: Member) -> str | None:
        """The ConfigMap a member's settings live in: the master's file, or a target's settings."""
        if member.stage is StageName.MASTER:
            return None if self.master.config_map is None else self.master.config_map.name
        return settings_config_map_name(member.name)

    def _write_error(self, member: Member) -> str | None:
        """The refusal recorded for `member`'s last write, while that write is still to be done."""
        previous = next((t for t in self.previous.targets if (t.kind.value, t.name) == member.key), None)
        if previous is None or not previous.write_error:
            return None
        stage = self.stages.get(member.stage)
        rolling_back = stage is not None and stage.phase in _UNWINDING
        pending = self._rollback_pending(member) if rolling_back else not self._in_sync(member)
        return previous.write_error if pending else None

    def _changed_in_attempt(self, member: Member) -> bool:
        # A live settings change touches only the ConfigMap: it counts as changing the workload.
        config_map = self._config_map_of(member)
        return rollback_revision(member.obj or {}) == self.revision or (
            config_map is not None and member.stage is not StageName.MASTER
            and rollback_revision(self.observed.config_maps.get(config_map) or {}) == self.revision)

    def _release_orphans(self) -> None:
        """Workloads this policy changed but no longer covers get their original back. A master
        no longer covered (`spec.master.name` renamed) is still the store the engines use: it
        keeps its settings (`master.onDelete: keep`), or restoring it restarts it like any other
        master restart, approved first when `requireApprovalForRestart` (`orphan_restart`)."""
        declared = declared_master(self.spec, self.previous)
        first = len(self.changes)
        for key in managed_keys(policy_label_value(self.policy.name), self.observed.workloads, self.observed.index):
            obj = self.observed.workloads[key]
            if key in self.fleet.keys or key in self.held or key in self.excluded:
                continue
            master = is_master_object(obj, declared)
            keep = master and self.spec.master.on_delete is MasterDeletionPolicy.KEEP
            change = WorkloadChange(kind=key[0], name=key[1], action=ChangeAction.FORGET if keep else
                                    ChangeAction.RELEASE, policy=self.policy.name)
            if not needs_update(obj, change):
                continue
            if keep:
                self.changes.append(change)
                self.notes.append(EventNote("Normal", Reason.RELEASED.value,
                                            f"{key[0]}/{key[1]} is no longer the master: it keeps its settings"
                                            " (master.onDelete: keep), nothing restarts"))
                continue
            new = build_update(obj, change) or obj
            if master and (new.get("spec") or {}).get("template") != (obj.get("spec") or {}).get("template"):
                restart = build_master_restart(f"{key[0]}/{key[1]}", RestartDirection.RESTORE, self.revision,
                                               template_config_hash(obj) or "", describe_update(obj, change))
                if self.spec.master.require_approval_for_restart and not restart.approved_by(
                        self.policy.annotations):
                    self.orphan_restart = restart
                    continue
                self.notes.append(restart.note())
            self.changes.append(change)
            self.notes.append(EventNote("Normal", Reason.RELEASED.value,
                                        f"{key[0]}/{key[1]} is no longer covered: restoring its original"
                                        " configuration"))
        # The ConfigMaps before the workloads they configure (a master restored reads its file).
        self.changes[first:first] = self._release_orphan_config_maps(declared)

    def _release_orphan_config_maps(self, declared: frozenset[tuple[str, str]]) -> list[WorkloadChange]:
        """ConfigMaps this policy labelled that it no longer uses: a master file no longer named
        (`spec.master.configMap` or `spec.master.name` renamed) follows `master.onDelete` like its
        master — kept as it is and forgotten, or given back its content from before the policy,
        with the master's own restore when that waits for approval; a settings file of a workload
        no longer covered gets its content from before the policy, like its workload."""
        label = policy_label_value(self.policy.name)
        in_use = {settings_config_map_name(key[1]) for key in (*self.fleet.keys, *self.held, *self.excluded)}
        if self.master.config_map is not None:
            in_use.add(self.master.config_map.name)
        changes = []
        for name, obj in sorted(self.observed.config_maps.items()):
            if name in in_use or managed_by(obj) != label:
                continue
            master = is_master_object(obj, declared)
            keep = master and self.spec.master.on_delete is MasterDeletionPolicy.KEEP
            if master and not keep and self.orphan_restart is not None:
                continue  # given back with its master, once that restore is approved
            change = WorkloadChange(kind="ConfigMap", name=name, action=ChangeAction.FORGET if keep else
                                    ChangeAction.RELEASE, policy=self.policy.name)
            if not needs_update(obj, change):
                continue
            changes.append(change)
            self.notes.append(EventNote("Normal", Reason.RELEASED.value,
                                        f"ConfigMap/{name} is no longer used by the policy: "
                                        + ("it keeps its content (master.onDelete: keep)" if keep else
                                           "restoring its content from before the policy")))
        return changes

    def _hold_orphan_restart(self, outcome: _Outcome) -> _Outcome:
        """A master no longer covered waits for approval before it is restored: the policy is
        not Ready meanwhile (its old master would restart later, emptying the store)."""
        restart = self.orphan_restart
        if restart is None or self.pending_approval is not None or outcome.phase is not Phase.READY:
            return outcome
        self.pending_approval = restart.approval_key
        return _Outcome(Phase.AWAITING_APPROVAL, outcome.stage, Reason.AWAITING_APPROVAL,
                        f"{restart.workload} is no longer the policy's master (master.onDelete: restore):"
                        f" {restart.approval_request(self.policy.name)}")

    # ---- forward ------------------------------------------------------------------------------

    def _advance(self) -> _Outcome:
        rollout = self.spec.rollout
        last_finished: datetime.datetime | None = None
        for name in self.order:
            stage = self.stages[name]
            members = self.fleet.in_stage(name)
            drifted: list[Member] = []
            if name is StageName.MASTER and self.master_held is not None and not self._in_sync(self.fleet.master):
                return _Outcome(Phase.DEGRADED, name, Reason.CONFLICTING_WRITER,
                                f"The master is left alone while another writer reverts it: {self.master_held}")
            if stage.phase in _DONE:
                # A finished stage is verified again on every reconcile (each watch event of its
                # workloads and settings ConfigMaps wakes one): a `kubectl rollout undo` or a hand
                # edit while a later stage runs reopens it, never a Ready over old settings.
                drifted = [m for m in members if not self._in_sync(m)]
                if not drifted:
                    if stage.phase is StagePhase.SUCCEEDED:
                        last_finished = stage.finished_at
                    continue
                self._reopen(name, drifted)
                stage = self.stages[name]
            if stage.phase in (StagePhase.PENDING, StagePhase.AWAITING_APPROVAL):
                pending = [m for m in members if not self._in_sync(m)]
                if not pending:
                    self._set_stage(name, StagePhase.SKIPPED, "nothing to change", finished=True)
                    continue
                if last_finished is not None and rollout.pause_between_stages_seconds:
                    resume = last_finished + datetime.timedelta(seconds=rollout.pause_between_stages_seconds)
                    if self.now < resume:
                        return _Outcome(Phase.PROGRESSING, name, Reason.PAUSE_BETWEEN_STAGES,
                                        f"Stage {name.value} starts at {_ts(resume)} (pause between stages)")
                if rollout.paused:
                    return _Outcome(Phase.PAUSED, name, Reason.PAUSED,
                                    f"Paused by spec.rollout.paused before stage {name.value}")
                lines = self._describe([c for m in pending for c in self._pending(self._apply_changes(m))])
                restart = None
                if name is StageName.MASTER:
                    restart = self._master_restart(RestartDirection.FORWARD, self._forward_key(lines), lines)
                    if self.spec.master.require_approval_for_restart and not restart.approved_by(
                            self.policy.annotations):
                        self.pending_approval = restart.approval_key
                        message = restart.approval_request(self.policy.name)
                        self._set_stage(name, StagePhase.AWAITING_APPROVAL, message)
                        return _Outcome(Phase.AWAITING_APPROVAL, name, Reason.AWAITING_APPROVAL, message)
                    self.notes.append(restart.note())
                for member in pending:
                    self.changes.extend(self._pending(self._apply_changes(member)))
                # The status says what is about to happen (a master restart in so many words).
                doing = (restart.describe() if restart is not None else
                         f"re-applying to {_join([f'{m.kind}/{m.name}' for m in drifted])}, which drifted"
                         if drifted else f"updating {len(pending)} workload(s)")
                self._set_stage(name, StagePhase.PROGRESSING, doing, started=True)
                return _Outcome(Phase.PROGRESSING, name, Reason.STAGE_PROGRESSING, f"Stage {name.value}: {doing}")
            # Progressing: re-apply what is not there (a write that failed), then verify. A master
            # still to be patched is announced again: the last announcement may be all that got out.
            for member in members:
                again = self._pending(self._apply_changes(member))
                if again and name is StageName.MASTER:
                    self.notes.append(self._master_restart(RestartDirection.FORWARD, self.master.config_hash,
                                                           ()).note(retry=True))
                self.changes.extend(again)
            failed = [(m, self.health[m.key]) for m in members if self.health[m.key].health is Health.FAILED]
            refused = [f"{m.kind}/{m.name}: {error}" for m in members if (error := self._write_error(m))]
            waiting = [(m, self.health[m.key]) for m in members
                       if self.health[m.key].health is not Health.COMPLETE or not self._in_sync(m)]
            # Completion first: a stage whose workloads are done is verified and succeeds however
            # late it is looked at (an operator away longer than the timeout never fails, nor rolls
            # back, work that finished meanwhile); the deadline fails only what is still waiting.
            if refused or failed or (waiting and self._past_deadline(stage)):
                why = (_join(refused) if refused else _describe_health(failed) if failed else
                       f"not ready within {rollout.stage_timeout_seconds}s: {_describe_health(waiting)}")
                self.failed_stage = name
                self._set_stage(name, StagePhase.FAILED, why, finished=True)
                self.changes = [c for c in self.changes if c.action is not ChangeAction.APPLY]
                if rollout.on_failure is FailurePolicy.HALT:
                    return _Outcome(Phase.DEGRADED, name, Reason.HALTED,
                                    f"Stage {name.value} failed ({why}); halted as spec.rollout.onFailure says")
                return self._unwind()
            if waiting:
                return _Outcome(Phase.PROGRESSING, name, Reason.STAGE_PROGRESSING,
                                f"Stage {name.value}: {_describe_health(waiting)}")
            self._set_stage(name, StagePhase.SUCCEEDED, f"{len(members)} workload(s) updated and verified",
                            finished=True)
            last_finished = self.now
        return _Outcome(Phase.READY, self.order[-1], Reason.ROLLOUT_COMPLETE,
                        f"Every stage runs configuration {self.desired_hash}")

    def _reopen(self, name: StageName, drifted: Sequence[Member]) -> None:
        """A finished stage whose workloads no longer hold the configuration goes back to
        Pending, announced with what changed (`StageDrifted`), and is applied again in order."""
        what = _join([f"{m.kind}/{m.name}" + (f" ({'; '.join(lines)})" if (lines := self._describe(
            self._pending(self._apply_changes(m)))) else "") for m in drifted])
        message = f"drifted after it {self.stages[name].phase.value.lower()}: {what}"
        self.notes.append(EventNote("Warning", Reason.STAGE_DRIFTED.value, f"Stage {name.value} {message}"))
        self.stages[name] = self.stages[name].model_copy(update={
            "phase": StagePhase.PENDING, "message": message[:32768], "finished_at": None})

    # ---- backward -----------------------------------------------------------------------------

    def _unwind(self) -> _Outcome:
        """Roll back, last stage first, every stage this attempt changed."""
        failed = self.failed_stage
        failure = _failure_of(self.stages[failed].message) if failed is not None and failed in self.stages else ""
        ab_rollback = self.ab is not None and self.ab.phase in (ABTestPhase.ROLLING_BACK, ABTestPhase.ROLLED_BACK)
        if not ab_rollback and not self.aborting and self.spec.rollout.on_failure is FailurePolicy.HALT and not any(
                s.phase in (StagePhase.ROLLING_BACK, StagePhase.ROLLED_BACK) for s in self.stages.values()):
            name = failed or self.order[-1]
            return _Outcome(Phase.DEGRADED, name, Reason.HALTED,
                            f"Stage {name.value} failed ({failure}); halted as spec.rollout.onFailure says")
        for name in reversed(self.order):
            stage = self.stages[name]
            if ab_rollback and name is StageName.MASTER:
                continue  # shared by both arms: not under test
            members = [m for m in self.fleet.in_stage(name) if self._changed_in_attempt(m)]
            if stage.phase in (StagePhase.SUCCEEDED, StagePhase.FAILED, StagePhase.PROGRESSING):
                changes = [c for m in members for c in self._rollback_pending(m)]
                if not changes:
                    self._set_stage(name, StagePhase.ROLLED_BACK, self._rolled_back_message(name, "nothing to restore"),
                                    finished=True)
                    continue
                if name is StageName.MASTER:
                    restart = self._master_restart(RestartDirection.ROLLBACK, self.master.config_hash,
                                                   self._describe(changes))
                    held = self._hold_master_rollback(restart, failed, failure)
                    if held is not None:
                        return held
                    if self.master_kept is not None:
                        continue
                    self.notes.append(restart.note())
                self.changes.extend(changes)
                self._set_stage(name, StagePhase.ROLLING_BACK, self._rolled_back_message(name, "rolling back"),
                                started=True)
                return _Outcome(Phase.ROLLING_BACK, name, Reason.ROLLING_BACK,
                                f"Stage {(failed or name).value} failed ({failure}); rolling back stage {name.value}")
            if stage.phase is StagePhase.ROLLING_BACK:
                changes = [c for m in members for c in self._rollback_pending(m)]
                if changes and name is StageName.MASTER:
                    self.notes.append(self._master_restart(RestartDirection.ROLLBACK, self.master.config_hash,
                                                           ()).note(retry=True))
                self.changes.extend(changes)
                health = [(m, self.health[m.key]) for m in members]
                broken = [(m, h) for m, h in health if h.health is Health.FAILED]
                refused = [f"{m.kind}/{m.name}: {error}" for m in members if (error := self._write_error(m))]
                waiting = [(m, h) for m, h in health if h.health is not Health.COMPLETE]
                if refused or broken or ((changes or waiting) and self._past_deadline(stage)):
                    self.changes = [c for c in self.changes if not refused or c.ref not in {m.key for m in members}]
                    self._set_stage(name, StagePhase.ROLLBACK_FAILED,
                                    self._rolled_back_message(name, "rollback did not complete: "
                                                              + (_join(refused) or _describe_health(broken or waiting))),
                                    finished=True)
                    continue
                if changes or waiting:
                    return _Outcome(Phase.ROLLING_BACK, name, Reason.ROLLING_BACK,
                                    f"Stage {(failed or name).value} failed ({failure}); rolling back stage"
                                    f" {name.value}: {_describe_health(waiting) or 'restoring'}")
                self._set_stage(name, StagePhase.ROLLED_BACK, self._rolled_back_message(name, "rolled back"),
                                finished=True)
        incomplete = [n.value for n in self.order if self.stages[n].phase is StagePhase.ROLLBACK_FAILED]
        name = failed or self.order[-1]
        if self.master_kept is not None:
            return _Outcome(Phase.DEGRADED, name, Reason.ROLLED_BACK,
                            f"Stage {name.value} failed ({failure}); the targets were rolled back; "
                            + self.master_kept)
        if incomplete:
            return _Outcome(Phase.DEGRADED, name, Reason.ROLLBACK_INCOMPLETE,
                            f"Stage {name.value} failed ({failure}); rollback incomplete for stage(s)"
                            f" {', '.join(incomplete)}")
        return _Outcome(Phase.DEGRADED, name, Reason.ROLLED_BACK,
                        f"Stage {name.value} failed ({failure}); every changed stage was rolled back")

    def _past_deadline(self, stage: StageStatus) -> bool:
        """Whether `stage` (Progressing or Rolling back) has run past `stageTimeoutSeconds`;
        asked only about a stage that still waits for something."""
        started = stage.started_at or self.now
        return self.now - started > datetime.timedelta(seconds=self.spec.rollout.stage_timeout_seconds)

    def _with_excluded(self, outcome: _Outcome) -> _Outcome:
        """Targets left out are reported on themselves and announced once; the rest carried on.
        What would be Ready is Degraded (`MembersExcluded`) while any is left out."""
        before = {(s.kind.value, s.name) for s in self.previous.targets if s.phase is TargetPhase.EXCLUDED}
        lines = [f"{m.kind}/{m.name}: {why}" for m, why in self.excluded.values()] + list(self.fleet.unmatched)
        for key, (member, why) in sorted(self.excluded.items()):
            if key not in before and key not in self.conflicts.held:  # announced as ConflictingWriter
                self.notes.append(EventNote("Warning", Reason.MEMBER_EXCLUDED.value,
                                            f"{member.kind}/{member.name} left out, the others carry on: {why}"))
        if outcome.phase is not Phase.READY:
            return outcome
        reason = Reason.CONFLICTING_WRITER if set(self.excluded) & set(self.conflicts.held) else Reason.MEMBER_EXCLUDED
        return _Outcome(Phase.DEGRADED, outcome.stage, reason,
                        f"Every other workload runs configuration {self.desired_hash}; left out: {_join(lines)}")

    def _hold_master_rollback(self, restart: MasterRestart, failed: StageName | None,
                              failure: str) -> _Outcome | None:
        """Whether rolling the master back must wait (issue 15): a failure in a target stage
        leaves the master's new settings in place unless that rollback is approved; a failure of
        the master's own stage rolls it back, approved first if `requireApprovalForRestart`.
        Sets `pending_approval` (and `master_kept`) when it holds; returns the outcome when the
        rollback stops here."""
        own_failure = failed is StageName.MASTER
        if restart.approved_by(self.policy.annotations) or (
                own_failure and not self.spec.master.require_approval_for_restart):
            return None
        self.pending_approval = restart.approval_key
        request = restart.approval_request(self.policy.name)
        if own_failure:
            self._set_stage(StageName.MASTER, self.stages[StageName.MASTER].phase,
                            f"{_failure_of(self.stages[StageName.MASTER].message)}; rollback waits for approval:"
                            f" {request}")
            return _Outcome(Phase.AWAITING_APPROVAL, StageName.MASTER, Reason.AWAITING_APPROVAL,
                            f"Stage master failed ({failure}); rolling it back waits for approval: {request}")
        self.master_kept = ("the master keeps its new settings (its own stage succeeded) unless you approve"
                            f" rolling it back: {request}")
        if self.previous.pending_approval != restart.approval_key:
            self.notes.append(EventNote("Normal", Reason.AWAITING_APPROVAL.value, self.master_kept))
        stage = self.stages[StageName.MASTER]
        self.stages[StageName.MASTER] = stage.model_copy(update={"message": self.master_kept})
        return None

    def _rolled_back_message(self, name: StageName, what: str) -> str:
        if name is self.failed_stage:
            return f"{_failure_of(self.stages[name].message)}; {what}"
        return what

    # ---- status ------------------------------------------------------------------------------

    def _set_stage(self, name: StageName, phase: StagePhase, message: str, *,
                   started: bool = False, finished: bool = False) -> None:
        """Move a stage; every transition is announced by an event, in the order it happens."""
        old = self.stages[name]
        if phase is not old.phase and phase is not StagePhase.PENDING:
            self.notes.append(EventNote("Warning" if phase in _WARNING_STAGES else "Normal", f"Stage{phase.value}",
                                        f"Stage {name.value}: {message}"))
        self.stages[name] = old.model_copy(update={
            "phase": phase, "message": message,
            "started_at": self.now if started else old.started_at,
            "finished_at": self.now if finished else (None if started else old.finished_at),
        })

    def _status(self, outcome: _Outcome, desired_hash: str) -> PolicyStatus:
        prev, generation = self.previous, self.policy.generation
        conditions = list(prev.conditions)
        conditions = set_condition(conditions, type_=ConditionType.INVALID.value, status=ConditionStatus.FALSE,
                                   reason=Reason.SPEC_VALID.value, message="The spec is valid and the fleet can run it",
                                   generation=generation, now=self.now)
        ready = outcome.phase is Phase.READY
        progressing = outcome.phase in (Phase.PROGRESSING, Phase.ROLLING_BACK, Phase.ANALYZING)
        degraded = outcome.phase in (Phase.DEGRADED, Phase.ROLLING_BACK)
        for type_, flag in ((ConditionType.READY, ready), (ConditionType.PROGRESSING, progressing)):
            conditions = set_condition(conditions, type_=type_.value, status=_flag(flag), reason=outcome.reason.value,
                                       message=outcome.message, generation=generation, now=self.now)
        conditions = set_condition(conditions, type_=ConditionType.DEGRADED.value, status=_flag(degraded),
                                   reason=outcome.reason.value if degraded else Reason.AS_EXPECTED.value,
                                   message=outcome.message if degraded else "", generation=generation, now=self.now)
        conditions = self._ab_condition(conditions)
        conditions = self._conflict_condition(conditions)
        targets = self._targets() + self._excluded_targets()
        conditions = set_write_condition(conditions, targets, generation=generation, now=self.now)
        conditions = self._load_failure_condition(conditions)
        self.all_targets = targets
        summary = build_target_summary(targets, self.listed_targets)
        return prev.model_copy(update={
            "ab_test": self.ab,
            "phase": outcome.phase,
            "observed_generation": generation,
            "conditions": _ordered(conditions),
            "current_stage": outcome.stage,
            "stages": [self.stages[name] for name in self.order],
            "targets": list(summary.listed),
            "target_counts": list(summary.counts),
            "targets_total": summary.total,
            "targets_omitted": summary.omitted,
            "desired_config_hash": desired_hash,
            "applied_config_hash": self.applied_hash,
            "revision": self.revision,
            "applied_revision": self.applied_revision,
            "failed_stage": self.failed_stage,
            "pending_approval": self.pending_approval,
            "last_transition_time": prev.last_transition_time if prev.phase == outcome.phase else self.now,
            "paused_at": self.paused_at,
            "conflicts": list(self.conflicts.records),
            **_verb_records(self.verb, self.approval, self.now),
        })

    def _load_failure_condition(self, conditions: list[Any]) -> list[Any]:
        """LoadFailuresFailRequests: the vLLM workloads whose failed store loads would fail
        requests (`core.load_failure_policy`), with a Warning event when that list changes."""
        warnings = [w for m in self.fleet.members if m.target is not None and m.obj is not None
                    and (w := load_failure_warning(m.obj, m.container)) is not None]
        conditions, note = set_load_failure_condition(conditions, warnings, listed=MAX_LISTED,
                                                      generation=self.policy.generation, now=self.now)
        if note is not None:
            self.notes.append(note)
        return conditions

    def _ab_condition(self, conditions: list[Any]) -> list[Any]:
        """ABTestConcluded: False while the test measures (why no verdict yet: measuring, no
        data, failed measurements), True once it decided; absent without an A/B test."""
        kind = ConditionType.AB_TEST_CONCLUDED.value
        ab = self.ab
        if ab is None:
            return [c for c in conditions if c.type != kind]
        if ab.phase in (ABTestPhase.DEPLOYING, ABTestPhase.MEASURING):
            reason = (Reason.MEASUREMENT_FAILED if ab.consecutive_errors else
                      Reason.AB_TEST_NO_DATA if ab.verdict == "NoData" else Reason.AB_TEST_MEASURING)
            message = ("Deploying the treatment" if ab.phase is ABTestPhase.DEPLOYING else
                       f"{ab.samples} of {self.spec.rollout.ab_test.min_samples if self.spec.rollout.ab_test else 0}"
                       f" samples; {ab.reason}")
            unbalanced = self._arm_mix()
            if unbalanced is not None:
                message = f"{message}. Warning ({Reason.UNBALANCED_ARMS.value}): {unbalanced}"
            return set_condition(conditions, type_=kind, status=ConditionStatus.FALSE, reason=reason.value,
                                 message=message, generation=self.policy.generation, now=self.now)
        reason = {ABTestPhase.PROMOTING: Reason.AB_TEST_PROMOTING, ABTestPhase.PROMOTED: Reason.AB_TEST_PROMOTED,
                  ABTestPhase.ROLLING_BACK: Reason.AB_TEST_ROLLING_BACK,
                  ABTestPhase.ROLLED_BACK: Reason.AB_TEST_ROLLED_BACK,
                  ABTestPhase.AWAITING_DECISION: Reason.AB_TEST_AWAITING_DECISION}[ab.phase]
        return set_condition(conditions, type_=kind, status=ConditionStatus.TRUE, reason=reason.value,
                             message=f"{ab.verdict} after {ab.samples} samples: {ab.reason}",
                             generation=self.policy.generation, now=self.now)

    def _targets(self) -> list[TargetStatus]:
        result = []
        for member in self.fleet.members:
            stage = self.stages.get(member.stage)
            health = self.health[member.key]
            phase = self._target_phase(member, stage, health)
            result.append(TargetStatus(
                kind=WorkloadKind(member.kind), name=member.name, role=member.stage, phase=phase,
                observed_generation=health.generation, replicas=health.replicas, updated_replicas=health.updated,
                ready_replicas=health.ready, config_hash=template_config_hash(member.obj or {}),
                message=health.message, write_error=self._write_error(member)))
        return result

    def _excluded_targets(self) -> list[TargetStatus]:
        result = []
        for member, why in self.excluded.values():
            health = evaluate_health(member.obj, self._pods()) if member.obj is not None else None
            result.append(TargetStatus(
                kind=WorkloadKind(member.kind), name=member.name, role=member.stage, phase=TargetPhase.EXCLUDED,
                observed_generation=health.generation if health else None,
                replicas=health.replicas if health else None, updated_replicas=health.updated if health else None,
                ready_replicas=health.ready if health else None,
                config_hash=template_config_hash(member.obj) if member.obj is not None else None,
                message=f"left out: {why}"[:32768]))
        return result

    def _target_phase(self, member: Member, stage: StageStatus | None, health: WorkloadHealth) -> TargetPhase:
        stage_phase = stage.phase if stage is not None else StagePhase.PENDING
        if stage_phase in (StagePhase.ROLLING_BACK, StagePhase.ROLLED_BACK, StagePhase.ROLLBACK_FAILED):
            if not self._changed_in_attempt(member):
                return TargetPhase.READY if health.health is Health.COMPLETE else TargetPhase.UPDATING
            restored = not self._rollback_pending(member) and health.health is Health.COMPLETE
            if stage_phase is StagePhase.ROLLBACK_FAILED:
                # Its stage's rollback failed, but this member may be back: verified in the
                # reconcile that ended the rollback (its pods were read), or reported so since.
                previous = self.previous.stage(member.stage)
                verified = previous is not None and previous.phase is StagePhase.ROLLING_BACK
                was = next((t.phase for t in self.previous.targets if (t.kind.value, t.name) == member.key), None)
                return TargetPhase.ROLLED_BACK if restored and (verified or was is TargetPhase.ROLLED_BACK) \
                    else TargetPhase.FAILED
            return TargetPhase.ROLLED_BACK if restored else TargetPhase.ROLLING_BACK
        if health.health is Health.FAILED:
            return TargetPhase.FAILED
        if not self._in_sync(member):
            return TargetPhase.PENDING
        return TargetPhase.READY if health.health is Health.COMPLETE else TargetPhase.UPDATING


@dataclass(frozen=True)
class _Outcome:
    phase: Phase
    stage: StageName | None
    reason: Reason
    message: str


# --------------------------------------------------------------------------------------------
# Refusals and waiting
# --------------------------------------------------------------------------------------------

def _refused(previous: PolicyStatus, policy: PolicyRef, reason: Reason, problems: Sequence[str],
             now: datetime.datetime) -> ReconcilePlan:
    """Phase Invalid: nothing changes in the cluster; the rollout state is kept for later."""
    message = _join(problems)
    conditions = list(previous.conditions)
    conditions = set_condition(conditions, type_=ConditionType.INVALID.value, status=ConditionStatus.TRUE,
                               reason=reason.value, message=message, generation=policy.generation, now=now)
    for type_ in (ConditionType.READY, ConditionType.PROGRESSING):
        conditions = set_condition(conditions, type_=type_.value, status=ConditionStatus.FALSE, reason=reason.value,
                                   message=message, generation=policy.generation, now=now)
    return _held(previous, policy, Phase.INVALID, conditions, now, "Warning", reason, message)


def _waiting_for_workloads(previous: PolicyStatus, policy: PolicyRef, missing: Sequence[str],
                           now: datetime.datetime) -> ReconcilePlan:
    """Phase Pending: the spec is fine, the workloads are not there (yet)."""
    message = "Waiting for " + _join(missing)
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
    verb, approval = _plan_verbs(policy, previous, situation)
    effect = verb.effect if verb is not None else VerbEffect.NONE
    status = previous.model_copy(update={
        "phase": phase, "observed_generation": policy.generation, "conditions": _ordered(conditions),
        "last_transition_time": previous.last_transition_time if previous.phase == phase else now,
        "paused_at": now if effect is VerbEffect.PAUSE else None if effect is VerbEffect.RESUME else previous.paused_at,
        **_verb_records(verb, approval, now),
    })
    old = previous.condition(ConditionType.READY)
    repeated = (previous.phase == phase and previous.observed_generation == policy.generation
                and old is not None and old.reason == reason.value and old.message == message)
    events = () if repeated else (EventNote(event_type, reason.value, message),)
    verb_notes = tuple(d.note() for d in (verb, approval) if d is not None)
    return ReconcilePlan(status=status, events=verb_notes + events, changes=())


def _plan_verbs(policy: PolicyRef, previous: PolicyStatus,
                  situation: VerbSituation) -> tuple[VerbDecision | None, VerbDecision | None]:
    """The verb and approval annotation values not handled yet, decided (None: nothing new)."""
    verb_value = read_new_value(policy.annotations, VERB_ANNOTATION, previous.last_verb)
    approval_value = read_new_value(policy.annotations, APPROVE_MASTER_RESTART_ANNOTATION, previous.last_approval)
    return (plan_verb(verb_value, situation) if verb_value is not None else None,
            plan_approval(approval_value, situation) if approval_value is not None else None)


def _verb_records(verb: VerbDecision | None, approval: VerbDecision | None,
                  now: datetime.datetime) -> dict[str, Any]:
    """Status fields recording the annotation values handled now (each is acted on once)."""
    records: dict[str, Any] = {}
    if verb is not None:
        records["last_verb"] = verb.record(now)
    if approval is not None:
        records["last_approval"] = approval.record(now)
    return records


# --------------------------------------------------------------------------------------------
# Events from phase transitions
# --------------------------------------------------------------------------------------------

def _phase_events(previous: PolicyStatus, status: PolicyStatus) -> list[EventNote]:
    if status.phase == previous.phase:
        return []
    ready = status.condition(ConditionType.READY)
    message = ready.message if ready is not None else ""
    match status.phase:
        case Phase.READY:
            return [EventNote("Normal", Reason.ROLLOUT_COMPLETE.value, message)]
        case Phase.DEGRADED:
            degraded = status.condition(ConditionType.DEGRADED)
            return [EventNote("Warning", degraded.reason if degraded else Reason.ROLLED_BACK.value, message)]
        case Phase.PAUSED:
            return [EventNote("Normal", Reason.PAUSED.value, message)]
        case Phase.AWAITING_APPROVAL:
            return [EventNote("Normal", Reason.AWAITING_APPROVAL.value, message)]
    return []


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------

_CONDITION_ORDER = {t.value: i for i, t in enumerate(
    (ConditionType.READY, ConditionType.PROGRESSING, ConditionType.DEGRADED, ConditionType.INVALID,
     ConditionType.AB_TEST_CONCLUDED))}


def _ordered(conditions: Sequence[Any]) -> list[Any]:
    return sorted(conditions, key=lambda c: _CONDITION_ORDER.get(c.type, len(_CONDITION_ORDER)))


def _flag(value: bool) -> ConditionStatus:
    return ConditionStatus.TRUE if value else ConditionStatus.FALSE


def _join(lines: Sequence[str]) -> str:
    shown = "; ".join(lines[:MAX_LISTED])
    return shown + (f"; and {len(lines) - MAX_LISTED} more" if len(lines) > MAX_LISTED else "")


def _describe_health(items: Sequence[tuple[Member, WorkloadHealth]]) -> str:
    return _join([f"{m.kind}/{m.name}: {h.message}" for m, h in items])


def _failure_of(message: str) -> str:
    """A failed stage's message without what the rollback appended to it."""
    for suffix in ("; rolling back", "; rolled back", "; rollback did not complete", "; rollback waits for approval"):
        message = message.split(suffix)[0]
    return message


def _ts(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------------------------
# Deletion
# --------------------------------------------------------------------------------------------

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
                                "Policy deleted: restoring " + _join([f"{c.kind}/{c.name}" for c in restored])
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
                                             "conditions": _ordered(conditions)})
    return ReleasePlan(events=tuple(events), changes=tuple(changes), pending_approval=pending, status=status)
