"""Verbs a person gives a policy at any time — `promote`, `abort`, `pause`, `resume`, `retry`
and `approve` — and what each does in the phase the policy is in. Pure.

A verb arrives as an annotation (`moonlease VERB NAME` writes it). `plan_verb` decides what a
value of `moonlease.io/verb` does, `plan_approval` what a value of
`moonlease.io/approve-master-restart` does; nothing else decides either, and the rollout planner
(`core.rollout`) carries the effect out. Every value is handled once: the status records the
last one (`status.lastVerb`, `status.lastApproval`), and `read_new_value` tells a value not yet
handled. A verb is keyed to the rollout the person saw (`<verb>:<revision>:<desiredConfigHash>`),
so one written for an earlier attempt or an earlier spec is ignored, with an event saying so —
as is one that makes no sense in the current phase (abort a finished rollout, retry a healthy
one). Approval reuses the master-restart gate: its value must equal `status.pendingApproval`.
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping
from dataclasses import dataclass

from moonlease_operator.api import ABTestPhase, Phase, Reason, Verb, VerbOutcome, VerbRecord
from moonlease_operator.core.events import EventNote

#: Verbs the verb annotation carries (approve has its own annotation).
ANNOTATED_VERBS = (Verb.PROMOTE, Verb.ABORT, Verb.PAUSE, Verb.RESUME, Verb.RETRY)
NO_CONFIG = "-"  # the key's configuration before the status names one
_MAX_SHOWN = 64  # characters of a bad value quoted back in an event


class VerbEffect(str, enum.Enum):
    """What the rollout planner does for an applied verb."""

    NONE = "None"
    PROMOTE = "Promote"
    """End the A/B test now and roll the treatment's configuration to the control (new attempt)."""
    ABORT = "Abort"
    """Fail the current attempt and roll back what it changed (whatever `onFailure` says)."""
    PAUSE = "Pause"
    RESUME = "Resume"
    RETRY = "Retry"
    """A Degraded policy starts a new attempt of its spec (a fresh A/B test, if any)."""
    APPROVE = "Approve"


@dataclass(frozen=True)
class VerbSituation:
    """What a verb is judged against: the policy as the status showed it to the person."""

    phase: Phase | None
    """The phase before this reconcile (or Invalid / Pending when this reconcile refuses or waits)."""
    ab_phase: ABTestPhase | None
    """The A/B test's phase; None without an A/B test."""
    revision: int | None
    """`status.revision` before this reconcile."""
    config_hash: str | None
    """The configuration the policy wants now (`status.desiredConfigHash` once written)."""
    paused: bool = False
    """Paused by the pause verb (`status.pausedAt`)."""
    spec_paused: bool = False
    """`spec.rollout.paused`."""
    pending_approval: str | None = None
    """`status.pendingApproval`: the master restart waiting for approval."""


@dataclass(frozen=True)
class VerbDecision:
    """What one annotation value does: applied (with an effect) or ignored, and why."""

    verb: Verb | None
    """None: the value named no verb."""
    value: str
    outcome: VerbOutcome
    message: str
    effect: VerbEffect = VerbEffect.NONE

    def record(self, now: datetime.datetime) -> VerbRecord:
        return VerbRecord(verb=self.verb, value=self.value[:256], outcome=self.outcome,
                          message=self.message[:1024], handled_at=now)

    def note(self) -> EventNote:
        """The event: Normal `VerbApplied`, or Warning `VerbIgnored` with the reason."""
        name = self.verb.value if self.verb is not None else "verb"
        if self.outcome is VerbOutcome.APPLIED:
            return EventNote("Normal", Reason.VERB_APPLIED.value, f"{name}: {self.message}")
        return EventNote("Warning", Reason.VERB_IGNORED.value, f"{name} ignored: {self.message}")


def build_verb_value(verb: Verb, revision: int | None, config_hash: str | None) -> str:
    """The verb annotation's value for the rollout the status shows (what the CLI writes); a
    policy that has not started a rollout yet is rollout 0 of configuration `-`."""
    return f"{verb.value}:{revision if revision is not None else 0}:{config_hash or NO_CONFIG}"


