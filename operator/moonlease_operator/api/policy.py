"""The `MooncakeLeasePolicy` custom resource: the single source of truth for its CRD.

A policy declares how Mooncake store leases are taken across one disaggregated vLLM fleet:
the master's eviction and lease settings, the connector's lease mode in every vLLM workload,
and the order in which changes are rolled out (master, then prefill, then decode by default).

Pure: no kopf, no Kubernetes client. `moonlease_operator.crd` turns these models into the
CRD's structural schema; `parse_spec` is how the operator reads a spec (strict JSON types, the
same checks as the schema plus the CEL rules, which the API server evaluates and we mirror).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, ClassVar

from pydantic import Field, ValidationError, model_validator

# One vocabulary for the CRD and the connector's settings; each mode's needs on its strategy.
from moonlease_settings.lease_modes import STRATEGIES, LeaseMode

from moonlease_operator.api.abtest import ABTestSpec, ABTestStatus
from moonlease_operator.api.common import (
    ApiModel,
    CelRule,
    Condition,
    ContainerName,
    LabelSelector,
    ObjectName,
    StatusModel,
)

GROUP = "moonlease.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MooncakeLeasePolicy"
PLURAL = "mooncakeleasepolicies"
SINGULAR = "mooncakeleasepolicy"
SHORT_NAMES = ("mlp",)
CATEGORIES = ("moonlease",)

#: Mooncake versions as the wheels name them: 0.3.13, 0.3.13.post1, 0.3.14.dev20261022, v0.3.14.
MooncakeVersion = Annotated[
    str, Field(max_length=64, pattern=r"^v?[0-9]+\.[0-9]+\.[0-9]+([.+-][0-9A-Za-z.+-]+)?$")
]
Ratio = Annotated[float, Field(gt=0, le=1)]
Milliseconds = Annotated[int, Field(ge=1)]


class WorkloadKind(str, enum.Enum):
    """The workload controllers the operator can roll out."""

    DEPLOYMENT = "Deployment"
    STATEFUL_SET = "StatefulSet"


class Role(str, enum.Enum):
    """The disaggregation role of a vLLM workload."""

    PREFILL = "prefill"
    DECODE = "decode"


class MasterDeletionPolicy(str, enum.Enum):
    """What deleting the policy does to the master's settings."""

    KEEP = "keep"
    RESTORE = "restore"


class StageName(str, enum.Enum):
    """A rollout stage: the master, or every target of one role."""

    MASTER = "master"
    PREFILL = "prefill"
    DECODE = "decode"


class RolloutStrategy(str, enum.Enum):
    """How a change reaches the fleet: `Staged` (every target, stage by stage) or `ABTest` (the
    treatment's targets first, measured against the control's, then promoted or rolled back)."""

    STAGED = "Staged"
    AB_TEST = "ABTest"


class FailurePolicy(str, enum.Enum):
    """What a failed stage does to the stages already rolled out."""

    ROLLBACK = "rollback"
    HALT = "halt"


DEFAULT_STAGES: tuple[StageName, ...] = (StageName.MASTER, StageName.PREFILL, StageName.DECODE)


#: Annotation on the policy that approves one master restart: its value must equal
#: `status.pendingApproval` (the hash of the master settings waiting to be applied).
APPROVE_MASTER_RESTART_ANNOTATION = f"{GROUP}/approve-master-restart"
#: Annotation deciding an A/B test that awaits a human: `promote:<hash>` or `rollback:<hash>`,
#: `<hash>` being `status.abTest.configHash` (so a stale annotation never decides a later test).
AB_DECISION_ANNOTATION = f"{GROUP}/ab-decision"
#: Annotation carrying one verb for the operator (`moonlease promote|abort|pause|resume|retry
#: NAME` writes it): `<verb>:<revision>:<desiredConfigHash>`, the key being the rollout the
#: person saw in the status, so a verb written for an earlier attempt or spec is ignored (with an
#: event). Each value is acted on once: `status.lastVerb` records it.
VERB_ANNOTATION = f"{GROUP}/verb"


class Verb(str, enum.Enum):
    """What a person can tell the operator at any time (issue 17). `approve` is not written to
    the verb annotation: it sets the approval annotation to `status.pendingApproval`."""

    PROMOTE = "promote"
    ABORT = "abort"
    PAUSE = "pause"
    RESUME = "resume"
    RETRY = "retry"
    APPROVE = "approve"


