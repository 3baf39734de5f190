"""`moonlease status NAME`: one screen about a MooncakeLeasePolicy. Pure.

`build_status_view` reads a policy object (as the API server returns it) into a `StatusView`:
phase, stages, a targets summary (the status's counts per phase: the status lists only the
workloads that need attention, issue 16), the A/B arms with their values, effects and bounds,
what the operator is waiting for with the command that unblocks it, the last verb it heard, and
— given the workloads (`--targets`: every workload that carries the policy's label, and those
the status lists) — each target as its own labels and annotations tell it;
`render_status` prints it for a terminal, `StatusView.as_json` for scripts. The command
(moonlease.drive) only fetches the objects.
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ValidationError

from moonlease_operator.api.abtest import ABTestSpec
from moonlease_operator.api.abtest_status import ABTestStatus
from moonlease_operator.core.ab_plan import next_measurement_at

from moonlease_operator.core.slots import (
    ORIGINAL_ANNOTATION,
    managed_by,
    rollback_revision,
    template_config_hash,
)


@dataclass(frozen=True)
class Waiting:
    """What the operator waits for, and the command that unblocks it (None: nothing to do)."""

    on: str
    command: str | None = None


@dataclass(frozen=True)
class StatusView:
    name: str
    namespace: str
    phase: str
    message: str
    stages: list[dict[str, str]] = field(default_factory=list)
    targets: dict[str, int] = field(default_factory=dict)
    ab_test: dict[str, Any] | None = None
    waiting: Waiting | None = None
    last_verb: dict[str, Any] | None = None
    target_details: list[dict[str, Any]] | None = None
    """Per target, from the workload itself (only with --targets)."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


def _waiting(name: str, namespace: str, status: Mapping[str, Any]) -> Waiting | None:
    """The one place a phase becomes "waiting for ... / run ..."."""
    phase = status.get("phase") or "Pending"
    ab = status.get("abTest") or {}
    verb = f"-n {namespace} {name}"
    if status.get("pausedAt") and phase not in ("RollingBack",):
        return Waiting(f"resume (paused by a person since {status['pausedAt']})", f"moonlease resume {verb}")
    if phase == "AwaitingApproval":
        return Waiting(f"approval of a master restart (it empties the store): {status.get('pendingApproval', '')}",
                       f"moonlease approve {verb}")
    if phase == "AwaitingDecision":
        return Waiting(f"a decision on the held A/B test ({ab.get('finalVerdict') or ab.get('verdict')})",
                       f"moonlease promote {verb}   # or: moonlease abort {verb}")
    if phase == "Analyzing":
        what = f"A/B measurements ({ab.get('progress') or ab.get('samples', 0)} samples)"
        if ab.get("verdict") == "Error":
            what += "; the metric source is failing, measuring resumes when it answers"
        return Waiting(what)
    if phase == "Paused":
        return Waiting("spec.rollout.paused", f"kubectl -n {namespace} patch mlp {name} --type=merge "
                       "-p '{\"spec\":{\"rollout\":{\"paused\":false}}}'")
    if phase == "Degraded":
        return Waiting("a retry, or a change of the spec (see the message)",
                       f"moonlease retry {verb}   # or: kubectl -n {namespace} edit mlp {name}")
    if phase == "Invalid":
        return Waiting("a change of the spec (see the message)", f"kubectl -n {namespace} edit mlp {name}")
    if phase in ("Pending", "Progressing", "RollingBack"):
        return Waiting(_condition(status, "Progressing").get("message") or "the workloads")
    return None