def read_new_value(annotations: Mapping[str, str], annotation: str, last: VerbRecord | None) -> str | None:
    """The annotation's value if it is set and was not handled yet (else None)."""
    value = annotations.get(annotation)
    if not value or (last is not None and last.value == value[:256]):
        return None
    return value


def _ignored(verb: Verb | None, value: str, why: str) -> VerbDecision:
    return VerbDecision(verb, value, VerbOutcome.IGNORED, why)


def _applied(verb: Verb, value: str, effect: VerbEffect, what: str) -> VerbDecision:
    return VerbDecision(verb, value, VerbOutcome.APPLIED, what, effect)


def plan_verb(value: str, situation: VerbSituation) -> VerbDecision:
    """What `moonlease.io/verb=<value>` does now. The one place this is decided.

    promote: an A/B test deploying, measuring, held or rolled back ends and its treatment's
    configuration rolls out to everyone. abort: a rollout under way (stages, approval, pause,
    measurement, decision, promotion) rolls back what its attempt changed, now. pause / resume:
    hold and release the operator (never a rollback; a policy not yet valid or
    started is held from its first rollout). retry: a Degraded policy tries its spec
    again. Anything else — a stale key, an unknown verb, a verb the phase has no use for — is
    ignored, and the decision says why.
    """
    name, _, key = value.partition(":")
    revision_text, _, config_hash = key.partition(":")
    try:
        verb = Verb(name.strip())
    except ValueError:
        return _ignored(None, value,
                        f"unknown verb {value[:_MAX_SHOWN]!r}: the verb annotation takes "
                        + ", ".join(v.value for v in ANNOTATED_VERBS))
    if verb is Verb.APPROVE:
        return _ignored(verb, value, "approve is given with the approval annotation (moonlease approve NAME"
                                     " sets it to status.pendingApproval), not with the verb annotation")
    if not revision_text.isdigit() or not config_hash:
        return _ignored(verb, value, f"{value[:_MAX_SHOWN]!r} lacks the key of the rollout it is meant for:"
                                     f" write {verb.value}:<status.revision>:<status.desiredConfigHash>"
                                     f" (moonlease {verb.value} NAME does)")
    current = situation.config_hash or NO_CONFIG
    if int(revision_text) != (situation.revision or 0) or config_hash != current:
        return _ignored(verb, value, f"stale: written for rollout {revision_text} of configuration {config_hash},"
                                     f" the policy is at rollout {situation.revision or 0} of configuration"
                                     f" {current} (run moonlease {verb.value} NAME again)")
    return _PLANNERS[verb](value, situation)


_SETTLING = (Phase.INVALID, Phase.PENDING, None)  # nothing is rolled out yet, nothing to act on


def _phase_name(situation: VerbSituation) -> str:
    return situation.phase.value if situation.phase is not None else "Pending"


def _plan_promote(value: str, s: VerbSituation) -> VerbDecision:
    verb = Verb.PROMOTE
    if s.phase is Phase.INVALID:
        return _ignored(verb, value, "the policy is Invalid: fix its spec first")
    if s.ab_phase is None:
        return _ignored(verb, value, "promote ends an A/B test, and this policy runs none (strategy Staged)")
    match s.ab_phase:
        case ABTestPhase.PROMOTING | ABTestPhase.PROMOTED:
            return _ignored(verb, value, "the A/B test is already promoted")
        case ABTestPhase.ROLLING_BACK:
            return _ignored(verb, value, "the treatment is rolling back; promote once the rollback is done")
    if s.phase in _SETTLING:
        return _ignored(verb, value, f"the policy is {_phase_name(s)}: nothing is deployed yet")
    overriding = " (overriding the rollback)" if s.ab_phase is ABTestPhase.ROLLED_BACK else ""
    return _applied(verb, value, VerbEffect.PROMOTE,
                    f"ending the A/B test ({s.ab_phase.value}) and rolling the treatment's configuration out to"
                    f" the control{overriding}")


