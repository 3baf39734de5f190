"""The `MooncakeLeasePolicy` status: phases, conditions and their reasons, stages and targets.

What the operator writes and `kubectl get`/`describe` shows, by Kubernetes API conventions
(`observedGeneration`, conditions with a reason and a message). Pure pydantic models, like the
spec's (`api.policy`); the CRD's status schema is generated from them.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Annotated

from pydantic import Field

from moonlease_operator.api.abtest_status import ABTestStatus
from moonlease_operator.api.common import Condition, ObjectName, StatusModel
from moonlease_operator.api.policy import StageName, Verb, VerbOutcome, WorkloadKind


class Phase(str, enum.Enum):
    """The policy's phase, for humans and `kubectl get`; conditions carry the detail.

    Pending: accepted, waiting for its workloads to exist. Progressing: a stage is rolling out.
    AwaitingApproval: the master stage waits for approval of a restart. Paused: held by
    `spec.rollout.paused` before a stage. Analyzing: an A/B test measures its arms.
    AwaitingDecision: an A/B test ended and holds for a human. Ready: every stage runs the
    policy, verified.
    RollingBack: a stage failed and changed stages are being restored. Degraded: a stage failed
    (rolled back, or halted by `onFailure: halt`). Invalid: refused (spec, compatibility, overlap).
    """

    PENDING = "Pending"
    PROGRESSING = "Progressing"
    AWAITING_APPROVAL = "AwaitingApproval"
    PAUSED = "Paused"
    ANALYZING = "Analyzing"
    AWAITING_DECISION = "AwaitingDecision"
    READY = "Ready"
    ROLLING_BACK = "RollingBack"
    DEGRADED = "Degraded"
    INVALID = "Invalid"


class ConditionType(str, enum.Enum):
    """Condition types the operator sets."""

    READY = "Ready"
    INVALID = "Invalid"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    AB_TEST_CONCLUDED = "ABTestConcluded"
    WRITE_FAILED = "WriteFailed"
    CONFLICTING_WRITER = "ConflictingWriter"
    LOAD_FAILURES_FAIL_REQUESTS = "LoadFailuresFailRequests"
    EVICT_ON_SHARED_STORE = "EvictOnSharedStore"


class Reason(str, enum.Enum):
    """Condition and event reasons (CamelCase, as the API requires)."""

    # Acceptance (Invalid condition)
    SPEC_VALID = "SpecValid"
    INVALID_SPEC = "InvalidSpec"
    INCOMPATIBLE = "Incompatible"
    CONFLICTING_POLICY = "ConflictingPolicy"
    FOREIGN_CONNECTOR = "ForeignConnector"
    UNMANAGEABLE_WORKLOAD = "UnmanageableWorkload"
    PROMETHEUS_URL_NOT_ALLOWED = "PrometheusUrlNotAllowed"
    MISMATCHED_ARMS = "MismatchedArms"
    OVERLAPPING_WINDOWS = "OverlappingQueryWindows"
    COUNTER_WITHOUT_RATE = "CounterWithoutRate"
    IDENTICAL_ARM_SELECTORS = "IdenticalArmSelectors"
    WORKLOAD_NOT_FOUND = "WorkloadNotFound"
    # Rollout (Ready, Progressing, Degraded conditions; events)
    ROLLOUT_STARTED = "RolloutStarted"
    STAGE_PROGRESSING = "StageProgressing"
    STAGE_SUCCEEDED = "StageSucceeded"
    STAGE_SKIPPED = "StageSkipped"
    STAGE_FAILED = "StageFailed"
    STAGE_ROLLING_BACK = "StageRollingBack"
    STAGE_ROLLED_BACK = "StageRolledBack"
    STAGE_ROLLBACK_FAILED = "StageRollbackFailed"
    STAGE_AWAITING_APPROVAL = "StageAwaitingApproval"
    STAGE_DRIFTED = "StageDrifted"  # a finished stage's workloads or settings changed under it
    MASTER_RESTART = "MasterRestart"
    AWAITING_APPROVAL = "AwaitingApproval"
    PAUSED = "Paused"
    PAUSE_BETWEEN_STAGES = "PauseBetweenStages"
    ROLLOUT_COMPLETE = "RolloutComplete"
    ROLLING_BACK = "RollingBack"
    ROLLED_BACK = "RolledBack"
    ROLLBACK_INCOMPLETE = "RollbackIncomplete"
    HALTED = "Halted"
    AS_EXPECTED = "AsExpected"
    RELEASED = "Released"
    RESTORED = "Restored"
    SETTINGS_NOT_VERIFIED = "SettingsNotVerified"  # a pod's connector does not report the settings
    MEMBER_EXCLUDED = "MemberExcluded"
    WRITE_REFUSED = "WriteRefused"
    CONFLICTING_WRITER = "ConflictingWriter"  # another writer keeps reverting what the operator wrote
    NO_CONFLICTING_WRITER = "NoConflictingWriter"
    LOAD_FAILURE_POLICY_FAIL = "LoadFailurePolicyFail"  # a warning: a failed store load fails requests
    EVICT_ON_SHARED_STORE = "EvictOnSharedStore"  # a warning: per-engine evict beside other engines
    # A/B test (ABTestConcluded condition; events)
    AB_TEST_STARTED = "ABTestStarted"
    AB_TEST_MEASURING = "ABTestMeasuring"
    AB_TEST_VERDICT = "ABTestVerdict"
    AB_TEST_NO_DATA = "ABTestNoData"
    MEASUREMENT_FAILED = "MeasurementFailed"
    AB_TEST_PROMOTING = "ABTestPromoting"
    AB_TEST_PROMOTED = "ABTestPromoted"
    AB_TEST_ROLLING_BACK = "ABTestRollingBack"
    AB_TEST_ROLLED_BACK = "ABTestRolledBack"
    AB_TEST_AWAITING_DECISION = "ABTestAwaitingDecision"
    UNBALANCED_ARMS = "UnbalancedArms"  # a warning: the arms' prefill/decode mixes differ
    # Verbs (events; the Paused and Degraded conditions)
    VERB_APPLIED = "VerbApplied"
    VERB_IGNORED = "VerbIgnored"
    PAUSED_BY_VERB = "PausedByVerb"


class StagePhase(str, enum.Enum):
    """Progress of one rollout stage."""

    PENDING = "Pending"
    AWAITING_APPROVAL = "AwaitingApproval"
    PROGRESSING = "Progressing"
    SUCCEEDED = "Succeeded"
    SKIPPED = "Skipped"
    FAILED = "Failed"
    ROLLING_BACK = "RollingBack"
    ROLLED_BACK = "RolledBack"
    ROLLBACK_FAILED = "RollbackFailed"


class TargetPhase(str, enum.Enum):
    """Progress of one workload."""

    PENDING = "Pending"
    UPDATING = "Updating"
    READY = "Ready"
    FAILED = "Failed"
    ROLLING_BACK = "RollingBack"
    ROLLED_BACK = "RolledBack"
    EXCLUDED = "Excluded"


class StageStatus(StatusModel):
    """Progress of one stage of the current rollout."""

    name: StageName
    """The stage."""
    phase: StagePhase
    """Where the stage is: Pending, AwaitingApproval, Progressing, Succeeded, Skipped (nothing
    to change), Failed, RollingBack, RolledBack, RollbackFailed."""
    started_at: datetime | None = None
    """When the stage (or its rollback) started; the stage timeout counts from here."""
    finished_at: datetime | None = None
    """When the stage succeeded, failed or was rolled back; the pause between stages counts
    from here."""
    message: Annotated[str, Field(max_length=32768)] = ""
    """What the stage is doing or why it ended so."""


class TargetStatus(StatusModel):
    """Progress of one workload (a selector target yields one entry per selected workload)."""

    kind: WorkloadKind
    """Kind of the workload."""
    name: ObjectName
    """Name of the workload."""
    role: StageName
    """The stage the workload belongs to (master, prefill or decode)."""
    phase: TargetPhase
    """Pending (not changed yet), Updating (rolling out), Ready (runs the policy, verified),
    Failed, RollingBack, RolledBack, Excluded (left out after the first rollout: deleted, claimed
    by another policy or unmanageable, see message; the others carry on)."""
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    """The workload's metadata.generation when last observed."""
    replicas: Annotated[int, Field(ge=0)] | None = None
    """Desired replicas."""
    updated_replicas: Annotated[int, Field(ge=0)] | None = None
    """Replicas on the current pod template, as the workload's controller reports."""
    ready_replicas: Annotated[int, Field(ge=0)] | None = None
    """Ready replicas, as the workload's controller reports."""
    config_hash: Annotated[str, Field(max_length=128)] | None = None
    """The configuration-hash annotation of the workload's pod template."""
    message: Annotated[str, Field(max_length=32768)] = ""
    """Why the workload is in this phase."""
    write_error: Annotated[str, Field(max_length=4096)] | None = None
    """The last change of this workload (or of the master's ConfigMap) the API server refused:
    HTTP status, reason and message; cleared once the change is written."""