class VerbOutcome(str, enum.Enum):
    """What the operator did with a verb."""

    APPLIED = "Applied"
    IGNORED = "Ignored"

ConfigMapKey = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]


class MasterConfigMapSpec(ApiModel):
    """A ConfigMap holding mooncake_master's config file (read with --config_path)."""

    name: ObjectName
    """Name of the ConfigMap, in the policy's namespace."""
    key: ConfigMapKey
    """Key of the config file in the ConfigMap; `.yaml`/`.yml` keys are written as YAML, any
    other as JSON. The settings are written under Mooncake's flag names."""


class MasterSpec(ApiModel):
    """The Mooncake master workload and the settings the operator manages on it.

    Each setting is a master flag under its camelCase name; an unset one leaves the flag as the
    workload has it (Mooncake's default if absent). The settings go into the master container's
    args (`--flag=value`), or into its config file when `configMap` is set; a change restarts
    the master through its workload's rolling update, which empties the store.
    """

    kind: WorkloadKind = WorkloadKind.DEPLOYMENT
    """Kind of the master workload."""
    name: ObjectName
    """Name of the master workload, in the policy's namespace."""
    container: ContainerName | None = None
    """Container running mooncake_master; defaults to the only (or first) container."""
    version: MooncakeVersion | None = None
    """Declared Mooncake version of the master (e.g. 0.3.14); checked against what modes need."""
    require_approval_for_restart: bool = True
    """Restarting the master empties the store (object metadata lives in its memory): while true
    (the default), every master restart the operator would cause (rolling settings out, a drift
    repair, rolling back its own failed stage, restoring it on deletion) waits for an explicit
    approval of exactly that restart: annotate the policy with moonlease.io/approve-master-restart
    set to status.pendingApproval (direction:revision:hash)."""
    on_delete: MasterDeletionPolicy = MasterDeletionPolicy.KEEP
    """What deleting the policy does to the master: keep (its settings stay as the policy left
    them, no restart) or restore (its settings from before the policy come back, which restarts
    it: approved like any other restart)."""
    eviction_high_watermark_ratio: Ratio | None = None
    """--eviction_high_watermark_ratio: usage ratio above which eviction runs (Mooncake: 0.9)."""
    eviction_ratio: Ratio | None = None
    """--eviction_ratio: share of objects evicted per eviction pass (Mooncake: 0.05)."""
    default_kv_lease_ttl_ms: Milliseconds | None = None
    """--default_kv_lease_ttl, in milliseconds (Mooncake: 10000)."""
    default_kv_soft_pin_ttl_ms: Milliseconds | None = None
    """--default_kv_soft_pin_ttl, in milliseconds (Mooncake: 1800000)."""
    allow_evict_soft_pinned_objects: bool | None = None
    """--allow_evict_soft_pinned_objects (Mooncake: true)."""
    config_map: MasterConfigMapSpec | None = None
    """Write the settings into this ConfigMap's config file instead of the container args; the
    master's pod template then gets a configuration-hash annotation so that it restarts."""


#: Python field -> mooncake_master flag. The only place the two spellings meet.
MASTER_FLAGS: Mapping[str, str] = {
    "eviction_high_watermark_ratio": "eviction_high_watermark_ratio",
    "eviction_ratio": "eviction_ratio",
    "default_kv_lease_ttl_ms": "default_kv_lease_ttl",
    "default_kv_soft_pin_ttl_ms": "default_kv_soft_pin_ttl",
    "allow_evict_soft_pinned_objects": "allow_evict_soft_pinned_objects",
}


#: The master flags that are booleans (gflags also spells them `--flag` and `--noflag`), derived
#: from the spec's field types so that a new boolean setting needs no second list.
BOOLEAN_MASTER_FLAGS: frozenset[str] = frozenset(
    flag for field, flag in MASTER_FLAGS.items() if MasterSpec.model_fields[field].annotation in (bool, bool | None)
)


def build_master_flags(master: MasterSpec) -> dict[str, str]:
    """The declared master settings as `mooncake_master` flag values (unset ones left out).

    Pure. Booleans are spelled as gflags expects (`true`/`false`).
    """
    flags: dict[str, str] = {}
    for field, flag in MASTER_FLAGS.items():
        value = getattr(master, field)
        if value is None:
            continue
        flags[flag] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return flags