def _plan_abort(value: str, s: VerbSituation) -> VerbDecision:
    verb = Verb.ABORT
    match s.phase:
        case Phase.INVALID | Phase.PENDING | None:
            return _ignored(verb, value, f"the policy is {_phase_name(s)}: no rollout is under way")
        case Phase.ROLLING_BACK:
            return _ignored(verb, value, "already rolling back")
        case Phase.DEGRADED:
            return _ignored(verb, value, "the policy is already Degraded: nothing is rolling out"
                                         " (retry tries the spec again)")
        case Phase.READY:
            return _ignored(verb, value, "the rollout is complete: to undo it, change the spec or delete the policy")
    what = ("rolling the A/B treatment back now" if s.ab_phase not in (None, ABTestPhase.PROMOTING)
            else "rolling back every stage this attempt changed, now")
    return _applied(verb, value, VerbEffect.ABORT, f"{what} (the policy ends Degraded; retry tries again)"
                    + ("; the pause ends" if s.paused else ""))


def _plan_pause(value: str, s: VerbSituation) -> VerbDecision:
    verb = Verb.PAUSE
    if s.paused:
        return _ignored(verb, value, "already paused (resume releases it)")
    match s.phase:
        case Phase.ROLLING_BACK:
            return _ignored(verb, value, "a rollback is never paused: it returns to the last verified configuration")
        case Phase.DEGRADED:
            return _ignored(verb, value, "the policy is Degraded: nothing moves until retry or a spec change")
    return _applied(verb, value, VerbEffect.PAUSE,
                    f"holding the policy where it is ({_phase_name(s)}): no stage starts, times out or is"
                    " verified, no A/B measurement is taken, no verdict acted on, until resume")


def _plan_resume(value: str, s: VerbSituation) -> VerbDecision:
    verb = Verb.RESUME
    if not s.paused:
        if s.spec_paused:
            return _ignored(verb, value, "paused by spec.rollout.paused, not by the pause verb: set it to false")
        return _ignored(verb, value, "not paused")
    return _applied(verb, value, VerbEffect.RESUME,
                    "carrying on where the pause held (a stage's timeout does not count the pause)")


def _plan_retry(value: str, s: VerbSituation) -> VerbDecision:
    verb = Verb.RETRY
    if s.phase is not Phase.DEGRADED:
        return _ignored(verb, value, f"only a Degraded policy retries; this one is {_phase_name(s)}")
    again = " with a fresh A/B test" if s.ab_phase is not None else ""
    return _applied(verb, value, VerbEffect.RETRY, f"a new rollout attempt of the same spec{again}")


_PLANNERS = {Verb.PROMOTE: _plan_promote, Verb.ABORT: _plan_abort, Verb.PAUSE: _plan_pause,
             Verb.RESUME: _plan_resume, Verb.RETRY: _plan_retry}


def plan_approval(value: str, situation: VerbSituation) -> VerbDecision:
    """What `moonlease.io/approve-master-restart=<value>` does now: approve the pending master
    restart (forward or back: whatever `status.pendingApproval` names) when it matches. The gate itself (which restart a value
    lets through) is the master-restart planner's; this says what the person gets to hear."""
    pending = situation.pending_approval
    if pending is not None and value == pending:
        return _applied(Verb.APPROVE, value, VerbEffect.APPROVE,
                        "the master restarts now (which empties the Mooncake store)")
    if pending is not None:
        return _ignored(Verb.APPROVE, value, f"{value[:_MAX_SHOWN]!r} does not match the restart waiting for"
                                             f" approval ({pending}): moonlease approve NAME writes the right value")
    return _ignored(Verb.APPROVE, value, f"no master restart waits for approval (phase {_phase_name(situation)});"
                                         f" this value approves only a restart keyed {value[:_MAX_SHOWN]!r}")
