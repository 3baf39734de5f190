"""Verbs (issue 17 item 6): the pure verb planner over every phase, then each verb carried out by
the rollout state machine on test_rollout_plan's `Cluster` (status round-tripped through JSON
between reconciles, as the operator reads it back)."""

from __future__ import annotations

import copy
import datetime
import itertools
from typing import Any

import pytest

from moonlease_operator.api import (
    APPROVE_MASTER_RESTART_ANNOTATION,
    VERB_ANNOTATION,
    ABTestPhase,
    Phase,
    Verb,
    VerbOutcome,
)
from moonlease_operator.core.ab_plan import ABReading
from moonlease_operator.api import read_spec
from moonlease_operator.core.rollout import plan_fetch
from moonlease_operator.core.verbs import (
    ANNOTATED_VERBS,
    VerbEffect,
    VerbSituation,
    build_verb_value,
    plan_approval,
    plan_verb,
    read_new_value,
)
from tests.unit.test_ab_rollout import CONTROL, SPEC as AB_SPEC, TREATMENT, ab_fleet, deploy_treatment, measure, runs
from tests.unit.test_rollout_plan import SPEC, Cluster, fleet, spec_with, template

pytestmark = pytest.mark.unit

PHASES: list[Phase | None] = [None, *Phase]
AB_PHASES: list[ABTestPhase | None] = [None, *ABTestPhase]
UNDER_WAY = {Phase.PROGRESSING, Phase.AWAITING_APPROVAL, Phase.PAUSED, Phase.ANALYZING, Phase.AWAITING_DECISION}


def expected_applied(verb: Verb, phase: Phase | None, ab: ABTestPhase | None, paused: bool) -> bool:
    """The verb table of docs/cli.md ("Driving a rollout"), written out independently."""
    if verb is Verb.PROMOTE:
        return ab in (ABTestPhase.DEPLOYING, ABTestPhase.MEASURING, ABTestPhase.AWAITING_DECISION,
                      ABTestPhase.ROLLED_BACK) and phase not in (None, Phase.INVALID, Phase.PENDING)
    if verb is Verb.ABORT:
        return phase in UNDER_WAY
    if verb is Verb.PAUSE:
        return not paused and phase not in (Phase.ROLLING_BACK, Phase.DEGRADED)
    if verb is Verb.RESUME:
        return paused
    return phase is Phase.DEGRADED  # retry


@pytest.mark.parametrize("verb", ANNOTATED_VERBS, ids=lambda v: v.value)
def test_every_verb_in_every_phase(verb: Verb) -> None:
    """Exhaustive: every phase x every A/B phase (or none) x paused or not x spec-paused or not."""
    effects = {Verb.PROMOTE: VerbEffect.PROMOTE, Verb.ABORT: VerbEffect.ABORT, Verb.PAUSE: VerbEffect.PAUSE,
               Verb.RESUME: VerbEffect.RESUME, Verb.RETRY: VerbEffect.RETRY}
    for phase, ab, paused, spec_paused in itertools.product(PHASES, AB_PHASES, (False, True), (False, True)):
        situation = VerbSituation(phase=phase, ab_phase=ab, revision=3, config_hash="cafe", paused=paused,
                                  spec_paused=spec_paused)
        decision = plan_verb(build_verb_value(verb, 3, "cafe"), situation)
        applied = expected_applied(verb, phase, ab, paused)
        where = (phase, ab, paused, spec_paused)
        assert decision.verb is verb, where
        assert decision.outcome is (VerbOutcome.APPLIED if applied else VerbOutcome.IGNORED), (where, decision)
        assert decision.effect is (effects[verb] if applied else VerbEffect.NONE), where
        assert decision.message, where  # always says what it does, or why not
        note = decision.note()
        assert (note.type, note.reason) == (("Normal", "VerbApplied") if applied else ("Warning", "VerbIgnored"))


def test_why_a_verb_is_ignored_is_said_in_words() -> None:
    def why(verb: Verb, phase: Phase | None, ab: ABTestPhase | None = None, **kw: Any) -> str:
        decision = plan_verb(build_verb_value(verb, 1, "h"), VerbSituation(phase, ab, 1, "h", **kw))
        assert decision.outcome is VerbOutcome.IGNORED
        return decision.message

    assert "runs none" in why(Verb.PROMOTE, Phase.PROGRESSING)
    assert "already promoted" in why(Verb.PROMOTE, Phase.READY, ABTestPhase.PROMOTED)
    assert "once the rollback is done" in why(Verb.PROMOTE, Phase.ROLLING_BACK, ABTestPhase.ROLLING_BACK)
    assert "rollout is complete" in why(Verb.ABORT, Phase.READY)
    assert "retry tries the spec again" in why(Verb.ABORT, Phase.DEGRADED)
    assert "never paused" in why(Verb.PAUSE, Phase.ROLLING_BACK)
    assert "already paused" in why(Verb.PAUSE, Phase.PAUSED, paused=True)
    assert "spec.rollout.paused" in why(Verb.RESUME, Phase.PAUSED, spec_paused=True)
    assert "only a Degraded policy retries; this one is Ready" in why(Verb.RETRY, Phase.READY)