class ConnectorSpec(ApiModel):
    """Settings of the patched MooncakeStoreConnector in every target."""

    lease_mode: LeaseMode = LeaseMode.LEASE_ALL
    """Which keys a lookup leases: leaseAll (every key found, vLLM's default), selective (only
    the keys loading the hit reads; Mooncake >= 0.3.14), lastHitOnly (only the selected recurrent
    checkpoint; hybrid models only)."""
    junction_retention: bool = False
    """Keep sliding-window tails at shared-prefix junctions in the store, so siblings of a prompt
    hit the store from a fresh instance."""
    retention_pin: bool = False
    """Moonlease retention: saves soft-pin the prompt's shared prefix (the deepest prefix four
    different continuations have followed: a system prompt, a branch point) and leave the rest
    unpinned, so the master evicts the rest first; pins expire defaultKvSoftPinTtlMs after the
    last read. Needs the master's allowEvictSoftPinnedObjects (Mooncake's default, true)."""
    retention_skip: bool = False
    """Moonlease retention: saves do not write sliding-window blocks or recurrent (Mamba) states
    that no continuation of the prompt loads (dense retention's intermediate states)."""
    retention_retry: bool = False
    """Moonlease retention: keys a save's put was refused for lack of space (NO_AVAILABLE_HANDLE)
    are put again once the master has evicted (up to 3 times, 20 ms apart) instead of being
    dropped; Mamba states only where a continuation resumes, not dense retention's
    intermediate ones. Needs nothing from the master."""
    retention_evict: bool = False
    """Moonlease retention: before a save's put would take the store above the master's
    evictionHighWatermarkRatio (read from the master's metrics), the connector removes the keys
    its saves touched least recently, so conversations leave whole and oldest first instead of
    by the master's near-random first eviction pass. Needs master.evictionHighWatermarkRatio
    declared (the connector keeps the store under it) and the master's metrics reachable from
    the engines (mooncake_master_metrics_url, default http://<master host>:9003/metrics)."""


_ONE_OF_NAME_SELECTOR = CelRule(
    rule="has(self.name) != has(self.selector)",
    message="exactly one of name or selector must be set",
)


class TargetSpec(ApiModel):
    """One vLLM workload (or a set of them, by selector) that runs the connector."""

    name: ObjectName | None = None
    """Name of the workload, in the policy's namespace."""
    selector: LabelSelector | None = None
    """Label selector over workloads of `kind` in the policy's namespace."""
    kind: WorkloadKind = WorkloadKind.DEPLOYMENT
    """Kind of the workload(s)."""
    role: Role
    """Disaggregation role; decides the rollout stage the workload belongs to."""
    container: ContainerName | None = None
    """Container running vLLM; defaults to the only (or first) container."""
    hybrid: bool = False
    """Declares a hybrid model: full attention + Mamba in align mode (needed by lastHitOnly)."""
    mooncake_version: MooncakeVersion | None = None
    """Declared Mooncake client version in the vLLM image."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (_ONE_OF_NAME_SELECTOR,)

    @model_validator(mode="after")
    def _check_name_or_selector(self) -> TargetSpec:
        if (self.name is None) == (self.selector is None):
            raise _ONE_OF_NAME_SELECTOR.violation()
        return self


_AB_TEST_CONFIGURED = CelRule(
    rule="(self.strategy == 'ABTest') == has(self.abTest)",
    message="abTest must be set exactly when strategy is ABTest",
    field_path=".abTest",
)
_UNIQUE_STAGES = CelRule(
    rule="self.stages.all(s, self.stages.filter(t, t == s).size() == 1)",
    message="each stage may appear only once",
    field_path=".stages",
)
_MASTER_STAGED = CelRule(
    rule="'master' in self.stages",
    message="stages must include master",
    field_path=".stages",
)


class RolloutSpec(ApiModel):
    """How a change of the policy reaches the workloads."""

    strategy: RolloutStrategy = RolloutStrategy.STAGED
    """Rollout strategy; Staged updates one stage at a time."""
    stages: Annotated[list[StageName], Field(min_length=1, max_length=3)] = Field(
        default_factory=lambda: list(DEFAULT_STAGES),
        json_schema_extra={"x-kubernetes-list-type": "atomic", "default": [s.value for s in DEFAULT_STAGES]},
    )
    """Order of the stages; each stage waits for the previous one to be ready."""
    stage_timeout_seconds: Annotated[int, Field(ge=1)] = 600
    """A stage not ready within this time has failed."""
    pause_between_stages_seconds: Annotated[int, Field(ge=0)] = 0
    """Soak time after a stage is ready before the next one starts."""
    paused: bool = False
    """Hold the rollout where it is (a running stage is not interrupted)."""
    on_failure: FailurePolicy = FailurePolicy.ROLLBACK
    """On a failed stage: roll every updated workload back, or halt and leave them as they are."""
    ab_test: ABTestSpec | None = None
    """With strategy ABTest: the arms, the analysis and what its verdict does."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (_UNIQUE_STAGES, _MASTER_STAGED, _AB_TEST_CONFIGURED)

    @model_validator(mode="after")
    def _check_stages(self) -> RolloutSpec:
        if len(set(self.stages)) != len(self.stages):
            raise _UNIQUE_STAGES.violation()
        if StageName.MASTER not in self.stages:
            raise _MASTER_STAGED.violation()
        if (self.strategy is RolloutStrategy.AB_TEST) != (self.ab_test is not None):
            raise _AB_TEST_CONFIGURED.violation()
        return self


