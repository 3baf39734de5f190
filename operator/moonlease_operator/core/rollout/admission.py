"""Whether the fleet can run the policy at all: the refusals (invalid spec, A/B arms that cannot
be compared, a Prometheus URL not allowed, a conflicting policy, unmanageable or incompatible
workloads) and the waits (workloads or the master's file missing) come first; what is left is
an `Admitted` policy, its fleet and settings, that the reconcile plans for."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from moonlease_operator.api import PolicySpec, PolicySpecError, PolicyStatus, Reason, StageName, parse_spec
from moonlease_operator.core.ab_spec_checks import (
    evaluate_arm_roles,
    evaluate_arm_selectors,
    evaluate_custom_query_counters,
    evaluate_custom_query_windows,
)
from moonlease_operator.core.compatibility import VersionSource, container_image, evaluate_compatibility
from moonlease_operator.core.fleet import Claim, Fleet, Member, WorkloadKey, build_claim, evaluate_claims, resolve_fleet
from moonlease_operator.core.manageability import evaluate_config_map, evaluate_master, evaluate_target
from moonlease_operator.core.rollout.held import refused, waiting_for_workloads
from moonlease_operator.core.rollout.inputs import Observed, PolicyRef, ReconcilePlan
from moonlease_operator.core.settings import (
    ConnectorSettings,
    MasterSettings,
    build_connector_settings,
    build_master_settings,
)
from moonlease_operator.core.url_allowlist import evaluate_prometheus_url


@dataclass(frozen=True)
class Admitted:
    """A policy the fleet can run: its spec, the cluster as observed, the fleet it covers (what
    is left out removed) and the settings it wants."""

    spec: PolicySpec
    policy: PolicyRef
    previous: PolicyStatus
    observed: Observed
    now: datetime.datetime
    fleet: Fleet
    connector: ConnectorSettings
    master: MasterSettings
    excluded: Mapping[WorkloadKey, tuple[Member, str]] = field(default_factory=dict)
    """Targets left out of this plan, each with why (deleted, claimed, unmanageable): reported on
    the target; the rest carries on, and the policy cannot be Ready meanwhile."""


def admit(*, spec: PolicySpec | PolicySpecError, policy: PolicyRef, previous: PolicyStatus, observed: Observed,
          now: datetime.datetime, prometheus_allowlist: Sequence[str] | None) -> ReconcilePlan | Admitted:
    """The refusals and waits (a finished plan), or the policy the fleet can run."""
    if isinstance(spec, PolicySpecError):
        return refused(previous, policy, Reason.INVALID_SPEC, spec.problems, now)
    mismatched = evaluate_arm_roles(spec)
    if mismatched is not None:
        return refused(previous, policy, Reason.MISMATCHED_ARMS, [mismatched], now)
    for reason, evaluate in ((Reason.OVERLAPPING_WINDOWS, evaluate_custom_query_windows),
                             (Reason.COUNTER_WITHOUT_RATE, evaluate_custom_query_counters),
                             (Reason.IDENTICAL_ARM_SELECTORS, evaluate_arm_selectors)):
        refusal = evaluate(spec)
        if refusal is not None:
            return refused(previous, policy, reason, [refusal], now)
    ab_source = spec.rollout.ab_test.prometheus if spec.rollout.ab_test is not None else None
    if prometheus_allowlist is not None and ab_source is not None:
        not_allowed = evaluate_prometheus_url(ab_source.url, prometheus_allowlist)
        if not_allowed is not None:
            return refused(previous, policy, Reason.PROMETHEUS_URL_NOT_ALLOWED, [not_allowed], now)

    # Before the first rollout a problem refuses the whole policy (nothing changes); once it has
    # rolled out, a problem with one target is reported on that target and the rollout,
    # rollback or drift repair goes on for the rest. The master is never optional.
    started = previous.revision is not None
    fleet = resolve_fleet(spec, observed.workloads, observed.index)
    if fleet.missing and (not started or fleet.master.obj is None):
        return waiting_for_workloads(previous, policy, fleet.missing, now)
    claims = evaluate_claims(name=policy.name, created=policy.created, fleet=fleet,
                             others=_other_claims(policy, observed), workloads=observed.workloads)
    master_key = fleet.master.key
    if claims and (not started or master_key in claims):
        return refused(previous, policy, Reason.CONFLICTING_POLICY, list(claims.values()), now)

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
            return waiting_for_workloads(previous, policy, [f"ConfigMap/{master.config_map.name} (master) not found"],
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
            return refused(previous, policy, reason, problems[reason], now)
    if excluded:
        fleet = Fleet(tuple(m for m in fleet.members if m.key not in excluded), fleet.missing, fleet.unmatched)
    left_out = {key: (members[key], why) for key, why in excluded.items()}

    return Admitted(spec=spec, policy=policy, previous=previous, observed=observed, now=now,
                    fleet=fleet, connector=connector, master=master, excluded=left_out)


def _other_claims(policy: PolicyRef, observed: Observed) -> list[Claim]:
    """What the namespace's other valid policies claim (a refused policy claims nothing)."""
    claims = []
    for raw in observed.policies:
        meta = raw.get("metadata") or {}
        if meta.get("name") == policy.name:
            continue
        try:
            other = parse_spec(raw.get("spec") or {})
        except PolicySpecError:
            continue
        claims.append(build_claim(meta.get("name", ""), meta.get("creationTimestamp", ""), other, observed.workloads,
                                  observed.index))
    return claims
