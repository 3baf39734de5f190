"""The planner's inputs and its answer: who the policy is, what to read before planning, what
the cluster showed, and the plan (status, events, changes)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moonlease_operator.api import PolicySpec, PolicySpecError, PolicyStatus, StageName, StagePhase, TargetStatus
from moonlease_operator.core.ab_plan import ABReading, measurement_due
from moonlease_operator.core.changes import WorkloadChange
from moonlease_operator.core.connector_delivery import SettingsReport, settings_config_map_name
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.fleet import WorkloadIndex, WorkloadKey, resolve_fleet
from moonlease_operator.core.label_index import LabelIndex
from moonlease_operator.core.slots import policy_label_value
from moonlease_operator.core.target_summary import DEFAULT_LISTED_TARGETS


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
    the policy changed but no longer names (renamed) is given back (`orphans`)."""


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
