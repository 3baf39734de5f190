"""What `moonlease status` says the operator waits for, and the command that unblocks it."""

from __future__ import annotations

from typing import Any

import pytest

from moonlease.status_view import build_status_view, render_status

pytestmark = pytest.mark.unit


def policy(status: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns"}, "status": status}


def test_an_awaited_master_restart_names_the_approve_verb() -> None:
    view = build_status_view(policy({"phase": "AwaitingApproval", "pendingApproval": "abc123"}))
    assert view.waiting is not None and "abc123" in view.waiting.on
    assert view.waiting.command == "moonlease approve -n ns p"


def test_a_measuring_test_waits_without_a_command_and_says_when_its_source_fails() -> None:
    view = build_status_view(policy({"phase": "Analyzing", "abTest": {
        "phase": "Measuring", "verdict": "Error", "progress": "4/30", "conditions": [
            {"metric": "externalHitRate", "control": 0.3, "treatment": 0.35, "effect": 0.05, "outcome": "Inconclusive"}]}}))
    assert view.waiting is not None and view.waiting.command is None
    assert "4/30" in view.waiting.on and "resumes when it answers" in view.waiting.on
    text = render_status(view)
    assert "verdict (so far Error), samples 4/30" in text
    assert "[-, -]" in text  # no bounds yet


@pytest.mark.parametrize("status, command", [
    ({"phase": "Paused"}, "kubectl -n ns patch mlp p --type=merge -p '{\"spec\":{\"rollout\":{\"paused\":false}}}'"),
    ({"phase": "Paused", "pausedAt": "2026-01-01T00:00:00Z"}, "moonlease resume -n ns p"),
    ({"phase": "RollingBack", "pausedAt": "2026-01-01T00:00:00Z"}, None),  # a rollback is never paused
    ({"phase": "AwaitingDecision", "abTest": {"verdict": "Inconclusive"}},
     "moonlease promote -n ns p   # or: moonlease abort -n ns p"),
    ({"phase": "Degraded"}, "moonlease retry -n ns p   # or: kubectl -n ns edit mlp p"),
    ({"phase": "Invalid"}, "kubectl -n ns edit mlp p"),
    ({"phase": "Ready"}, None),
])
def test_each_phase_says_what_unblocks_it(status: dict[str, Any], command: str | None) -> None:
    view = build_status_view(policy(status))
    assert (view.waiting.command if view.waiting else None) == command


def test_the_last_verb_and_the_targets_as_their_workloads_say() -> None:
    workload = {"kind": "Deployment", "metadata": {
        "name": "prefill", "labels": {"moonlease.io/policy": "p"}, "annotations": {
            "moonlease.io/original": "{}",
            "moonlease.io/rollback": '{"revision": 3, "slots": {}}'}},
        "spec": {"template": {"metadata": {"annotations": {"moonlease.io/config-hash": "c0ffee"}}}}}
    view = build_status_view(policy({
        "phase": "Progressing", "lastVerb": {"verb": "pause", "value": "pause:3:h", "outcome": "Ignored",
                                             "message": "already paused", "handledAt": "2026-01-01T00:00:00Z"},
        "targets": [{"kind": "Deployment", "name": "prefill", "role": "prefill", "phase": "Updating",
                     "replicas": 2, "readyReplicas": 1},
                    {"kind": "StatefulSet", "name": "gone", "role": "decode", "phase": "Pending"}]}),
        {("Deployment", "prefill"): workload})
    text = render_status(view)
    assert "verb:    pause Ignored at 2026-01-01T00:00:00Z: already paused" in text
    [prefill] = [line for line in text.splitlines() if "Deployment/prefill" in line]
    assert prefill.split() == ["Deployment/prefill", "prefill", "Updating", "1/2", "c0ffee", "3", "kept", "p"]
    assert "StatefulSet/gone (not found)" in text
    assert view.as_json()["target_details"][0]["rollbackRevision"] == 3


def test_a_bounded_status_counts_every_target_and_the_workloads_fill_in_the_unlisted_ones() -> None:
    """The status lists only targets that need attention (issue 16): the summary comes from its
    counts, and `--targets` shows every labelled workload, the unlisted ones Ready."""
    def labelled(name: str) -> dict[str, Any]:
        return {"kind": "Deployment", "metadata": {"name": name, "labels": {"moonlease.io/policy": "p"}},
                "spec": {"replicas": 2}, "status": {"readyReplicas": 2}}

    status = {"phase": "Progressing", "targetsTotal": 3, "targetsOmitted": 0,
              "targetCounts": [{"role": "prefill", "phase": "Ready", "count": 2},
                               {"role": "decode", "phase": "Updating", "count": 1}],
              "targets": [{"kind": "Deployment", "name": "d", "role": "decode", "phase": "Updating"}]}
    view = build_status_view(policy(status), {("Deployment", n): labelled(n) for n in ("a", "b", "d")})
    assert view.targets == {"Ready": 2, "Updating": 1}
    assert [(d["name"], d["phase"], d["ready"]) for d in view.target_details or []] == [
        ("d", "Updating", "0/0"), ("a", "Ready", "2/2"), ("b", "Ready", "2/2")]
    omitted = build_status_view(policy({**status, "targetsOmitted": 4}), {("Deployment", "a"): labelled("a")})
    assert [d["phase"] for d in omitted.target_details or []] == ["Updating", "-"]  # unknown: not listed


def test_conditions_show_thresholds_p_values_holm_levels_and_the_autocorrelation_in_aligned_columns() -> None:
    conditions = [
        {"metric": "externalHitRate", "control": 0.4022, "treatment": 0.4432, "effect": -0.0004863, "lower": -0.01,
         "upper": 0.009, "threshold": 0.02, "pValue": 0.31, "level": 0.025, "autocorrelation": 0.62, "samples": 12,
         "paired": True, "outcome": "Inconclusive"},
        {"metric": "ttftP90", "control": 0.31, "treatment": 0.3, "effect": 0.01, "lower": -0.02, "upper": 0.04,
         "threshold": -0.05, "pValue": 0.0004, "level": 0.05, "autocorrelation": -0.1, "samples": 12,
         "paired": False, "outcome": "Success"}]
    view = build_status_view(policy({"phase": "Analyzing", "abTest": {"phase": "Measuring", "progress": "12/30",
                                                                      "conditions": conditions}}))
    assert view.ab_test is not None and view.ab_test["conditions"][0]["autocorrelation"] == 0.62  # JSON too
    lines = render_status(view).splitlines()
    header = next(line for line in lines if "metric" in line)
    rows = [line for line in lines if line.lstrip().startswith(("externalHitRate", "ttftP90"))]
    assert "threshold" in header and "level" in header and "lag-1 r" in header
    assert "0.4432 -0.0004863" in rows[0]  # treatment and effect apart (issue 26: they ran together)
    assert rows[0].split()[-5:] == ["0.02", "0.31", "0.025", "+0.62", "Inconclusive"]
    assert " 0.0004 " in rows[1] and "-0.10" in rows[1] and rows[1].endswith("Success (unpaired)")
    # aligned: every row's outcome starts where the header's does
    assert {row.index(" Inconclusive") if "Inconclusive" in row else row.index(" Success") for row in rows} == {
        header.index(" outcome")}


def test_a_guardrail_not_yet_within_tolerance_shows_pending() -> None:
    view = build_status_view(policy({"phase": "Analyzing", "abTest": {"phase": "Measuring", "conditions": [
        {"metric": "ttftP90", "outcome": "Inconclusive", "guardrail": True},
        {"metric": "externalHitRate", "outcome": "Inconclusive"}]}}))
    text = render_status(view)
    assert any(line.lstrip().startswith("ttftP90") and line.endswith("Pending") for line in text.splitlines())
    assert any(line.lstrip().startswith("externalHitRate") and line.endswith("Inconclusive") for line in text.splitlines())


AB_SPEC = {"rollout": {"strategy": "ABTest", "abTest": {
    "control": {"workloads": ["a"]}, "treatment": {"workloads": ["b"]},
    "intervalSeconds": 30, "warmupSeconds": 120}}}
NOW = __import__("datetime").datetime(2026, 1, 1, 0, 5, 0, tzinfo=__import__("datetime").timezone.utc)


@pytest.mark.parametrize("ab, expected, line", [
    # warming up: the baseline is read warmupSeconds after measuring started
    ({"phase": "Measuring", "startedAt": "2026-01-01T00:04:00Z"},
     {"startedAt": "2026-01-01T00:04:00Z", "lastReadAt": None, "nextReadAt": "2026-01-01T00:06:00Z",
      "nextReadInSeconds": 60, "nextRead": "baseline", "decidedAt": None},
     "time:    started 2026-01-01T00:04:00Z, last read -, baseline read 2026-01-01T00:06:00Z (in 60s), decided -"),
    # measuring: every intervalSeconds after the last read
    ({"phase": "Measuring", "startedAt": "2026-01-01T00:00:00Z", "lastMeasuredAt": "2026-01-01T00:04:50Z"},
     {"startedAt": "2026-01-01T00:00:00Z", "lastReadAt": "2026-01-01T00:04:50Z", "nextReadAt": "2026-01-01T00:05:20Z",
      "nextReadInSeconds": 20, "nextRead": "interval", "decidedAt": None},
     "last read 2026-01-01T00:04:50Z, next read 2026-01-01T00:05:20Z (in 20s), decided -"),
    # decided: nothing more is read
    ({"phase": "AwaitingDecision", "startedAt": "2026-01-01T00:00:00Z", "lastMeasuredAt": "2026-01-01T00:04:30Z",
      "decidedAt": "2026-01-01T00:04:31Z"},
     {"startedAt": "2026-01-01T00:00:00Z", "lastReadAt": "2026-01-01T00:04:30Z", "nextReadAt": None,
      "nextReadInSeconds": None, "nextRead": None, "decidedAt": "2026-01-01T00:04:31Z"},
     "next read -, decided 2026-01-01T00:04:31Z"),
])
def test_the_ab_test_has_a_time_axis_in_text_and_json(ab: dict[str, Any], expected: dict[str, Any], line: str) -> None:
    """Issue 26: `moonlease status` said nothing about when: when measuring started, when the arms
    are read next (the operator's own schedule), when the test was decided."""
    view = build_status_view({**policy({"phase": "Analyzing", "abTest": ab}), "spec": AB_SPEC}, now=NOW)
    assert view.as_json()["ab_test"]["time"] == expected
    assert line in render_status(view)


def test_a_retried_test_shows_its_own_fresh_counts() -> None:
    """After `moonlease retry` the operator writes a fresh abTest (the stale fields nulled,
    core.status.dump_status): the screen shows what that fresh status holds, nothing older."""
    from moonlease_operator.api import ABTestPhase, PolicyStatus
    from moonlease_operator.core.ab_plan import begin_test
    from moonlease_operator.core.status import dump_status

    old = {"phase": "RolledBack", "configHash": "h", "progress": "13/30", "samples": 13, "verdict": "Failure",
           "startedAt": "2026-01-01T00:00:00Z", "lastMeasuredAt": "2026-01-01T00:04:00Z",
           "conditions": [{"metric": "externalHitRate", "outcome": "Failure", "samples": 13}]}
    fresh = begin_test(None, "h")  # what a retry starts (core.rollout passes no previous test)
    assert fresh.phase is ABTestPhase.DEPLOYING
    written = dump_status(PolicyStatus(phase=None, ab_test=fresh))["abTest"]
    merged = {**old, **written}
    merged = {k: v for k, v in merged.items() if v is not None}  # a merge patch removes the nulls
    view = build_status_view({**policy({"phase": "Progressing", "abTest": merged}), "spec": AB_SPEC}, now=NOW)
    ab = view.ab_test
    assert ab is not None and ab["progress"] in ("", None) and ab["conditions"] == []
    assert ab["time"]["startedAt"] is None and ab["time"]["lastReadAt"] is None
    assert "13/30" not in render_status(view)
