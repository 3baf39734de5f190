"""The ABTest spec models, their reading into the analysis config, the verdict -> action table,
and the test's progress in the status: folding measurements (through JSON, as the API stores
them), the bounded history, events, a human's decision, when a measurement is due."""

from __future__ import annotations

import datetime
import json

import pytest
from pydantic import ValidationError

from moonlease_operator.api.abtest import ABTestSpec, MetricDirection
from moonlease_operator.api.abtest_status import ABTestPhase, ABTestStatus, AnalysisStateStatus
from moonlease_operator.core.ab_plan import (
    HISTORY_LIMIT,
    ABAction,
    ABReading,
    apply_decision_annotation,
    begin_test,
    build_analysis_config,
    decision_hint,
    load_analysis,
    measurement_due,
    seconds_until_measurement,
    plan_ab_action,
    record_measurement,
    start_measuring,
)
from moonlease_operator.core.analysis import (
    AnalysisConfig,
    AnalysisState,
    ArmSample,
    Histogram,
    IntervalSample,
    Outcome,
    Verdict,
    evaluate_ab,
    fold_interval,
)

pytestmark = pytest.mark.unit

ARMS = {"control": {"workloads": ["decode-a"]}, "treatment": {"workloads": ["decode-b"]}}


def test_defaults_read_from_camel_case() -> None:
    spec = ABTestSpec.model_validate({**ARMS, "intervalSeconds": 30, "abort": {"ttftThresholdSeconds": 2.5}})
    assert spec.interval_seconds == 30 and spec.min_samples == 5 and spec.max_samples == 30
    config = build_analysis_config(spec)
    assert config.confidence == 0.95
    assert [c.metric for c in config.conditions] == ["externalHitRate", "ttftP90"]
    assert config.conditions[1].direction is MetricDirection.LOWER_IS_BETTER and config.conditions[1].guardrail
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
    (Outcome.ERROR, False, {}, ABAction.CONTINUE),
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


T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def measuring(spec: ABTestSpec) -> ABTestStatus:
    status, events = start_measuring(begin_test(None, "cfg1"), spec, ["decode-a"], ["decode-b"], T0)
    assert status.phase is ABTestPhase.MEASURING and [e.reason for e in events] == ["ABTestStarted"]
    return status


def test_measurements_fold_into_a_bounded_history_and_a_state_that_survives_json() -> None:
    spec = ABTestSpec.model_validate({**ARMS, "minSamples": 30, "maxSamples": 100})
    ttft = Histogram(((0.1, 10.0), (1.0, 20.0), (float("inf"), 20.0)))
    arm = ArmSample(prefix_hits=30, prefix_queries=100, external_hits=10, external_queries=40, ttft=ttft,
                    put_alloc_failures=0, evictions=2)
    intervals = [IntervalSample(start=1000.0 + 10 * i, end=1010.0 + 10 * i, control=arm, treatment=arm)
                 for i in range(25)]
    intervals.append(IntervalSample(start=1250.0, end=1260.0, error="Prometheus unreachable"))
    status = measuring(spec)
    status, _ = record_measurement(status, spec, ABReading(T0, None), T0, policy="ab", namespace="default")  # the baseline: no sample
    assert status.samples == 0 and status.last_measured_at == T0 and status.analysis is None
    events = []
    for interval in intervals:
        at = T0 + datetime.timedelta(seconds=interval.end - 1000)
        status, notes = record_measurement(status, spec, ABReading(at, interval), at, policy="ab", namespace="default")
        # the status as the API server stores it, read back: the next fold starts from JSON
        status = ABTestStatus.model_validate(json.loads(json.dumps(
            status.model_dump(mode="json", by_alias=True, exclude_none=True))))
        events += notes
    assert len(status.history) == HISTORY_LIMIT
    assert status.history[-1].error == "Prometheus unreachable" and status.history[-1].control is None
    values = status.history[0].control
    assert values is not None
    assert values.prefix_hit_rate == 0.3 and values.external_hit_rate == 0.25
    assert values.ttft_p90_seconds == pytest.approx(0.1 + 0.9 * 8 / 10)
    assert status.history[-1].end == datetime.datetime.fromtimestamp(1260, tz=datetime.UTC)
    assert status.samples == 25 and status.consecutive_errors == 1
    assert status.control is not None and status.control.external_hit_rate == pytest.approx(0.25)
    config = build_analysis_config(spec)
    assert load_analysis(status.analysis) == _fold(intervals, config)
    assert status.verdict == evaluate_ab(intervals, config).outcome.value == "Inconclusive"
    assert [e.reason for e in events] == ["MeasurementFailed"]
    # per condition: which is a guardrail (shown Pending while Inconclusive), the paired series
    assert [(c.metric, c.guardrail) for c in status.conditions] == [("externalHitRate", None), ("ttftP90", True)]
    assert all(c.paired and c.samples == 25 for c in status.conditions)


