"""A dry run (`moonlease plan -f`): what applying a spec would do, decided by the operator's own
planner — the next reconcile's verdict, then every workload the whole rollout would change, and
how. Writes nothing."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moonlease_operator.api import ABTestPhase, ConditionType, Phase, PolicyStatus, StageName, read_spec
from moonlease_operator.core.ab_plan import ABDesign, build_ab_design
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.rollout.admission import Admitted, admit
from moonlease_operator.core.rollout.inputs import Observed, PolicyRef
from moonlease_operator.core.rollout.reconcile import plan_context, plan_reconcile
from moonlease_operator.core.slots import build_update, describe_update


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
    admitted = admit(spec=spec, policy=policy, previous=previous, observed=observed, now=now,
                     prometheus_allowlist=prometheus_allowlist)
    if not isinstance(admitted, Admitted):
        return PolicyPreview(phase=first.status.phase or Phase.PENDING, reason=reason, message=message, refused=True,
                             desired_config_hash=None, events=first.events)
    prepared = plan_context(admitted)
    ab = prepared.spec.rollout.ab_test
    arms = {**({n: "control" for n in ab.control.workloads} if ab else {}),
            **({n: "treatment" for n in ab.treatment.workloads} if ab else {})}
    # The control is held until this configuration's test promotes: until then it changes nothing.
    promoting = (previous.ab_test is not None and previous.ab_test.phase in (ABTestPhase.PROMOTING, ABTestPhase.PROMOTED)
                 and previous.ab_test.config_hash == first.status.desired_config_hash)
    rank = {name: i for i, name in enumerate(prepared.spec.rollout.stages)}
    workloads = []
    for member in sorted(prepared.fleet.members, key=lambda m: (rank.get(m.stage, len(rank)), m.kind, m.name)):
        pending = prepared.pending(prepared.apply_changes(member))
        lines = tuple(line for change in pending for line in describe_update(prepared.object(change), change))
        restarts = False
        for change in pending:
            if change.kind == "ConfigMap":
                continue
            current = prepared.object(change)
            new = build_update(current, change) or current
            restarts = restarts or (new.get("spec") or {}).get("template") != (current.get("spec") or {}).get("template")
        held = arms.get(member.name) == "control" and not promoting
        workloads.append(WorkloadPreview(stage=member.stage, kind=member.kind, name=member.name, changes=lines,
                                         restarts=restarts and not held, arm=arms.get(member.name, ""), held=held,
                                         restarts_if_promoted=restarts and held))
    return PolicyPreview(phase=first.status.phase or Phase.PENDING, reason=reason, message=message, refused=False,
                         desired_config_hash=first.status.desired_config_hash, workloads=tuple(workloads),
                         events=first.events, ab_design=build_ab_design(ab) if ab is not None else None)
