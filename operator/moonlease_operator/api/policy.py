"""The `MooncakeLeasePolicy` custom resource's spec: with `api.status`, the single source of
truth for its CRD.

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
from typing import Annotated, Any, ClassVar

from pydantic import Field, ValidationError, model_validator

# One vocabulary for the CRD and the connector's settings; each mode's needs on its strategy.
from moonlease_settings.lease_modes import STRATEGIES, LeaseMode

from moonlease_operator.api.abtest import ABTestSpec
from moonlease_operator.api.common import (
    ApiModel,
    CelRule,
    ContainerName,
    LabelSelector,
    ObjectName,
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
    its saves and loads touched least recently, so conversations leave whole and oldest first
    instead of by the master's near-random first eviction pass. Needs master.evictionHighWatermarkRatio
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
