"""What an A/B test does next, and what its status says. Pure.

`build_analysis_config` reads the `ABTestSpec` into the analysis core's config; `plan_ab_action`
is the one place a verdict becomes an action (continue, promote, roll back, hold);
`record_interval` / `build_ab_status` produce the status with a bounded per-interval history.
The handler wiring (measure each interval through `adapters.metric_sources`, apply the action
through the rollout machinery, emit Events) calls these.
"""

from __future__ import annotations

import datetime
import enum
import statistics
from collections.abc import Sequence

from moonlease_operator.api.abtest import (
    ABTestSpec,
    ABTestStatus,
    ArmValues,
    FailureAction,
    IntervalRecord,
    MetricDirection,
    SuccessAction,
)
from moonlease_operator.core.analysis import (
    AbortGuard,
    AnalysisConfig,
    ArmSample,
    Condition,
    Direction,
    IntervalSample,
    Outcome,
    Verdict,
    histogram_quantile,
)

HISTORY_LIMIT = 20


class ABAction(str, enum.Enum):
    CONTINUE = "Continue"
    PROMOTE = "Promote"
    ROLL_BACK = "RollBack"
    HOLD = "Hold"


def build_analysis_config(spec: ABTestSpec) -> AnalysisConfig:
    z = statistics.NormalDist().inv_cdf((1 + spec.confidence) / 2)
    return AnalysisConfig(
        conditions=tuple(
            Condition(c.metric, Direction.HIGHER_IS_BETTER if c.direction is MetricDirection.HIGHER_IS_BETTER
                      else Direction.LOWER_IS_BETTER, c.min_effect, c.max_regression, c.guardrail)
            for c in spec.conditions),
        min_samples=spec.min_samples, max_samples=spec.max_samples, z=z,
        consecutive_error_limit=spec.consecutive_error_limit,
        guard=AbortGuard(consecutive=spec.abort.consecutive_intervals,
                         put_failure_allowance=spec.abort.put_failure_allowance,
                         ttft_threshold_s=spec.abort.ttft_threshold_seconds,
                         ttft_quantile=spec.abort.ttft_quantile),
    )


def plan_ab_action(verdict: Verdict, spec: ABTestSpec) -> ABAction:
    """The action a verdict calls for. Never promotes on anything but Success; an Abort always
    rolls back unless the user holds failures; Error and a final NoData hold for a human
    (the operator could not measure: it does not know which arm is better)."""
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
        put_alloc_failures=sample.put_alloc_failures, evictions=sample.evictions,
    )


def _timestamp(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc)


def record_interval(interval: IntervalSample) -> IntervalRecord:
    return IntervalRecord(
        end=_timestamp(interval.end),
        control=build_arm_values(interval.control) if interval.control is not None else None,
        treatment=build_arm_values(interval.treatment) if interval.treatment is not None else None,
        error=interval.error[:1024] if interval.error else None,
    )


def build_ab_status(intervals: Sequence[IntervalSample], verdict: Verdict, action: ABAction, *,
                    started_at: datetime.datetime, limit: int = HISTORY_LIMIT) -> ABTestStatus:
    """The status after the latest interval; history keeps the newest `limit` intervals."""
    return ABTestStatus(
        verdict=verdict.outcome.value, reason=verdict.reason[:4096], action=action.value,
        samples=verdict.samples, started_at=started_at,
        last_measured_at=_timestamp(intervals[-1].end) if intervals else None,
        history=[record_interval(i) for i in list(intervals)[-limit:]] if limit > 0 else [],
    )