def _fold(intervals: list[IntervalSample], config: AnalysisConfig) -> AnalysisState:
    state = AnalysisState()
    for interval in intervals:
        state = fold_interval(state, interval, config)
    return state


def test_a_clear_win_promotes_with_its_events() -> None:
    spec = ABTestSpec.model_validate({**ARMS, "minSamples": 3, "conditions": [{"metric": "externalHitRate"}]})
    status = measuring(spec)
    reasons = []
    for i in range(4):
        control = ArmSample(external_hits=400 + 7 * i, external_queries=1000)  # a drift common to both arms
        treatment = ArmSample(external_hits=700 + 7 * i, external_queries=1000)
        status, notes = record_measurement(status, spec, ABReading(T0, IntervalSample(i, i + 1, control, treatment)), T0, policy="ab", namespace="default")
        reasons += [n.reason for n in notes]
        if status.phase is not ABTestPhase.MEASURING:
            break
    assert status.phase is ABTestPhase.PROMOTING and status.verdict == "Success" and status.action == "Promote"
    assert status.decided_at == T0 and status.samples == 3
    assert reasons == ["ABTestVerdict", "ABTestPromoting"]


def test_a_state_of_another_format_starts_afresh() -> None:
    assert load_analysis(None) == AnalysisState()
    assert load_analysis(AnalysisStateStatus(format=99, samples=5)) == AnalysisState()


def test_a_new_configuration_starts_a_new_test_and_the_same_one_carries_on() -> None:
    running = ABTestStatus(phase=ABTestPhase.MEASURING, config_hash="cfg1", samples=4)
    assert begin_test(running, "cfg1") is running
    fresh = begin_test(running, "cfg2")
    assert fresh.phase is ABTestPhase.DEPLOYING and fresh.config_hash == "cfg2" and fresh.samples == 0


@pytest.mark.parametrize("annotation, phase, why", [
    ("promote:cfg1", ABTestPhase.PROMOTING, None),
    ("rollback:cfg1", ABTestPhase.ROLLING_BACK, None),
    ("promote:cfg0", ABTestPhase.AWAITING_DECISION, "names configuration 'cfg0'"),  # a stale decision
    ("promote", ABTestPhase.AWAITING_DECISION, "names configuration ''"),
    ("keep:cfg1", ABTestPhase.AWAITING_DECISION, "unknown decision 'keep'"),
    (None, ABTestPhase.AWAITING_DECISION, None),
])
def test_a_held_test_is_decided_only_by_an_annotation_naming_it(annotation: str | None, phase: ABTestPhase,
                                                                why: str | None) -> None:
    held = ABTestStatus(phase=ABTestPhase.AWAITING_DECISION, config_hash="cfg1", verdict="Inconclusive")
    decided, events = apply_decision_annotation(held, annotation, T0)
    assert decided.phase is phase
    if why is not None:  # refused out loud, once
        assert [e.reason for e in events] == ["VerbIgnored"] and why in events[0].message
        assert apply_decision_annotation(decided, annotation, T0) == (decided, [])
    else:
        assert len(events) == (0 if annotation is None else 1)


def test_an_annotation_never_decides_a_test_still_measuring_and_says_so_once() -> None:
    running = ABTestStatus(phase=ABTestPhase.MEASURING, config_hash="cfg1")
    seen, events = apply_decision_annotation(running, "promote:cfg1", T0)
    assert seen.phase is ABTestPhase.MEASURING and seen.decision_annotation == "promote:cfg1"
    assert [e.reason for e in events] == ["VerbIgnored"]
    assert "not AwaitingDecision" in events[0].message and "moonlease promote NAME" in events[0].message
    # Handled: it does not decide the test later either (the promote verb does, in any phase).
    held = seen.model_copy(update={"phase": ABTestPhase.AWAITING_DECISION})
    assert apply_decision_annotation(held, "promote:cfg1", T0) == (held, [])