class TargetCount(StatusModel):
    """How many of the policy's workloads of one stage are in one phase."""

    role: StageName
    """The stage (master, prefill or decode)."""
    phase: TargetPhase
    """The workloads' phase."""
    count: Annotated[int, Field(ge=0)]
    """How many workloads of that stage are in that phase."""


class ConflictStatus(StatusModel):
    """A workload another writer keeps reverting (a GitOps tool re-applying its manifest): what
    was reverted, by whom, how often, and until when the operator stops writing it."""

    kind: Annotated[str, Field(max_length=64)]
    """Kind of the reverted object (Deployment, StatefulSet or ConfigMap)."""
    name: ObjectName
    """Name of the reverted object."""
    field: Annotated[str, Field(max_length=1024)]
    """The first field the operator wrote that was found reverted (a Kubernetes field path)."""
    manager: Annotated[str, Field(max_length=256)] | None = None
    """The field manager (metadata.managedFields) that last wrote that part of the object
    other than the operator; unset where the API server recorded none."""
    reverts: Annotated[int, Field(ge=0)]
    """Reverts counted in a row, each within the backoff of the one before."""
    last_reverted_at: datetime
    """When the operator last found the field reverted."""
    backoffs: Annotated[int, Field(ge=0)] = 0
    """Backoffs taken in a row (each twice as long as the one before, up to eight times the
    operator's `--conflict-backoff`)."""
    backoff_until: datetime | None = None
    """Until when the operator leaves the object alone; unset when it is not backing off."""


