"""What an A/B test does next, and what its status says. Pure.

`build_analysis_config` reads the `ABTestSpec` into the analysis core's config; `plan_ab_action`
is the one place a verdict becomes an action (continue, promote, roll back, hold);
`record_measurement` folds one measured interval into `status.abTest` (the analysis' running
sums, a bounded per-interval history, the verdict, the events that announce it) and
`apply_decision_annotation` lets a human decide a held test. `core.rollout` calls them and
carries the action out through the staged rollout; the handler measures (adapters.ab_metrics).
"""

from __future__ import annotations

import datetime
import enum
import math
from dataclasses import asdict, dataclass
from typing import Any

from moonlease_operator.api.abtest import ABTestSpec, FailureAction, SuccessAction
from moonlease_operator.api.abtest_status import (
    ABTestPhase,
    ABTestStatus,
    AnalysisStateStatus,
    ArmTotalsStatus,
    ArmValues,
    BucketStatus,
    ConditionResultStatus,
    GuardPointStatus,
    IntervalRecord,
    MeanSumsStatus,
    QuantileSumsStatus,
    RatioSumsStatus,
    SeriesSumsStatus,
)
from moonlease_operator.api.policy import AB_DECISION_ANNOTATION
from moonlease_operator.api.status import Reason
from moonlease_operator.core.analysis import (
    AbortGuard,
    AnalysisConfig,
    AnalysisState,
    ArmSample,
    ArmTotals,
    Condition,
    GuardPoint,
    Histogram,
    IntervalSample,
    MeanSums,
    ConditionResult,
    Outcome,
    QuantileSums,
    RatioSums,
    SeriesSums,
    Verdict,
    decide,
    fold_interval,
    histogram_quantile,
    tuning_look,
)
from moonlease_operator.core.sequential import minimum_detectable_effect
from moonlease_operator.core.events import EventNote

HISTORY_LIMIT = 20
ANALYSIS_FORMAT = 2
"""Version of `status.abTest.analysis`; a state of another version is started afresh."""


class ABAction(str, enum.Enum):
    CONTINUE = "Continue"
    PROMOTE = "Promote"
    ROLL_BACK = "RollBack"
    HOLD = "Hold"


def build_analysis_config(spec: ABTestSpec) -> AnalysisConfig:
    return AnalysisConfig(
        conditions=tuple(
            Condition(c.metric, c.direction, c.min_effect, c.max_regression, c.guardrail)
            for c in spec.conditions),
        min_samples=spec.min_samples, max_samples=spec.max_samples, confidence=spec.confidence,
        consecutive_error_limit=spec.consecutive_error_limit,
        guard=AbortGuard(consecutive=spec.abort.consecutive_intervals,
                         put_failure_allowance=spec.abort.put_failure_allowance if spec.abort.put_failure_guard
                         else None,
                         put_failure_rate_allowance=spec.abort.put_failure_rate_allowance,
                         ttft_threshold_s=spec.abort.ttft_threshold_seconds,
                         ttft_quantile=spec.abort.ttft_quantile),
    )


@dataclass(frozen=True)
class ABDesign:
    """What an A/B test spec commits to, before any data (`moonlease plan -f`): the conditions,
    the error rate, the looks, and what it can detect."""

    conditions: tuple[Condition, ...]
    alpha: float
    """1 - confidence: the family-wise error of all decisions, however often the test looks."""
    family: int
    """Hypotheses in Holm's family: the conditions (the put-failure guard adds one once measured)."""
    put_failure_guard: bool
    min_samples: int
    max_samples: int
    interval_seconds: int
    warmup_seconds: int
    tuned_at: int
    """The look the always-valid boundary is tightest at (`core.analysis.tuning_look`)."""
    detectable_at_min: float
    """Minimum detectable effect at look minSamples (80 % power, independent intervals), in σ:
    the standard deviation of the per-interval difference treatment - control."""
    detectable_at_max: float
    """The same at look maxSamples."""

    @property
    def shortest_seconds(self) -> int:
        """Warm-up and baseline, then minSamples intervals: the earliest decision."""
        return self.warmup_seconds + self.min_samples * self.interval_seconds

    @property
    def longest_seconds(self) -> int:
        return self.warmup_seconds + self.max_samples * self.interval_seconds