_ROLES_STAGED = CelRule(
    rule="self.targets.all(t, t.role in self.rollout.stages)",
    message="every target role must have a stage in rollout.stages",
    field_path=".rollout.stages",
)
#: The lease modes whose strategy needs a hybrid model (`moonlease_settings.lease_modes`), in
#: enum order.
HYBRID_MODES = tuple(mode for mode, strategy in STRATEGIES.items() if strategy.needs_hybrid_model)


def _hybrid_modes_rule() -> CelRule:
    """The CEL rule generated from the strategies: a mode that needs a hybrid model needs every
    target declared hybrid."""
    others = " && ".join(f"self.connector.leaseMode != '{mode.value}'" for mode in HYBRID_MODES)
    guard = others if len(HYBRID_MODES) == 1 else f"({others or 'true'})"
    return CelRule(
        rule=f"{guard} || self.targets.all(t, t.hybrid)",
        message=f"leaseMode {' or '.join(m.value for m in HYBRID_MODES)} needs every target to be hybrid"
                " (full attention + align-mode Mamba)",
        field_path=".connector.leaseMode",
    )


_MODE_NEEDS_HYBRID = _hybrid_modes_rule()
_PIN_NEEDS_EVICTABLE_PINS = CelRule(
    rule="!self.connector.retentionPin || !has(self.master.allowEvictSoftPinnedObjects)"
    " || self.master.allowEvictSoftPinnedObjects",
    message="connector.retentionPin needs master.allowEvictSoftPinnedObjects true (Mooncake's default):"
    " with false, pinned objects leave only when their pin expires and puts fail for lack of space",
    field_path=".connector.retentionPin",
)
_EVICT_NEEDS_WATERMARK = CelRule(
    rule="!self.connector.retentionEvict || has(self.master.evictionHighWatermarkRatio)",
    message="connector.retentionEvict keeps the store under the master's eviction watermark:"
    " declare master.evictionHighWatermarkRatio (Mooncake's default is 0.9)",
    field_path=".connector.retentionEvict",
)
# Named targets are picked with filter() first, so no rule reads a name that is absent.
_MASTER_NOT_TARGET = CelRule(
    rule="!self.targets.filter(t, has(t.name)).exists(t, t.name == self.master.name && t.kind == self.master.kind)",
    message="the master workload cannot also be a target",
    field_path=".targets",
)
_UNIQUE_TARGETS = CelRule(
    rule="self.targets.filter(t, has(t.name)).all(a, self.targets.filter(t, has(t.name))"
    ".exists_one(b, b.name == a.name && b.kind == a.kind))",
    message="each named target may appear only once",
    field_path=".targets",
)

