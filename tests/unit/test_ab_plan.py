"""The ABTest spec models, their reading into the analysis config, the verdict -> action table
and the bounded status history."""

from __future__ import annotations

import datetime

import pytest
from pydantic import ValidationError

from moonlease_operator.api.abtest import ABTestSpec, ABTestStatus
from moonlease_operator.core.ab_plan import (
    ABAction,
    build_ab_status,
    build_analysis_config,
    plan_ab_action,
)
from moonlease_operator.core.analysis import (
    ArmSample,
    Direction,
    Histogram,
    IntervalSample,
    Outcome,
    Verdict,
)

pytestmark = pytest.mark.unit

ARMS = {"control": {"workloads": ["decode-a"]}, "treatment": {"workloads": ["decode-b"]}}


def test_defaults_read_from_camel_case() -> None:
    spec = ABTestSpec.model_validate({**ARMS, "intervalSeconds": 30, "abort": {"ttftThresholdSeconds": 2.5}})
    assert spec.interval_seconds == 30 and spec.min_samples == 5 and spec.max_samples == 30
    config = build_analysis_config(spec)
    assert config.z == pytest.approx(1.959964, abs=1e-5)
    assert [c.metric for c in config.conditions] == ["externalHitRate", "ttftP90"]
    assert config.conditions[1].direction is Direction.LOWER_IS_BETTER and config.conditions[1].guardrail
    assert config.guard.ttft_threshold_s == 2.5 and config.guard.consecutive == 2


@pytest.mark.parametrize("raw, message", [
    ({"control": {"workloads": ["a"]}, "treatment": {"workloads": ["a"]}}, "both arms"),
    ({**ARMS, "minSamples": 10, "maxSamples": 5}, "maxSamples must be at least minSamples"),
    ({**ARMS, "minSamples": 1}, "greater than or equal to 2"),
    ({**ARMS, "conditions": [{"metric": "bad name"}]}, "pattern"),
    ({**ARMS, "prometheus": {"url": "prometheus:9090"}}, "pattern"),
    ({**ARMS, "onSuccess": "rollback"}, "promote"),
])
def test_invalid_specs_are_refused(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ABTestSpec.model_validate(raw)


def verdict(outcome: Outcome, final: bool) -> Verdict:
    return Verdict(outcome, "why", final, samples=3, consecutive_errors=0)


@pytest.mark.parametrize("outcome, final, overrides, action", [
    (Outcome.INCONCLUSIVE, False, {}, ABAction.CONTINUE),
    (Outcome.NO_DATA, False, {}, ABAction.CONTINUE),
    (Outcome.SUCCESS, True, {}, ABAction.PROMOTE),
    (Outcome.SUCCESS, True, {"onSuccess": "hold"}, ABAction.HOLD),
    (Outcome.FAILURE, True, {}, ABAction.ROLL_BACK),
    (Outcome.FAILURE, True, {"onFailure": "hold"}, ABAction.HOLD),
    (Outcome.ABORT, True, {}, ABAction.ROLL_BACK),
    (Outcome.ABORT, True, {"onFailure": "hold"}, ABAction.HOLD),
    (Outcome.INCONCLUSIVE, True, {}, ABAction.HOLD),
    (Outcome.INCONCLUSIVE, True, {"onInconclusive": "rollback"}, ABAction.ROLL_BACK),
    (Outcome.NO_DATA, True, {}, ABAction.HOLD),
    (Outcome.ERROR, True, {}, ABAction.HOLD),
])
def test_verdict_to_action(outcome: Outcome, final: bool, overrides: dict[str, str], action: ABAction) -> None:
    spec = ABTestSpec.model_validate({**ARMS, **overrides})
    assert plan_ab_action(verdict(outcome, final), spec) is action


def test_only_success_promotes() -> None:
    spec = ABTestSpec.model_validate(ARMS)
    for outcome in Outcome:
        for final in (False, True):
            if plan_ab_action(verdict(outcome, final), spec) is ABAction.PROMOTE:
                assert outcome is Outcome.SUCCESS and final


def test_status_history_is_bounded_and_round_trips() -> None:
    ttft = Histogram(((0.1, 10.0), (1.0, 20.0), (float("inf"), 20.0)))
    arm = ArmSample(prefix_hits=30, prefix_queries=100, external_hits=10, external_queries=40, ttft=ttft,
                    put_alloc_failures=0, evictions=2)
    intervals = [IntervalSample(start=1000.0 + 10 * i, end=1010.0 + 10 * i, control=arm, treatment=arm)
                 for i in range(25)]
    intervals.append(IntervalSample(start=1250.0, end=1260.0, error="Prometheus unreachable"))
    started = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    status = build_ab_status(intervals, verdict(Outcome.INCONCLUSIVE, False), ABAction.CONTINUE,
                             started_at=started, limit=5)
    assert len(status.history) == 5
    assert status.history[-1].error == "Prometheus unreachable" and status.history[-1].control is None
    values = status.history[0].control
    assert values is not None
    assert values.prefix_hit_rate == 0.3 and values.external_hit_rate == 0.25
    assert values.ttft_p90_seconds == pytest.approx(0.1 + 0.9 * 8 / 10)
    assert status.last_measured_at == datetime.datetime.fromtimestamp(1260.0, tz=datetime.timezone.utc)
    dumped = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert dumped["verdict"] == "Inconclusive" and dumped["action"] == "Continue"
    assert "lastMeasuredAt" in dumped and "externalHitRate" in dumped["history"][0]["control"]
    assert ABTestStatus.model_validate(dumped) == status


@pytest.mark.parametrize("raw, violated", [
    (ARMS, set()),
    ({**ARMS, "maxSamples": None}, set()),
    ({"control": {"workloads": ["a", "b"]}, "treatment": {"workloads": ["b"]}}, {"a workload cannot be in both arms"}),
    ({**ARMS, "minSamples": 10, "maxSamples": 5}, {"maxSamples must be at least minSamples"}),
])
def test_cel_rules_agree_with_their_pydantic_mirrors(raw: dict[str, object], violated: set[str]) -> None:
    """The rules the API server will evaluate (cel-python) refuse exactly what pydantic refuses."""
    import celpy

    env = celpy.Environment()
    defaults = {"minSamples": 5, "maxSamples": 30}
    node = {**defaults, **raw}
    node = {k: v for k, v in node.items() if v is not None}
    failed = {rule.message for rule in ABTestSpec.cel_rules
              if not env.program(env.compile(rule.rule)).evaluate({"self": celpy.json_to_cel(node)})}
    assert failed == violated
    if violated:
        with pytest.raises(ValidationError, match="|".join(violated)):
            ABTestSpec.model_validate(raw)
    else:
        ABTestSpec.model_validate(raw)