def test_measurement_is_due_once_per_interval_while_measuring() -> None:
    spec = ABTestSpec.model_validate({**ARMS, "intervalSeconds": 30})
    status = ABTestStatus(phase=ABTestPhase.MEASURING, config_hash="c")
    assert measurement_due(status, spec, T0)  # the baseline
    status = status.model_copy(update={"last_measured_at": T0})
    assert not measurement_due(status, spec, T0 + datetime.timedelta(seconds=29))
    assert measurement_due(status, spec, T0 + datetime.timedelta(seconds=30))
    assert not measurement_due(status.model_copy(update={"phase": ABTestPhase.DEPLOYING}), spec, T0)
    assert not measurement_due(None, spec, T0)
    # The handler's wake-up asks the same owner of the schedule.
    assert seconds_until_measurement(status, spec, T0 + datetime.timedelta(seconds=12)) == 18
    assert seconds_until_measurement(status.model_copy(update={"last_measured_at": None}), spec, T0) == 0
    assert seconds_until_measurement(None, spec, T0) is None


def test_the_baseline_waits_out_the_warm_up() -> None:
    spec = ABTestSpec.model_validate({**ARMS, "intervalSeconds": 30, "warmupSeconds": 90})
    status = ABTestStatus(phase=ABTestPhase.MEASURING, config_hash="c", started_at=T0)
    assert seconds_until_measurement(status, spec, T0) == 90
    assert not measurement_due(status, spec, T0 + datetime.timedelta(seconds=89))
    assert measurement_due(status, spec, T0 + datetime.timedelta(seconds=90))  # the baseline
    measured = status.model_copy(update={"last_measured_at": T0 + datetime.timedelta(seconds=90)})
    assert seconds_until_measurement(measured, spec, T0 + datetime.timedelta(seconds=100)) == 20
    assert ABTestSpec.model_validate(ARMS).warmup_seconds == 60  # the documented default