class VerbRecord(StatusModel):
    """The last value of a verb (or approval) annotation the operator handled, and what it did."""

    verb: Verb | None = None
    """promote, abort, pause, resume, retry or approve; unset when the value named no verb."""
    value: Annotated[str, Field(max_length=256)]
    """The annotation's value as handled; the same value is never acted on twice."""
    outcome: VerbOutcome
    """Applied, or Ignored (the message says why)."""
    message: Annotated[str, Field(max_length=1024)] = ""
    """What the verb did, or why it was ignored."""
    handled_at: datetime
    """When the operator handled it."""


class PolicyStatus(StatusModel):
    """Observed state of the policy, written only by the operator."""

    phase: Phase | None = None
    """Summary for humans; the conditions carry the detail."""
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    """The metadata.generation this status describes."""
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Ready, Progressing, Degraded and Invalid, each with a reason and a message."""
    current_stage: StageName | None = None
    """The stage now rolling out (or the last one that ran)."""
    stages: list[StageStatus] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """Progress of each stage of the current rollout, in rollout order."""
    targets: list[TargetStatus] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["kind", "name"]},
    )
    """The workloads that need attention — any phase but Ready, or a refused write — at most the
    operator's `--listed-targets` (default 20), refused writes and failures first, then in fleet
    order (the master first). The whole fleet is counted in `targetCounts`; every workload's own
    state is on its annotations (`moonlease status NAME --targets`)."""
    target_counts: list[TargetCount] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["role", "phase"]},
    )
    """Every workload of the policy, counted per stage and phase (bounded whatever the fleet size)."""
    targets_total: Annotated[int, Field(ge=0)] | None = None
    """How many workloads the policy covers (the master included)."""
    targets_omitted: Annotated[int, Field(ge=0)] | None = None
    """Workloads that need attention but are not listed in `targets` (over the limit)."""
    desired_config_hash: Annotated[str, Field(max_length=128)] | None = None
    """Hash of the configuration the current rollout applies (master settings and connector)."""
    applied_config_hash: Annotated[str, Field(max_length=128)] | None = None
    """Hash of the configuration last rolled out to every stage and verified."""
    revision: Annotated[int, Field(ge=0)] | None = None
    """Number of the current rollout attempt; workloads record it with their rollback data."""
    applied_revision: Annotated[int, Field(ge=0)] | None = None
    """The last rollout attempt that completed (what a later rollback returns to)."""
    failed_stage: StageName | None = None
    """The stage whose failure degraded the policy, if any."""
    pending_approval: Annotated[str, Field(max_length=128)] | None = None
    """Master settings hash waiting for approval of the master restart: approve with
    `kubectl annotate mlp NAME moonlease.io/approve-master-restart=<this value>`."""
    last_transition_time: datetime | None = None
    """When `phase` last changed."""
    ab_test: ABTestStatus | None = None
    """The A/B test of the current configuration (strategy ABTest only)."""
    paused_at: datetime | None = None
    """Set by the `pause` verb (until `resume`): the operator starts no stage, verifies and times
    out none, takes no A/B measurement and acts on no verdict; a rollback is never paused."""
    last_verb: VerbRecord | None = None
    """The last `moonlease.io/verb` annotation handled."""
    last_approval: VerbRecord | None = None
    """The last `moonlease.io/approve-master-restart` value handled."""
    conflicts: list[ConflictStatus] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["kind", "name"]},
    )
    """Objects found reverted by another writer after the operator wrote them (at most 20):
    after `--conflict-reverts` reverts in a row the operator stops writing the object for a
    backoff, says so in the `ConflictingWriter` condition and a warning event, then tries once
    more."""

    def condition(self, type_: ConditionType | str) -> Condition | None:
        """The condition of this type, if set."""
        wanted = type_.value if isinstance(type_, ConditionType) else type_
        return next((c for c in self.conditions if c.type == wanted), None)

    def stage(self, name: StageName) -> StageStatus | None:
        """The status of this stage, if the current rollout has it."""
        return next((s for s in self.stages if s.name == name), None)