def build_target_details(status: Mapping[str, Any],
                         workloads: Mapping[tuple[str, str], Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each target — the ones the status lists, then every other workload in `workloads` (those
    carrying the policy's label) by kind and name — with what its workload's own labels and
    annotations say: the policy that manages it, the configuration hash its pod template
    carries, the rollout attempt its rollback snapshot belongs to, whether its original
    configuration is kept. A workload the status does not list is Ready unless the status says
    it left some out (`targetsOmitted`): then its phase is unknown here ("-")."""
    listed = list(status.get("targets") or [])
    keys = {(t.get("kind", ""), t.get("name", "")) for t in listed}
    unlisted_phase = "-" if status.get("targetsOmitted") else "Ready"
    for kind, name in sorted(k for k in workloads if k not in keys):
        status_obj = (workloads[(kind, name)].get("status") or {})
        listed.append({"kind": kind, "name": name, "role": None, "phase": unlisted_phase,
                       "readyReplicas": status_obj.get("readyReplicas", 0),
                       "replicas": (workloads[(kind, name)].get("spec") or {}).get("replicas", 0)})
    details = []
    for target in listed:
        obj = workloads.get((target.get("kind", ""), target.get("name", "")))
        meta = (obj or {}).get("metadata") or {}
        details.append({
            "kind": target.get("kind"), "name": target.get("name"), "role": target.get("role"),
            "phase": target.get("phase"), "ready": f"{target.get('readyReplicas', 0)}/{target.get('replicas', 0)}",
            "message": target.get("message", ""), "found": obj is not None,
            "managedBy": managed_by(obj or {}), "configHash": template_config_hash(obj or {}),
            "rollbackRevision": rollback_revision(obj or {}),
            "original": ORIGINAL_ANNOTATION in (meta.get("annotations") or {}),
        })
    return details


def _timestamp(value: datetime.datetime | None) -> str | None:
    return None if value is None else value.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_time_axis(policy: Mapping[str, Any], now: datetime.datetime) -> dict[str, Any]:
    """The A/B test's time axis: when measuring started, when the arms were last read, when they
    are read next (the operator's own schedule: the baseline after `warmupSeconds`, then every
    `intervalSeconds`) and in how many seconds, and when the test was decided. Unknown: None."""
    raw = ((policy.get("status") or {}).get("abTest")) or {}
    try:
        status = ABTestStatus.model_validate(raw)
    except ValidationError:
        return {"startedAt": None, "lastReadAt": None, "nextReadAt": None, "nextReadInSeconds": None,
                "nextRead": None, "decidedAt": None}
    try:
        spec: ABTestSpec | None = ABTestSpec.model_validate(
            (((policy.get("spec") or {}).get("rollout") or {}).get("abTest")) or {})
    except ValidationError:
        spec = None  # an invalid spec: the operator reads nothing
    due = next_measurement_at(status, spec) if spec is not None else None
    return {
        "startedAt": _timestamp(status.started_at), "lastReadAt": _timestamp(status.last_measured_at),
        "nextReadAt": _timestamp(due),
        "nextReadInSeconds": None if due is None else max(0, round((due - now).total_seconds())),
        "nextRead": None if due is None else "baseline" if status.last_measured_at is None else "interval",
        "decidedAt": _timestamp(status.decided_at),
    }


def build_status_view(policy: Mapping[str, Any],
                      workloads: Mapping[tuple[str, str], Mapping[str, Any]] | None = None,
                      now: datetime.datetime | None = None) -> StatusView:
    """`workloads` (kind, name) -> object: given, the view carries the per-target details.
    `now` (default: the clock): for the time to the next read."""
    meta = policy.get("metadata") or {}
    status = policy.get("status") or {}
    name, namespace = meta.get("name", ""), meta.get("namespace", "")
    phase = status.get("phase") or "Pending"
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    headline: Mapping[str, Any] = next((conditions[k] for k in ("Invalid", "Degraded", "Progressing", "Ready")
                     if k in conditions and (k in ("Progressing", "Ready") or conditions[k].get("status") == "True")),
                    {})
    ab = status.get("abTest")
    ab_view = None
    if ab:
        ab_view = {
            "phase": ab.get("phase"), "verdict": ab.get("verdict"), "finalVerdict": ab.get("finalVerdict"),
            "progress": ab.get("progress"), "configHash": ab.get("configHash"),
            "conditions": [{k: c.get(k) for k in ("metric", "control", "treatment", "effect", "lower", "upper",
                                                  "threshold", "pValue", "level", "autocorrelation", "samples",
                                                  "paired", "guardrail", "outcome")}
                           for c in ab.get("conditions") or []],
            "reason": ab.get("reason", ""),
            "time": build_time_axis(policy, now or datetime.datetime.now(datetime.UTC)),
        }
    return StatusView(
        name=name, namespace=namespace, phase=phase, message=headline.get("message", ""),
        stages=[{"name": s.get("name", ""), "phase": s.get("phase", "")} for s in status.get("stages") or []],
        targets=_target_counts(status),
        ab_test=ab_view, waiting=_waiting(name, namespace, status),
        last_verb=dict(status["lastVerb"]) if status.get("lastVerb") else None,
        target_details=build_target_details(status, workloads) if workloads is not None else None,
    )


def _target_counts(status: Mapping[str, Any]) -> dict[str, int]:
    """Workloads per phase: the status's counts, or (a status written before it had them) its
    list of targets."""
    counts: Counter[str] = Counter()
    if status.get("targetCounts"):
        for entry in status["targetCounts"]:
            counts[entry.get("phase", "Unknown")] += int(entry.get("count") or 0)
    else:
        counts.update(t.get("phase", "Unknown") for t in status.get("targets") or [])
    return dict(counts)


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _number(value: Any) -> str:
    return "-" if value is None else f"{value + 0.0:.4g}"  # + 0.0: no "-0"


def _outcome(condition: Mapping[str, Any]) -> str:
    """A guardrail not yet shown within its tolerance is Pending, not a win in waiting."""
    outcome = condition.get("outcome") or ""
    return "Pending" if condition.get("guardrail") and outcome == "Inconclusive" else outcome


def _small(value: Any) -> str:
    """A p-value or level: two significant digits."""
    return "-" if value is None else f"{value + 0.0:.2g}"


def _fixed(value: Any) -> str:
    return "-" if value is None else f"{value + 0.0:+.2f}"


def _time_axis(time: Mapping[str, Any]) -> str:
    """started ..., last read ..., next read ... (in Ns), decided ... (every part, '-' if unknown)."""
    due = time.get("nextReadAt")
    if due is not None:
        what = "baseline read" if time.get("nextRead") == "baseline" else "next read"
        next_read = f"{what} {due} (in {time.get('nextReadInSeconds')}s)"
    else:
        next_read = "next read -"
    return (f"started {time.get('startedAt') or '-'}, last read {time.get('lastReadAt') or '-'}, {next_read}, "
            f"decided {time.get('decidedAt') or '-'}")


def render_status(view: StatusView) -> str:
    lines = [f"{view.namespace}/{view.name}: {view.phase}" + (f" — {view.message}" if view.message else "")]
    if view.stages:
        lines.append("stages:  " + "  ".join(f"{s['name']} {s['phase']}" for s in view.stages))
    if view.targets:
        lines.append("targets: " + ", ".join(f"{n} {state}" for state, n in sorted(view.targets.items())))
    if view.ab_test is not None:
        ab = view.ab_test
        verdict = ab.get("finalVerdict") or f"(so far {ab.get('verdict') or '-'})"
        lines.append(f"A/B:     {ab.get('phase')}, verdict {verdict}, samples {ab.get('progress') or '-'}")
        lines.append("time:    " + _time_axis(ab.get("time") or {}))
        if ab["conditions"]:
            # Every column is padded and separated: a long number never runs into the next one.
            lines.append(f"  {'metric':<20} {'control':>10} {'treatment':>10} {'effect':>10}  {'bounds':<23} "
                         f"{'threshold':>9} {'p':>8} {'level':>7} {'lag-1 r':>7}  outcome")
            for c in ab["conditions"]:
                bounds = f"[{_number(c.get('lower'))}, {_number(c.get('upper'))}]"
                lines.append(f"  {c.get('metric', ''):<20} {_number(c.get('control')):>10} {_number(c.get('treatment')):>10} "
                             f"{_number(c.get('effect')):>10}  {bounds:<23} {_number(c.get('threshold')):>9} "
                             f"{_small(c.get('pValue')):>8} {_small(c.get('level')):>7} "
                             f"{_fixed(c.get('autocorrelation')):>7}  {_outcome(c)}"
                             + ("" if c.get("paired") is not False else " (unpaired)"))
    if view.target_details is not None:
        lines.append(f"  {'target':<34}{'role':<9}{'phase':<12}{'ready':<7}{'config-hash':<18}{'rollback':<9}"
                     f"{'original':<9}policy")
        for t in view.target_details:
            name = f"{t['kind']}/{t['name']}" + ("" if t["found"] else " (not found)")
            lines.append(f"  {name:<34}{t['role'] or '-':<9}{t['phase'] or '-':<12}{t['ready']:<7}"
                         f"{t['configHash'] or '-':<18}{_or_dash(t['rollbackRevision']):<9}"
                         f"{'kept' if t['original'] else '-':<9}{t['managedBy'] or '-'}")
    if view.last_verb is not None:
        v = view.last_verb
        lines.append(f"verb:    {v.get('verb') or '?'} {v.get('outcome')} at {v.get('handledAt')}: {v.get('message', '')}")
    if view.waiting is not None:
        lines.append(f"waiting: {view.waiting.on}")
        if view.waiting.command:
            lines.append(f"run:     {view.waiting.command}")
    return "\n".join(lines) + "\n"