@pytest.mark.parametrize(("value", "needle"), [
    ("promote:2:cafe", "stale: written for rollout 2 of configuration cafe, the policy is at rollout 3"),
    ("promote:3:beef", "stale: written for rollout 3 of configuration beef"),
    ("promote", "lacks the key of the rollout"),
    ("pause:x:cafe", "lacks the key of the rollout"),
    ("explode:3:cafe", "unknown verb 'explode:3:cafe'"),
    ("approve:3:cafe", "approval annotation"),
])
def test_stale_unkeyed_and_unknown_values_are_ignored(value: str, needle: str) -> None:
    situation = VerbSituation(Phase.ANALYZING, ABTestPhase.MEASURING, 3, "cafe")
    decision = plan_verb(value, situation)
    assert decision.outcome is VerbOutcome.IGNORED and decision.effect is VerbEffect.NONE
    assert needle in decision.message
    assert decision.record(datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)).value == value


def test_approval_is_applied_only_when_it_matches_the_pending_restart() -> None:
    waiting = VerbSituation(Phase.AWAITING_APPROVAL, None, 1, "h", pending_approval="m1")
    assert plan_approval("m1", waiting).effect is VerbEffect.APPROVE
    assert "does not match" in plan_approval("m0", waiting).message
    other = plan_approval("m1", VerbSituation(Phase.PROGRESSING, None, 1, "h"))
    assert other.outcome is VerbOutcome.IGNORED and "no master restart waits" in other.message


def test_a_value_is_new_until_it_is_recorded() -> None:
    decision = plan_verb("pause:1:h", VerbSituation(Phase.PROGRESSING, None, 1, "h"))
    record = decision.record(datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC))
    assert read_new_value({VERB_ANNOTATION: "pause:1:h"}, VERB_ANNOTATION, None) == "pause:1:h"
    assert read_new_value({VERB_ANNOTATION: "pause:1:h"}, VERB_ANNOTATION, record) is None
    assert read_new_value({VERB_ANNOTATION: "resume:1:h"}, VERB_ANNOTATION, record) == "resume:1:h"
    assert read_new_value({}, VERB_ANNOTATION, record) is None


# ---- carried out by the rollout planner ------------------------------------------------------------

def say(cluster: Cluster, verb: Verb) -> None:
    """What `moonlease VERB NAME` does: the verb keyed to the rollout the status shows."""
    status = cluster.status
    cluster.annotations[VERB_ANNOTATION] = build_verb_value(verb, status.revision, status.desired_config_hash)


def verb_events(cluster: Cluster) -> list[tuple[str, str]]:
    return [(reason, message) for _, reason, message in cluster.events if reason.startswith("Verb")]


def test_pause_mid_stage_holds_everything_and_the_stage_timeout_skips_the_pause() -> None:
    cluster = fleet()
    cluster.reconcile(SPEC)  # the master stage starts (timeout 60 s)
    assert cluster.stage_phases()["master"] == "Progressing"
    say(cluster, Verb.PAUSE)
    cluster.reconcile(SPEC)
    status = cluster.status
    assert status.phase is Phase.PAUSED and status.paused_at == cluster.now
    assert status.last_verb is not None and status.last_verb.outcome is VerbOutcome.APPLIED
    assert status.condition("Ready").reason == "PausedByVerb" and "moonlease resume fleet" in status.condition("Ready").message
    writes = list(cluster.writes)
    cluster.now += datetime.timedelta(seconds=600)  # far past the stage timeout
    cluster.settle("mooncake-master")
    for _ in range(3):
        cluster.reconcile(SPEC)
    assert cluster.status.phase is Phase.PAUSED and cluster.stage_phases()["master"] == "Progressing"
    assert cluster.writes == writes and verb_events(cluster)[-1][0] == "VerbApplied"
    assert len(verb_events(cluster)) == 1  # the value is handled once

    say(cluster, Verb.RESUME)
    cluster.reconcile(SPEC)
    assert cluster.stage_phases()["master"] == "Succeeded"  # not timed out: the pause did not count
    assert cluster.status.paused_at is None
    assert cluster.run(SPEC).phase is Phase.READY


