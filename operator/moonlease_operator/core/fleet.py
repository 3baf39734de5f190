"""Which workloads a policy covers, and which policy may manage a workload. Pure.

`resolve_fleet` turns the spec's master and targets (named, or by label selector) into the
concrete workloads of the namespace, each with the stage it belongs to. `evaluate_claims`
decides overlaps: a workload belongs to the policy whose label it already carries, else to the
oldest policy that covers it (creation time, then name); a later policy that claims it too is
refused, and changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moonlease_operator.api import LabelSelector, PolicySpec, StageName, WorkloadKind
from moonlease_operator.core.label_index import LabelIndex
from moonlease_operator.core.slots import POLICY_LABEL, managed_by, policy_label_value

WorkloadKey = tuple[str, str]  # (kind, name)
WorkloadIndex = Mapping[str, LabelIndex]
"""kind -> the label index of the namespace's workloads of that kind (`core.label_index`)."""


@dataclass(frozen=True)
class Member:
    """One workload of the fleet, in the stage that rolls it out.

    `obj` is None for a named workload that does not exist. `target` is the index in
    `spec.targets` (None for the master).
    """

    stage: StageName
    kind: str
    name: str
    container: str | None
    target: int | None
    obj: Mapping[str, Any] | None

    @property
    def key(self) -> WorkloadKey:
        return (self.kind, self.name)


@dataclass(frozen=True)
class Fleet:
    members: tuple[Member, ...]
    missing: tuple[str, ...]
    """Human lines for named workloads that do not exist and selectors that select nothing."""
    unmatched: tuple[str, ...] = ()
    """The lines of `missing` for selectors that select nothing."""

    def in_stage(self, stage: StageName) -> tuple[Member, ...]:
        return tuple(m for m in self.members if m.stage is stage)

    @property
    def master(self) -> Member:
        return self.members[0]

    @property
    def keys(self) -> frozenset[WorkloadKey]:
        return frozenset(m.key for m in self.members if m.obj is not None)


def resolve_fleet(spec: PolicySpec, workloads: Mapping[WorkloadKey, Mapping[str, Any]],
                  index: WorkloadIndex | None = None) -> Fleet:
    """The master first, then each target's workloads in spec order (a selector's sorted by
    name); a workload claimed twice (a name and a selector) counts once, for the first.
    `index`: narrows each selector's scan to its candidates (same answer, see `select`)."""
    master_key = (spec.master.kind.value, spec.master.name)
    members = [Member(StageName.MASTER, *master_key, spec.master.container, None, workloads.get(master_key))]
    missing = [] if workloads.get(master_key) is not None else [f"{master_key[0]}/{master_key[1]} (master) not found"]
    seen = {master_key}
    unmatched: list[str] = []
    for position, target in enumerate(spec.targets):
        stage = StageName(target.role.value)
        if target.name is not None:
            keys = [(target.kind.value, target.name)]
            if workloads.get(keys[0]) is None:
                missing.append(f"{keys[0][0]}/{keys[0][1]} (targets[{position}]) not found")
        else:
            assert target.selector is not None  # the spec's own rule: exactly one of name/selector
            keys = select(target.kind.value, target.selector, workloads, index)
            if not keys:
                missing.append(f"no {target.kind.value} matches the selector of targets[{position}]")
                unmatched.append(missing[-1])
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            members.append(Member(stage, *key, target.container, position, workloads.get(key)))
    return Fleet(tuple(members), tuple(missing), tuple(unmatched))


def select(kind: str, selector: LabelSelector, workloads: Mapping[WorkloadKey, Mapping[str, Any]],
           index: WorkloadIndex | None = None) -> list[WorkloadKey]:
    """The workloads of `kind` that `selector` selects, sorted. Each is checked by the selector
    itself; `index` only says which to check (all of them without one): an index that is ahead
    of `workloads` (the caches moved on while planning) cannot add a workload `workloads` lacks."""
    kind_index = index.get(kind) if index is not None else None
    names = kind_index.candidates(selector) if kind_index is not None else None
    pool = ((kind, n) for n in names) if names is not None else (k for k in workloads if k[0] == kind)
    return sorted(k for k in pool if (obj := workloads.get(k)) is not None
                  and selector.matches((obj.get("metadata") or {}).get("labels") or {}))


def managed_keys(label: str, workloads: Mapping[WorkloadKey, Mapping[str, Any]],
                 index: WorkloadIndex | None = None) -> list[WorkloadKey]:
    """The workloads carrying the policy label value `label` (`slots.policy_label_value`), sorted."""
    if index is None:
        return sorted(k for k, obj in workloads.items() if managed_by(obj) == label)
    pool = ((kind, name) for kind, kind_index in index.items() for name in kind_index.with_label(POLICY_LABEL, label))
    return sorted(k for k in pool if (obj := workloads.get(k)) is not None and managed_by(obj) == label)


@dataclass(frozen=True)
class Claim:
    """Another policy of the namespace and the workloads it covers."""

    name: str
    created: str
    keys: frozenset[WorkloadKey]


def evaluate_claims(*, name: str, created: str, fleet: Fleet, others: Sequence[Claim],
                    workloads: Mapping[WorkloadKey, Mapping[str, Any]]) -> dict[WorkloadKey, str]:
    """Why this policy may not manage some of its workloads, per workload; empty when it may
    manage all."""
    living = {policy_label_value(other.name): other.name for other in others}
    mine = policy_label_value(name)
    problems: dict[WorkloadKey, str] = {}
    for key in sorted(fleet.keys):
        owner = managed_by(workloads[key])
        if owner is not None and owner != mine and owner in living:
            problems[key] = f"{key[0]}/{key[1]} is managed by policy {living[owner]}"
            continue
        earlier = sorted((o.created, o.name) for o in others
                         if key in o.keys and (o.created, o.name) < (created, name))
        if earlier and owner != mine:
            problems[key] = f"{key[0]}/{key[1]} is already claimed by policy {earlier[0][1]}, created earlier"
    return problems


def build_claim(name: str, created: str, spec: PolicySpec,
                workloads: Mapping[WorkloadKey, Mapping[str, Any]], index: WorkloadIndex | None = None) -> Claim:
    return Claim(name=name, created=created, keys=resolve_fleet(spec, workloads, index).keys)


WORKLOAD_KINDS = tuple(kind.value for kind in WorkloadKind)