_ARMS_ARE_TARGETS = CelRule(
    rule="!has(self.rollout.abTest) || ("
    "self.rollout.abTest.control.workloads.all(w, self.targets.exists(t, has(t.name) && t.name == w))"
    " && self.rollout.abTest.treatment.workloads.all(w, self.targets.exists(t, has(t.name) && t.name == w)))",
    message="every A/B arm workload must be a named target",
    field_path=".rollout.abTest",
)
_TARGETS_IN_ARMS = CelRule(
    rule="!has(self.rollout.abTest) || self.targets.all(t, has(t.name) && ("
    "t.name in self.rollout.abTest.control.workloads || t.name in self.rollout.abTest.treatment.workloads))",
    message="with strategy ABTest every target must be named and in one arm",
    field_path=".targets",
)


class PolicySpec(ApiModel):
    """Desired lease behaviour of one Mooncake store and the vLLM workloads that use it."""

    master: MasterSpec
    """The Mooncake master and its lease and eviction settings."""
    connector: ConnectorSpec = Field(default_factory=ConnectorSpec, json_schema_extra={"default": {}})
    """Connector settings applied to every target."""
    targets: Annotated[list[TargetSpec], Field(min_length=1, max_length=64)] = Field(
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    """The vLLM workloads running the connector."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, json_schema_extra={"default": {}})
    """How changes are rolled out."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        _ROLES_STAGED, _MODE_NEEDS_HYBRID, _MASTER_NOT_TARGET, _UNIQUE_TARGETS, _ARMS_ARE_TARGETS,
        _TARGETS_IN_ARMS, _PIN_NEEDS_EVICTABLE_PINS, _EVICT_NEEDS_WATERMARK,
    )

    @model_validator(mode="after")
    def _check_cross_fields(self) -> PolicySpec:
        if any(StageName(t.role.value) not in self.rollout.stages for t in self.targets):
            raise _ROLES_STAGED.violation()
        if self.connector.lease_mode in HYBRID_MODES and not all(t.hybrid for t in self.targets):
            raise _MODE_NEEDS_HYBRID.violation()
        if self.connector.retention_pin and self.master.allow_evict_soft_pinned_objects is False:
            raise _PIN_NEEDS_EVICTABLE_PINS.violation()
        if self.connector.retention_evict and self.master.eviction_high_watermark_ratio is None:
            raise _EVICT_NEEDS_WATERMARK.violation()
        master = (self.master.kind, self.master.name)
        if any((t.kind, t.name) == master for t in self.targets if t.name is not None):
            raise _MASTER_NOT_TARGET.violation()
        named = [(t.kind, t.name) for t in self.targets if t.name is not None]
        if len(set(named)) != len(named):
            raise _UNIQUE_TARGETS.violation()
        ab = self.rollout.ab_test
        if ab is not None:
            names = {t.name for t in self.targets if t.name is not None}
            if not set(ab.control.workloads) <= names or not set(ab.treatment.workloads) <= names:
                raise _ARMS_ARE_TARGETS.violation()
            arms = set(ab.control.workloads) | set(ab.treatment.workloads)
            if any(t.name is None or t.name not in arms for t in self.targets):
                raise _TARGETS_IN_ARMS.violation()
        return self


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


class PolicySpecError(ValueError):
    """A spec the operator refuses, with one human-readable line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def parse_spec(raw: Mapping[str, Any]) -> PolicySpec:
    """Read a spec as the API server would have checked it, or raise `PolicySpecError`.

    Pure. Parses through JSON in strict mode so that types match the schema exactly ("600" is
    not an integer, 1 is a valid number), then applies the CEL mirrors.
    """
    try:
        return PolicySpec.model_validate_json(json.dumps(dict(raw), default=str), strict=True)
    except ValidationError as exc:
        raise PolicySpecError(describe_errors(exc)) from None


def read_spec(raw: Mapping[str, Any]) -> PolicySpec | PolicySpecError:
    """`parse_spec` with the refusal as a value: a reconcile reads the spec once and hands the
    result (a spec, or why it is refused) to every step that needs it."""
    try:
        return parse_spec(raw)
    except PolicySpecError as exc:
        return exc


def describe_errors(exc: ValidationError) -> list[str]:
    """One line per validation error, located as a kubectl user would write the path."""
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        path = "spec"
        for part in err["loc"]:
            path += f"[{part}]" if isinstance(part, int) else f".{part}"
        lines.append(f"{path}: {err['msg']}")
    return lines