def build_ab_design(spec: ABTestSpec) -> ABDesign:
    """The design of `spec`, with the detectable effects the docs' table is computed with
    (`core.sequential.minimum_detectable_effect`, Holm's first step over the conditions)."""
    config = build_analysis_config(spec)
    tuned_at = tuning_look(config)

    def detectable(n: int) -> float:
        return minimum_detectable_effect(n, conditions=len(config.conditions), confidence=spec.confidence,
                                         tuned_at=tuned_at)

    return ABDesign(conditions=config.conditions, alpha=1.0 - spec.confidence, family=len(config.conditions),
                    put_failure_guard=spec.abort.put_failure_guard, min_samples=spec.min_samples,
                    max_samples=spec.max_samples, interval_seconds=spec.interval_seconds,
                    warmup_seconds=spec.warmup_seconds, tuned_at=tuned_at,
                    detectable_at_min=detectable(spec.min_samples), detectable_at_max=detectable(spec.max_samples))


def plan_ab_action(verdict: Verdict, spec: ABTestSpec) -> ABAction:
    """The action a verdict calls for. Never promotes on anything but Success; an Abort always
    rolls back unless the user holds failures; a final NoData holds for a human (the operator
    could not measure: it does not know which arm is better); Error is never final (measuring
    goes on until the source answers again)."""
    if verdict.outcome is Outcome.ABORT:
        return ABAction.ROLL_BACK if spec.on_failure is FailureAction.ROLLBACK else ABAction.HOLD
    if not verdict.final:
        return ABAction.CONTINUE
    if verdict.outcome is Outcome.SUCCESS:
        return ABAction.PROMOTE if spec.on_success is SuccessAction.PROMOTE else ABAction.HOLD
    if verdict.outcome is Outcome.FAILURE:
        return ABAction.ROLL_BACK if spec.on_failure is FailureAction.ROLLBACK else ABAction.HOLD
    if verdict.outcome is Outcome.INCONCLUSIVE:
        return ABAction.ROLL_BACK if spec.on_inconclusive is FailureAction.ROLLBACK else ABAction.HOLD
    return ABAction.HOLD


def _ratio(hits: float | None, queries: float | None) -> float | None:
    return hits / queries if hits is not None and queries else None


def build_arm_values(sample: ArmSample) -> ArmValues:
    return ArmValues(
        prefix_hit_rate=_ratio(sample.prefix_hits, sample.prefix_queries),
        external_hit_rate=_ratio(sample.external_hits, sample.external_queries),
        ttft_p90_seconds=histogram_quantile(0.9, sample.ttft) if sample.ttft is not None else None,
        put_alloc_failures=sample.put_alloc_failures, put_failed_keys=sample.put_failed_keys,
        evictions=sample.evictions,
    )