def test_pause_at_ready_holds_a_later_spec_change_until_resume() -> None:
    cluster = fleet()
    assert cluster.run(SPEC).phase is Phase.READY
    say(cluster, Verb.PAUSE)
    cluster.reconcile(SPEC)
    changed = spec_with(**{"connector.leaseMode": "leaseAll"})
    writes = len(cluster.writes)
    for _ in range(3):
        cluster.reconcile(changed)
    assert cluster.status.phase is Phase.PAUSED and len(cluster.writes) == writes
    say(cluster, Verb.RESUME)
    assert cluster.run(changed).phase is Phase.READY and len(cluster.writes) > writes


def test_abort_mid_stage_rolls_back_even_with_halt_and_retry_tries_again() -> None:
    cluster = fleet()
    spec = spec_with(**{"rollout.onFailure": "halt"})
    before = {n: copy.deepcopy(template(cluster, n)) for n in ("prefill",)}
    cluster.reconcile(spec)
    cluster.settle("mooncake-master")
    cluster.reconcile(spec)  # master done, prefill patched
    assert cluster.stage_phases() == {"master": "Succeeded", "prefill": "Progressing", "decode": "Pending"}
    say(cluster, Verb.ABORT)
    status = cluster.run(spec)
    assert status.phase is Phase.DEGRADED and status.failed_stage.value == "prefill"
    # A target stage's failure rolls back the targets only: the master keeps its settings (and
    # the store its contents) unless its own stage failed or a rollback restart is approved.
    assert cluster.stage_phases() == {"master": "Succeeded", "prefill": "RolledBack", "decode": "Pending"}
    assert {n: template(cluster, n) for n in before} == before
    assert "aborted by a person" in status.stages[1].message
    revision = status.revision

    say(cluster, Verb.ABORT)  # the same value again: handled once, not twice
    cluster.reconcile(spec)
    assert [reason for reason, _ in verb_events(cluster)] == ["VerbApplied"]

    say(cluster, Verb.RETRY)
    status = cluster.run(spec)
    assert status.phase is Phase.READY and status.revision == revision + 1
    assert "retrying the same configuration" in " ".join(m for _, _, m in cluster.events)


def test_a_stale_verb_is_ignored_once_with_an_event() -> None:
    cluster = fleet()
    cluster.reconcile(SPEC)
    say(cluster, Verb.PAUSE)
    cluster.annotations[VERB_ANNOTATION] = cluster.annotations[VERB_ANNOTATION].replace(":1:", ":7:")
    for _ in range(3):
        cluster.reconcile(SPEC)
    [(reason, message)] = verb_events(cluster)
    assert reason == "VerbIgnored" and "stale" in message and cluster.status.paused_at is None
    # A spec edit makes a verb written for the old configuration stale too.
    say(cluster, Verb.PAUSE)
    cluster.reconcile(spec_with(**{"connector.leaseMode": "leaseAll"}))
    assert "stale" in verb_events(cluster)[-1][1] and cluster.status.paused_at is None


def test_verbs_are_heard_while_the_policy_is_invalid() -> None:
    cluster = fleet()
    bad = spec_with(**{"master.evictionRatio": 7})
    cluster.reconcile(bad)
    assert cluster.status.phase is Phase.INVALID
    say(cluster, Verb.ABORT)
    assert cluster.annotations[VERB_ANNOTATION] == "abort:0:-"  # no rollout yet: rollout 0 of no configuration
    cluster.reconcile(bad)
    assert "no rollout is under way" in verb_events(cluster)[-1][1]
    say(cluster, Verb.PAUSE)  # pausing before the first rollout holds it once the spec is fixed
    cluster.reconcile(bad)
    assert verb_events(cluster)[-1][0] == "VerbApplied" and cluster.status.paused_at is not None
    for _ in range(2):
        cluster.reconcile(SPEC)
    assert cluster.status.phase is Phase.PAUSED and cluster.writes == []
    cluster.annotations[VERB_ANNOTATION] = "resume:0:"  # unkeyed: ignored
    cluster.reconcile(SPEC)
    assert "lacks the key" in verb_events(cluster)[-1][1]
    say(cluster, Verb.RESUME)
    assert cluster.run(SPEC).phase is Phase.READY