@pytest.mark.parametrize("raw, violated", [
    (ARMS, set()),
    ({**ARMS, "minSamples": 30, "maxSamples": 30}, set()),
    ({"control": {"workloads": ["a", "b"]}, "treatment": {"workloads": ["b"]}}, {"a workload cannot be in both arms"}),
    ({**ARMS, "minSamples": 10, "maxSamples": 5}, {"maxSamples must be at least minSamples"}),
    ({**ARMS, "conditions": [{"metric": "queued"}]}, {"each condition's metric must be built in or named in"
                                                      " prometheus.customQueries"}),
    ({**ARMS, "conditions": [{"metric": "queued"}], "prometheus": {"url": "http://p:9090", "customQueries": {
        "queued": "sum(x{$selector})"}}}, set()),
    ({**ARMS, "conditions": [{"metric": "externalHitRate"}, {"metric": "ttftP99", "guardrail": True}]},
     {"a built-in metric's direction is fixed"}),
    ({**ARMS, "conditions": [{"metric": "prefixCacheHitRate", "direction": "LowerIsBetter"}]},
     {"a built-in metric's direction is fixed"}),
    ({**ARMS, "conditions": [{"metric": "prefixCacheHitRate"}, {"metric": "putFailedKeys", "direction": "LowerIsBetter",
                                                                "guardrail": True}]}, set()),
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
    assert {next((v for v in violated if f.startswith(v)), f) for f in failed} == violated
    if violated:
        with pytest.raises(ValidationError, match="|".join(violated)):
            ABTestSpec.model_validate(raw)
    else:
        ABTestSpec.model_validate(raw)


@pytest.mark.parametrize("template, rendered", [
    ('sum(rate(q{$selector}[5m]))', 'sum(rate(q{job="a"}[5m]))'),
    ('sum(q{${selector}})', 'sum(q{job="a"})'),
    ('sum(q{$selector, path=~"/v1/.*$$"})', 'sum(q{job="a", path=~"/v1/.*$"})'),
    ('count(q{$selector}) - $$selector', 'count(q{job="a"}) - $selector'),
])
def test_custom_queries_substitute_only_the_documented_placeholders(template: str, rendered: str) -> None:
    from moonlease_operator.api.abtest import render_custom_query

    assert render_custom_query(template, 'job="a"') == rendered


@pytest.mark.parametrize("template", [
    "sum(rate(q{$selector}[$__rate_interval]))", 'q{path=~".*$"}', "q{$selectors}", "q{$sel}", "$",
])
def test_custom_queries_with_any_other_dollar_are_refused_before_use(template: str) -> None:
    from moonlease_operator.api.abtest import render_custom_query

    with pytest.raises(ValueError, match="write [$][$] for a literal [$]"):
        render_custom_query(template, 'job="a"')
    with pytest.raises(ValueError, match="placeholder"):
        ABTestSpec.model_validate({**ARMS, "prometheus": {"url": "http://p:9090", "customQueries": {"q": template}}})


@pytest.mark.parametrize("template, uses", [
    ("sum(q{$selector})", True), ("sum(q{${selector}})", True), ('sum(q{job="a"})', False),
    ("sum(q) - $$selector", False),  # `$$selector` is the literal text "$selector"
    ("sum(q{$$x, $selector})", True),
])
def test_a_custom_query_must_pick_the_arm_with_its_selector(template: str, uses: bool) -> None:
    """Issue 26: a query without `$selector` reads the same series for both arms (the effect is
    always 0: a guardrail that can never fail). The API server's rule and the model agree."""
    import celpy

    from moonlease_operator.api.abtest import PrometheusSpec

    raw = {"url": "http://p:9090", "customQueries": {"q": template}}
    rules = [r for r in PrometheusSpec.cel_rules if "must use $selector" in r.message]
    env = celpy.Environment()
    assert bool(env.program(env.compile(rules[0].rule)).evaluate({"self": celpy.json_to_cel(raw)})) is uses
    if uses:
        PrometheusSpec.model_validate(raw)
    else:
        with pytest.raises(ValidationError, match="must use [$]selector"):
            PrometheusSpec.model_validate(raw)


def test_identical_arm_selectors_are_refused() -> None:
    with pytest.raises(ValidationError, match="selectors.treatment must differ"):
        ABTestSpec.model_validate({**ARMS, "prometheus": {"url": "http://p:9090", "selectors": {
            "control": 'job="vllm"', "treatment": 'job="vllm"'}}})
    with pytest.raises(ValidationError, match="use storeSelector"):
        ABTestSpec.model_validate({**ARMS, "prometheus": {"url": "http://p:9090", "storeSelectors": {
            "control": 'job="m"', "treatment": 'job="m"'}}})
    ABTestSpec.model_validate({**ARMS, "prometheus": {"url": "http://p:9090", "selectors": {
        "control": 'job="vllm-a"', "treatment": 'job="vllm-b"'}}})


def test_master_metrics_need_a_master_per_arm() -> None:
    shared = {**ARMS, "conditions": [{"metric": "putAllocFailures", "direction": "LowerIsBetter"}],
              "prometheus": {"url": "http://p:9090", "storeSelector": 'job="master"'}}
    with pytest.raises(ValueError, match="storeSelectors"):
        ABTestSpec.model_validate(shared)
    separate = {**shared, "prometheus": {"url": "http://p:9090",
                                         "storeSelectors": {"control": 'job="m-a"', "treatment": 'job="m-b"'}}}
    assert ABTestSpec.model_validate(separate).prometheus.store_selectors.treatment == 'job="m-b"'


@pytest.mark.parametrize("phase", [ABTestPhase.PROMOTING, ABTestPhase.PROMOTED, ABTestPhase.ROLLING_BACK,
                                   ABTestPhase.ROLLED_BACK, ABTestPhase.AWAITING_DECISION])
def test_a_decided_test_is_never_measured_again(phase: ABTestPhase) -> None:
    """Stop measuring what was stopped: once the test is decided (or held for a human) the arms
    are not read, so engines stopped after the verdict cause no MeasurementFailed warnings
    (issue 20: the demo printed 23 of them after its verdict)."""
    spec = ABTestSpec.model_validate({**ARMS, "intervalSeconds": 30})
    decided = ABTestStatus(phase=phase, config_hash="c", last_measured_at=T0, decided_at=T0)
    for later in (0, 30, 3600):
        assert not measurement_due(decided, spec, T0 + datetime.timedelta(seconds=later))
    assert seconds_until_measurement(decided, spec, T0 + datetime.timedelta(seconds=30)) is None


def test_a_held_test_says_how_to_decide_it_with_commands_that_name_the_policy() -> None:
    held = ABTestStatus(phase=ABTestPhase.AWAITING_DECISION, config_hash="cfg1", verdict="Inconclusive")
    hint = decision_hint(held, "llama", "serving")
    assert "`moonlease promote llama -n serving`" in hint and "`moonlease abort llama -n serving`" in hint
    assert "kubectl annotate mlp llama -n serving moonlease.io/ab-decision=promote:cfg1" in hint
    assert "NAME" not in hint