def _timestamp(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(round(seconds), tz=datetime.UTC)  # API precision


def record_interval(interval: IntervalSample) -> IntervalRecord:
    return IntervalRecord(
        end=_timestamp(interval.end),
        control=build_arm_values(interval.control) if interval.control is not None else None,
        treatment=build_arm_values(interval.treatment) if interval.treatment is not None else None,
        error=interval.error[:1024] if interval.error else None,
    )


# ---- the analysis state in the status -------------------------------------------------------------

def _dump_totals(totals: ArmTotals) -> ArmTotalsStatus:
    ttft = totals.ttft
    return ArmTotalsStatus(
        prefix=RatioSumsStatus(**asdict(totals.prefix)), external=RatioSumsStatus(**asdict(totals.external)),
        ttft=QuantileSumsStatus(
            quantiles=list(ttft.quantiles), intervals=ttft.intervals,
            pooled=[BucketStatus(le="+Inf" if math.isinf(le) else repr(le), count=c)
                    for le, c in (ttft.pooled.buckets if ttft.pooled else ())],
            batches=[MeanSumsStatus(**asdict(b)) for b in ttft.batches]),
        put_alloc_failures=MeanSumsStatus(**asdict(totals.put_alloc_failures)),
        put_failed_keys=MeanSumsStatus(**asdict(totals.put_failed_keys)),
        evictions=MeanSumsStatus(**asdict(totals.evictions)),
        custom={name: MeanSumsStatus(**asdict(m)) for name, m in sorted(totals.custom.items())},
    )


def _load_totals(raw: ArmTotalsStatus) -> ArmTotals:
    def mean(m: MeanSumsStatus) -> MeanSums:
        return MeanSums(**m.model_dump())

    ttft = raw.ttft
    pooled = Histogram(tuple((float(b.le), b.count) for b in ttft.pooled)) if ttft.pooled else None
    return ArmTotals(
        prefix=RatioSums(**raw.prefix.model_dump()), external=RatioSums(**raw.external.model_dump()),
        ttft=QuantileSums(tuple(ttft.quantiles), pooled, ttft.intervals, tuple(mean(b) for b in ttft.batches)),
        put_alloc_failures=mean(raw.put_alloc_failures), put_failed_keys=mean(raw.put_failed_keys),
        evictions=mean(raw.evictions),
        custom={name: mean(m) for name, m in raw.custom.items()},
    )


def dump_analysis(state: AnalysisState) -> AnalysisStateStatus:
    return AnalysisStateStatus(
        format=ANALYSIS_FORMAT, samples=state.samples, consecutive_errors=state.consecutive_errors,
        last_error=state.last_error[:4096] if state.last_error else None,
        control=_dump_totals(state.control), treatment=_dump_totals(state.treatment),
        recent=[GuardPointStatus(**asdict(p)) for p in state.recent],
        paired={metric: SeriesSumsStatus(**asdict(sums)) for metric, sums in sorted(state.paired.items())},
    )


def load_analysis(raw: AnalysisStateStatus | None) -> AnalysisState:
    """The state `dump_analysis` wrote; an absent one, or one of another format, starts afresh
    (the test then needs its samples again: slower, never wrong)."""
    if raw is None or raw.format != ANALYSIS_FORMAT:
        return AnalysisState()
    return AnalysisState(
        samples=raw.samples, consecutive_errors=raw.consecutive_errors, last_error=raw.last_error,
        control=_load_totals(raw.control), treatment=_load_totals(raw.treatment),
        recent=tuple(GuardPoint(**p.model_dump()) for p in raw.recent),
        paired={metric: SeriesSums(sums.n, tuple(sums.origin), tuple(sums.total), tuple(sums.lag0),
                                   tuple(sums.lag1), tuple(sums.last)) for metric, sums in raw.paired.items()},
    )


def summarize_arm(totals: ArmTotals) -> ArmValues:
    """An arm's estimates over the whole test, for the status."""
    def value(estimate: Any) -> float | None:
        return None if estimate is None else float(estimate.value)

    return ArmValues(
        prefix_hit_rate=value(totals.prefix.estimate()), external_hit_rate=value(totals.external.estimate()),
        ttft_p90_seconds=value(totals.ttft.estimate(0.9)),
        put_alloc_failures=value(totals.put_alloc_failures.estimate()),
        put_failed_keys=value(totals.put_failed_keys.estimate()), evictions=value(totals.evictions.estimate()),
    )


def _finite(value: float | None) -> float | None:
    """JSON has no infinities: an unbounded side is left unset."""
    return value if value is not None and math.isfinite(value) else None


def build_condition_results(results: tuple[ConditionResult, ...],
                            conditions: tuple[Condition, ...] = ()) -> list[ConditionResultStatus]:
    guardrails = {c.metric for c in conditions if c.guardrail}
    return [ConditionResultStatus(
        metric=r.metric, outcome=r.outcome.value,
        control=_finite(r.control.value) if r.control is not None else None,
        treatment=_finite(r.treatment.value) if r.treatment is not None else None,
        effect=_finite(r.effect), lower=_finite(r.lower), upper=_finite(r.upper),
        p_value=_finite(r.p_value), level=_finite(r.level), threshold=r.threshold,
        autocorrelation=_finite(r.autocorrelation), paired=r.paired if r.effect is not None else None,
        samples=r.samples if r.effect is not None else None,
        guardrail=True if r.metric in guardrails else None,
    ) for r in results]


# ---- the test's progress ---------------------------------------------------------------------------

_NEXT_PHASE = {
    ABAction.CONTINUE: ABTestPhase.MEASURING, ABAction.PROMOTE: ABTestPhase.PROMOTING,
    ABAction.ROLL_BACK: ABTestPhase.ROLLING_BACK, ABAction.HOLD: ABTestPhase.AWAITING_DECISION,
}
_BAD_OUTCOMES = (Outcome.FAILURE, Outcome.ABORT, Outcome.ERROR, Outcome.NO_DATA)


@dataclass(frozen=True)
class ABReading:
    """What the handler measured this reconcile: the baseline (no interval yet) or one interval."""

    at: datetime.datetime
    interval: IntervalSample | None


def begin_test(previous: ABTestStatus | None, config_hash: str) -> ABTestStatus:
    """The test of `config_hash`: the one under way if it tests the same configuration (a
    restarted operator, a spec edit outside connector and master), else a fresh one."""
    if previous is not None and previous.config_hash == config_hash:
        return previous
    return ABTestStatus(phase=ABTestPhase.DEPLOYING, config_hash=config_hash)


def start_measuring(status: ABTestStatus, spec: ABTestSpec, control: list[str], treatment: list[str],
                    now: datetime.datetime) -> tuple[ABTestStatus, list[EventNote]]:
    """The treatment runs the configuration, verified: measuring starts."""
    source = f"Prometheus at {spec.prometheus.url}" if spec.prometheus else f"the pods' :{spec.scrape.port}{spec.scrape.path}"
    message = (f"A/B test of configuration {status.config_hash}: control {', '.join(control)} against treatment "
               f"{', '.join(treatment)}, every {spec.interval_seconds}s from {source} after a {spec.warmup_seconds}s warm-up; "
               f"at least {spec.min_samples}"
               + f", at most {spec.max_samples} samples")
    return status.model_copy(update={"phase": ABTestPhase.MEASURING, "started_at": now, "verdict": None,
                                     "reason": message}), [EventNote("Normal", Reason.AB_TEST_STARTED.value, message)]


def record_measurement(status: ABTestStatus, spec: ABTestSpec, reading: ABReading,
                       now: datetime.datetime, *, policy: str,
                       namespace: str | None) -> tuple[ABTestStatus, list[EventNote]]:
    """Fold one reading into a measuring test: the verdict, the action it calls for, and the
    events that say so (a failed measurement, a changed verdict, a decision). `policy` and
    `namespace` name the policy in the commands a held test's event suggests."""
    if reading.interval is None:
        return status.model_copy(update={"last_measured_at": reading.at}), []
    config = build_analysis_config(spec)
    state = fold_interval(load_analysis(status.analysis), reading.interval, config)
    verdict = decide(state, config)
    action = plan_ab_action(verdict, spec)
    events = []
    if reading.interval.failed:
        events.append(EventNote("Warning", Reason.MEASUREMENT_FAILED.value,
                                f"Measuring the arms failed ({state.consecutive_errors} in a row, limit "
                                f"{spec.consecutive_error_limit}): {state.last_error}"))
    if status.verdict == Outcome.ERROR.value and not reading.interval.failed:
        events.append(EventNote("Normal", Reason.AB_TEST_VERDICT.value,
                                f"Measuring again: the metric source answered after {status.consecutive_errors} "
                                "failed measurements"))
    entering_error = verdict.outcome is Outcome.ERROR and status.verdict != Outcome.ERROR.value
    if action is not ABAction.CONTINUE or entering_error or (
            verdict.outcome.value != status.verdict and verdict.samples >= spec.min_samples):
        kind = "Warning" if verdict.outcome in _BAD_OUTCOMES else "Normal"
        events.append(EventNote(kind, Reason.AB_TEST_VERDICT.value,
                                f"{verdict.outcome.value} after {verdict.samples} samples: {verdict.reason}"))
    if action is ABAction.PROMOTE:
        events.append(EventNote("Normal", Reason.AB_TEST_PROMOTING.value, "Promoting the treatment's configuration to the control"))
    elif action is ABAction.ROLL_BACK:
        events.append(EventNote("Warning", Reason.AB_TEST_ROLLING_BACK.value,
                                "Rolling the treatment back to what it ran before the test"))
    elif action is ABAction.HOLD:
        events.append(EventNote("Normal", Reason.AB_TEST_AWAITING_DECISION.value, decision_hint(status, policy, namespace)))
    history = [*status.history, record_interval(reading.interval)][-HISTORY_LIMIT:]
    return status.model_copy(update={
        "phase": _NEXT_PHASE[action], "verdict": verdict.outcome.value, "reason": verdict.reason[:4096],
        "final_verdict": verdict.outcome.value if action is not ABAction.CONTINUE else None,
        "progress": f"{verdict.samples}/{spec.max_samples}",
        "conditions": build_condition_results(verdict.conditions, config.conditions) or status.conditions,
        "action": action.value, "samples": verdict.samples, "consecutive_errors": verdict.consecutive_errors,
        "last_measured_at": reading.at, "decided_at": now if action is not ABAction.CONTINUE else None,
        "control": summarize_arm(state.control), "treatment": summarize_arm(state.treatment),
        "history": history, "analysis": dump_analysis(state),
    }), events


def decision_hint(status: ABTestStatus, policy: str, namespace: str | None) -> str:
    """The commands that decide a held test, ready to paste (the verbs work in every phase)."""
    where = f" -n {namespace}" if namespace else ""
    return (f"Holding both arms for a human: `moonlease promote {policy}{where}` keeps the treatment, "
            f"`moonlease abort {policy}{where}` rolls it back (or: kubectl annotate mlp {policy}{where} "
            f"{AB_DECISION_ANNOTATION}=promote:{status.config_hash} --overwrite)")


def apply_decision_annotation(status: ABTestStatus, annotation: str | None,
                              now: datetime.datetime) -> tuple[ABTestStatus, list[EventNote]]:
    """A held test decided by a human: `promote:<configHash>` or `rollback:<configHash>`.

    Each annotation value is handled once (`decision_annotation`): applied while the test awaits
    a decision, otherwise refused with a VerbIgnored event that says why and what to use instead
    (the `promote`/`abort` verbs work in every phase) — never silently ignored."""
    if not annotation or annotation == status.decision_annotation:
        return status, []
    seen = status.model_copy(update={"decision_annotation": annotation[:256]})
    decision, _, config_hash = annotation.partition(":")
    shown = annotation[:80]
    why = None
    if decision not in ("promote", "rollback"):
        why = f"unknown decision {decision[:20]!r}: the value is promote:<configHash> or rollback:<configHash>"
    elif config_hash != status.config_hash:
        why = f"it names configuration {config_hash[:20]!r}; the test runs {status.config_hash}"
    elif status.phase is not ABTestPhase.AWAITING_DECISION:
        why = (f"the test is {status.phase.value}, not AwaitingDecision; `moonlease promote NAME` or"
               f" `moonlease abort NAME` decide in any phase")
    if why is not None:
        return seen, [EventNote("Warning", Reason.VERB_IGNORED.value,
                                f"{AB_DECISION_ANNOTATION}={shown} ignored: {why}")]
    if decision == "promote":
        return seen.model_copy(update={"phase": ABTestPhase.PROMOTING, "action": ABAction.PROMOTE.value,
                                       "decided_at": now}), [
            EventNote("Normal", Reason.AB_TEST_PROMOTING.value, "Promoting the treatment's configuration to the control, as annotated")]
    return seen.model_copy(update={"phase": ABTestPhase.ROLLING_BACK, "action": ABAction.ROLL_BACK.value,
                                   "decided_at": now}), [
        EventNote("Warning", Reason.AB_TEST_ROLLING_BACK.value, "Rolling the treatment back, as annotated")]


def seconds_until_measurement(status: ABTestStatus | None, spec: ABTestSpec | None,
                              now: datetime.datetime) -> float | None:
    """Seconds until the arms are read next (<= 0: now); None when the test is not measuring.

    The first read is the baseline, `warmupSeconds` after measuring started (caches warm up
    first); then one every `intervalSeconds`."""
    if status is None or spec is None or status.phase is not ABTestPhase.MEASURING:
        return None
    due = next_measurement_at(status, spec)
    return 0.0 if due is None else (due - now).total_seconds()


def next_measurement_at(status: ABTestStatus, spec: ABTestSpec) -> datetime.datetime | None:
    """When a measuring test reads its arms next: the baseline `warmupSeconds` after measuring
    started, then every `intervalSeconds` after the last read; None when not measuring (or,
    measuring without a start time, at once)."""
    if status.phase is not ABTestPhase.MEASURING:
        return None
    if status.last_measured_at is not None:
        return status.last_measured_at + datetime.timedelta(seconds=spec.interval_seconds)
    if status.started_at is None:
        return None
    return status.started_at + datetime.timedelta(seconds=spec.warmup_seconds)


def measurement_due(status: ABTestStatus | None, spec: ABTestSpec | None, now: datetime.datetime) -> bool:
    """Whether this reconcile should read the arms' metrics."""
    due_in = seconds_until_measurement(status, spec, now)
    return due_in is not None and due_in <= 0