def test_approve_through_the_restart_gate_is_reported() -> None:
    cluster = fleet()
    spec = spec_with(**{"master.requireApprovalForRestart": True})
    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = "early"
    cluster.reconcile(spec)
    assert "no master restart waits" in verb_events(cluster)[-1][1]
    cluster.reconcile(spec)
    status = cluster.status
    assert status.phase is Phase.AWAITING_APPROVAL and cluster.writes == []
    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = "wrong"
    cluster.reconcile(spec)
    assert "does not match" in verb_events(cluster)[-1][1] and cluster.writes == []
    cluster.annotations[APPROVE_MASTER_RESTART_ANNOTATION] = status.pending_approval or ""
    cluster.reconcile(spec)
    assert verb_events(cluster)[-1] == ("VerbApplied", "approve: the master restarts now (which empties the"
                                                       " Mooncake store)")
    assert cluster.writes == [("Deployment", "mooncake-master")]
    assert cluster.status.last_approval is not None and cluster.status.last_approval.value == status.pending_approval


# ---- A/B tests --------------------------------------------------------------------------------------

def test_promote_mid_measurement_ends_the_test_and_rolls_the_treatment_to_the_control() -> None:
    cluster = ab_fleet()
    deploy_treatment(cluster, AB_SPEC)
    measure(cluster, AB_SPEC, [(0.5, 0.5)])
    say(cluster, Verb.PROMOTE)
    status = cluster.run(AB_SPEC)
    assert status.phase is Phase.READY and status.ab_test.phase is ABTestPhase.PROMOTED
    assert "promoted by a person after 1 samples" in status.ab_test.reason
    assert all(runs(cluster, c) == runs(cluster, t) for c, t in zip(CONTROL, TREATMENT))
    assert status.applied_config_hash == status.desired_config_hash


def test_promote_while_the_treatment_deploys_skips_the_test() -> None:
    cluster = ab_fleet()
    cluster.reconcile(AB_SPEC)  # master stage under way
    say(cluster, Verb.PROMOTE)
    status = cluster.run(AB_SPEC)
    assert status.phase is Phase.READY and status.ab_test.phase is ABTestPhase.PROMOTED
    assert status.ab_test.samples == 0
    assert all(runs(cluster, c) == runs(cluster, t) for c, t in zip(CONTROL, TREATMENT))


def test_abort_mid_measurement_rolls_the_treatment_back_and_retry_starts_a_fresh_test() -> None:
    cluster = ab_fleet()
    originals = {n: copy.deepcopy(template(cluster, n)) for n in TREATMENT}
    deploy_treatment(cluster, AB_SPEC)
    measure(cluster, AB_SPEC, [(0.5, 0.5)])
    say(cluster, Verb.ABORT)
    status = cluster.run(AB_SPEC)
    assert status.phase is Phase.DEGRADED and status.ab_test.phase is ABTestPhase.ROLLED_BACK
    assert "aborted by a person" in status.ab_test.reason
    assert {n: template(cluster, n) for n in TREATMENT} == originals
    say(cluster, Verb.RETRY)
    status = cluster.run(AB_SPEC)
    assert status.phase is Phase.ANALYZING and status.ab_test.phase is ABTestPhase.MEASURING
    assert status.ab_test.samples == 0


def test_abort_while_the_treatment_deploys_rolls_back_the_stage_under_way() -> None:
    cluster = ab_fleet()
    originals = {n: copy.deepcopy(template(cluster, n)) for n in TREATMENT}
    cluster.reconcile(AB_SPEC)
    cluster.settle("mooncake-master")
    cluster.reconcile(AB_SPEC)  # the treatment's prefill is patched
    assert cluster.stage_phases()["prefill"] == "Progressing"
    say(cluster, Verb.ABORT)
    status = cluster.run(AB_SPEC)
    assert status.phase is Phase.DEGRADED and status.ab_test.phase is ABTestPhase.ROLLED_BACK
    assert {n: template(cluster, n) for n in TREATMENT} == originals
    for _ in range(3):  # and it stays there
        cluster.reconcile(AB_SPEC)
    assert cluster.status.phase is Phase.DEGRADED


def test_pause_mid_measurement_takes_no_reading_and_resume_measures_again() -> None:
    cluster = ab_fleet()
    deploy_treatment(cluster, AB_SPEC)
    measure(cluster, AB_SPEC, [(0.4, 0.7)])
    say(cluster, Verb.PAUSE)
    cluster.reconcile(AB_SPEC)
    assert cluster.status.phase is Phase.PAUSED and cluster.status.ab_test.phase is ABTestPhase.MEASURING
    cluster.now += datetime.timedelta(seconds=60)
    assert not plan_fetch(read_spec(AB_SPEC), cluster.status, cluster.now).ab_due  # nothing is read while paused
    cluster.reconcile(AB_SPEC, ab_reading=ABReading(cluster.now, None))
    assert cluster.status.ab_test.samples == 1
    say(cluster, Verb.RESUME)
    cluster.reconcile(AB_SPEC)
    assert cluster.status.phase is Phase.ANALYZING
    assert plan_fetch(read_spec(AB_SPEC), cluster.status, cluster.now).ab_due
