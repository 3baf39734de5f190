"""The decision: each condition's paired effect against its threshold on always-valid bounds,
Holm's step-down across conditions, the early abort guard, and the fold of one interval into
the constant-size `AnalysisState` the policy status keeps. Pure."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from moonlease_operator.api.abtest import BuiltinMetric, MetricDirection
from moonlease_operator.core.sequential import (
    HolmStep,
    always_valid_critical,
    always_valid_p,
    effective_df,
    holm,
    planned_rho,
    tuned_mixture,
    variance_inflation,
)
from moonlease_operator.core.analysis.samples import (
    AbortGuard,
    AnalysisConfig,
    Arm,
    ArmSample,
    Condition,
    ConditionResult,
    Estimate,
    IntervalSample,
    Outcome,
    TTFT_QUANTILES,
    Verdict,
    histogram_quantile,
)
from moonlease_operator.core.analysis.estimators import (
    ArmTotals,
)
from moonlease_operator.core.analysis.series import (
    SeriesSums,
    series_estimate,
)


# ---- the decision -------------------------------------------------------------------------------

def tuning_look(config: AnalysisConfig) -> int:
    """The look at which the always-valid boundary is made tightest: the geometric middle of
    the planned looks (minSamples..maxSamples), so early and late looks both stay usable."""
    top = config.max_samples if config.max_samples is not None else 4 * config.min_samples
    return max(config.min_samples, round(math.sqrt(config.min_samples * top)))


RATIO_METRICS = (BuiltinMetric.PREFIX_HIT_RATE.value, BuiltinMetric.EXTERNAL_HIT_RATE.value)


def paired_vector(metric: str, control: ArmSample, treatment: ArmSample) -> tuple[float, ...] | None:
    """What one interval adds to a condition's paired series: (hits_t, queries_t, hits_c,
    queries_c) for a hit rate, (value_t, value_c) otherwise; None unless both arms have it."""
    if metric in RATIO_METRICS:
        prefix = metric == BuiltinMetric.PREFIX_HIT_RATE.value
        ht, qt = (treatment.prefix_hits, treatment.prefix_queries) if prefix else (
            treatment.external_hits, treatment.external_queries)
        hc, qc = (control.prefix_hits, control.prefix_queries) if prefix else (
            control.external_hits, control.external_queries)
        if ht is None or qt is None or hc is None or qc is None or qt <= 0 or qc <= 0:
            return None
        return ht, qt, hc, qc
    t, c = _interval_value(metric, treatment), _interval_value(metric, control)
    return None if t is None or c is None else (t, c)


def _interval_value(metric: str, sample: ArmSample) -> float | None:
    if metric in TTFT_QUANTILES:
        return histogram_quantile(TTFT_QUANTILES[metric], sample.ttft) if sample.ttft is not None else None
    if metric == BuiltinMetric.PUT_FAILURES.value:
        return sample.put_alloc_failures
    if metric == BuiltinMetric.PUT_FAILED_KEYS.value:
        return sample.put_failed_keys
    if metric == BuiltinMetric.EVICTIONS.value:
        return sample.evictions
    return sample.custom.get(metric)


def paired_effect(metric: str, sums: SeriesSums) -> tuple[float, tuple[float, ...]]:
    """Treatment - control (higher is better's sign) over the paired intervals, and its gradient
    in the series' vector (the delta method's linearisation)."""
    means = sums.means()
    if metric in RATIO_METRICS:
        ht, qt, hc, qc = means
        rt, rc = ht / qt, hc / qc
        return rt - rc, (1.0 / qt, -rt / qt, -1.0 / qc, rc / qc)
    return means[0] - means[1], (1.0, -1.0)


@dataclass(frozen=True)
class _Comparison:
    """One condition's estimates before the family-wise step."""

    condition: Condition
    control: Estimate | None
    treatment: Estimate | None
    effect: float | None
    stderr: float | None
    samples: int
    df: int
    threshold: float
    """The effect the condition is decided against (+minEffect, or -maxRegression)."""
    p_value: float
    autocorrelation: float | None = None
    paired: bool = False


def _threshold(condition: Condition, effect: float) -> float | None:
    """The threshold the estimate is tested against: -maxRegression for a guardrail; for a
    primary condition the one on the estimate's side (None inside the indifference zone)."""
    if condition.guardrail:
        return -condition.max_regression
    if effect >= condition.min_effect:
        return condition.min_effect
    if effect <= -condition.max_regression:
        return -condition.max_regression
    return None


def _compare(condition: Condition, state: AnalysisState, r: float) -> _Comparison:
    c = state.control.estimate(condition.metric)
    t = state.treatment.estimate(condition.metric)
    sign = 1.0 if condition.direction is MetricDirection.HIGHER_IS_BETTER else -1.0
    sums = state.paired.get(condition.metric)
    if sums is not None and sums.n >= 2:
        raw, gradient = paired_effect(condition.metric, sums)
        series = series_estimate(*sums.autocovariances(gradient), sums.n)
        effect, n, paired = sign * raw, sums.n, True
        stderr, df, autocorrelation = series.stderr, series.df, series.autocorrelation
    elif c is not None and t is not None:
        # The documented fallback: the arms' own (independent-interval) standard errors, inflated
        # by the prior autocorrelation, since this path has no paired series to estimate it from.
        n = min(c.samples, t.samples)
        inflation = variance_inflation(planned_rho(0.0, max(n, 2)), max(n, 2))
        effect, paired, autocorrelation = sign * (t.value - c.value), False, None
        stderr = math.sqrt((c.stderr ** 2 + t.stderr ** 2) * inflation)
        df = effective_df(max(n, 2), inflation)
    else:
        return _Comparison(condition, c, t, None, None, 0, 0, 0.0, 1.0)
    threshold = _threshold(condition, effect)
    if threshold is None:
        return _Comparison(condition, c, t, effect, stderr, n, df, 0.0, 1.0, autocorrelation, paired)
    p_value = always_valid_p(effect - threshold, stderr, n, r, df)
    return _Comparison(condition, c, t, effect, stderr, n, df, threshold, p_value, autocorrelation, paired)


def evaluate_conditions(conditions: Sequence[Condition], state: AnalysisState, *,
                        confidence: float, tuned_at: int, guard: AbortGuard | None = None,
                        ) -> tuple[tuple[ConditionResult, ...], str | None]:
    """Every condition's result: always-valid p-values against the thresholds the conditions
    are decided on (`core.sequential`), Holm's step-down across the conditions at alpha =
    1 - confidence, and each condition's confidence sequence at the level Holm tested it at.
    A condition decides only when Holm rejects its threshold:

    * Failure: the upper bound below -maxRegression;
    * Success: the lower bound above minEffect (a guardrail: above -maxRegression, "within
      tolerance"); Inconclusive otherwise (a guardrail is pending);
    * NoData: an arm never measured it.

    The put guard (`AbortGuard`), when it has data, is one more hypothesis in the family: the
    second value is why it fires (Abort), or None.
    """
    alpha = 1.0 - confidence
    r = tuned_mixture(tuned_at, alpha)
    comparisons = [_compare(c, state, r) for c in conditions]
    put = _put_guard(state, guard, r) if guard is not None else None
    steps = holm([x.p_value for x in comparisons] + ([put.p_value] if put is not None else []), alpha)
    results = tuple(_result(x, step, r) for x, step in zip(comparisons, steps))
    abort = None
    if put is not None and steps[-1].rejected:
        assert put.stderr is not None  # the put guard is built from a series, which has one
        critical = always_valid_critical(steps[-1].level, put.samples, r, put.df)
        abort = (f"treatment {'failed-put rate' if put.condition.metric == 'putFailureRate' else 'put failures per interval'}"
                 f" above control's by {put.effect:.3g} ± {critical * put.stderr:.3g} over {put.samples} intervals "
                 f"(allowance {put.threshold:g}, p {put.p_value:.2g} vs {steps[-1].level:.2g})")
    return results, abort


def _result(x: _Comparison, step: HolmStep, r: float) -> ConditionResult:
    condition = x.condition
    if x.effect is None or x.stderr is None or x.control is None or x.treatment is None:
        missing = " and ".join(arm.value for arm, e in ((Arm.CONTROL, x.control), (Arm.TREATMENT, x.treatment))
                               if e is None)
        return ConditionResult(condition.metric, x.control, x.treatment, None, None, Outcome.NO_DATA,
                               f"{condition.metric}: no data for {missing}")
    critical = always_valid_critical(step.level, x.samples, r, x.df)
    half = math.inf if math.isinf(critical) or math.isinf(x.stderr) else critical * x.stderr
    lower, upper = x.effect - half, x.effect + half
    rho = f", lag-1 autocorrelation {x.autocorrelation:.2f}" if x.autocorrelation is not None else ""
    described = (f"{condition.metric}: treatment {x.treatment.value:.4g} vs control {x.control.value:.4g} "
                 f"(effect {x.effect:+.4g} ± {half:.3g}, p {x.p_value:.2g} vs {step.level:.2g}"
                 f"{'' if x.paired else ', unpaired'}{rho})")
    threshold = _threshold(condition, x.effect)

    def result(outcome: Outcome, why: str) -> ConditionResult:
        return ConditionResult(condition.metric, x.control, x.treatment, x.effect, x.stderr, outcome,
                               f"{described}: {why}", lower=lower, upper=upper, p_value=x.p_value,
                               level=step.level, autocorrelation=x.autocorrelation, paired=x.paired,
                               samples=x.samples, threshold=threshold)

    if step.rejected and x.effect < x.threshold:
        return result(Outcome.FAILURE, f"worse beyond tolerance {condition.max_regression:g}")
    if step.rejected:
        return result(Outcome.SUCCESS, f"within tolerance {condition.max_regression:g}" if condition.guardrail
                      else f"better by at least {condition.min_effect:g}")
    if condition.guardrail:
        return result(Outcome.INCONCLUSIVE, "pending: not yet shown within tolerance")
    if _threshold(condition, x.effect) is None:
        return result(Outcome.INCONCLUSIVE, "between the thresholds")
    return result(Outcome.INCONCLUSIVE, "not significant")


GUARD_WINDOW = 20
"""Measured intervals the state keeps for the abort guard (its `consecutive` is at most this)."""


@dataclass(frozen=True)
class GuardPoint:
    """What the abort guard reads of one measured interval."""

    put_excess: float | None
    """Treatment put failures minus the control's (failed put keys of the arms' engines, else
    the masters' allocation failures); None if either is missing. For the status: the put
    guard itself tests the paired series (`_put_guard`)."""
    treatment_ttft_s: float | None
    """The treatment's TTFT at the guard's quantile; None if not measured."""


def build_guard_point(interval: IntervalSample, guard: AbortGuard) -> GuardPoint:
    c, t = interval.control, interval.treatment
    excess = None
    if c is not None and t is not None:
        # The arms' own failed puts when their engines report them (they tell arms apart on one
        # shared store); else the masters' allocation failures (apart only with a master per arm).
        if c.put_failed_keys is not None and t.put_failed_keys is not None:
            excess = t.put_failed_keys - c.put_failed_keys
        elif c.put_alloc_failures is not None and t.put_alloc_failures is not None:
            excess = t.put_alloc_failures - c.put_alloc_failures
    ttft = histogram_quantile(guard.ttft_quantile, t.ttft) if t is not None and t.ttft is not None else None
    return GuardPoint(excess, ttft)


def evaluate_guard(guard: AbortGuard, points: Sequence[GuardPoint]) -> str | None:
    """Why the TTFT guard fires on the latest measured intervals (oldest first), or None."""
    if guard.consecutive < 1 or len(points) < guard.consecutive or guard.ttft_threshold_s is None:
        return None
    latest = points[-guard.consecutive:]
    quantiles = [p.treatment_ttft_s for p in latest if p.treatment_ttft_s is not None]
    if len(quantiles) == len(latest) and all(v > guard.ttft_threshold_s for v in quantiles):
        return (f"treatment TTFT p{guard.ttft_quantile * 100:g} {', '.join(f'{v:.3g}s' for v in quantiles)} "
                f"past the failure threshold {guard.ttft_threshold_s:g}s in the last {len(quantiles)} intervals")
    return None


PUT_RATE_SERIES = "_putFailureRate"
"""State key of the paired (failed_t, attempted_t, failed_c, attempted_c) put series."""
PUT_COUNT_SERIES = "_putFailures"
"""State key of the paired (failed_t, failed_c) put series (attempted puts unknown)."""


def put_vectors(control: ArmSample, treatment: ArmSample) -> dict[str, tuple[float, ...]]:
    """What one interval adds to the put guard's series: the arms' failed puts and attempted
    puts (failed put keys of their engines; the masters' allocation failures when the engines
    say nothing, counts only)."""
    out: dict[str, tuple[float, ...]] = {}
    ft, fc = treatment.put_failed_keys, control.put_failed_keys
    if ft is not None and fc is not None:
        kt, kc = treatment.put_keys, control.put_keys
        if kt is not None and kc is not None and kt > 0 and kc > 0:
            out[PUT_RATE_SERIES] = (ft, kt, fc, kc)
        else:
            out[PUT_COUNT_SERIES] = (ft, fc)
    elif treatment.put_alloc_failures is not None and control.put_alloc_failures is not None:
        out[PUT_COUNT_SERIES] = (treatment.put_alloc_failures, control.put_alloc_failures)
    return out


def _put_guard(state: AnalysisState, guard: AbortGuard, r: float) -> _Comparison | None:
    """The put guard as a comparison: effect = treatment's failed-put rate (or count) minus the
    control's, positive = worse; its p-value tests "no more than the allowance"."""
    if guard.put_failure_allowance is None:
        return None
    rates = state.paired.get(PUT_RATE_SERIES)
    counts = state.paired.get(PUT_COUNT_SERIES)
    if rates is not None and rates.n >= 2:
        sums, metric, allowance = rates, RATIO_METRICS[0], guard.put_failure_rate_allowance
    elif counts is not None and counts.n >= 2:
        sums, metric, allowance = counts, "", guard.put_failure_allowance
    else:
        return None
    effect, gradient = paired_effect(metric, sums)
    series = series_estimate(*sums.autocovariances(gradient), sums.n)
    condition = Condition("putFailureRate" if sums is rates else "putFailures",
                          MetricDirection.LOWER_IS_BETTER, max_regression=allowance, guardrail=True)
    p_value = always_valid_p(effect - allowance, series.stderr, sums.n, r, series.df) if effect > allowance else 1.0
    return _Comparison(condition, None, None, effect, series.stderr, sums.n, series.df, allowance, p_value,
                       series.autocorrelation, True)


@dataclass(frozen=True)
class AnalysisState:
    """Everything the verdict depends on, folded interval by interval (`fold_interval`).

    Constant size whatever the number of intervals: the operator keeps it in the policy status,
    so a restarted operator decides exactly as the one before it would have.
    """

    samples: int = 0
    """Measured intervals (both arms present)."""
    consecutive_errors: int = 0
    last_error: str | None = None
    control: ArmTotals = ArmTotals()
    treatment: ArmTotals = ArmTotals()
    recent: tuple[GuardPoint, ...] = ()
    """The latest `GUARD_WINDOW` measured intervals, oldest first."""
    paired: Mapping[str, SeriesSums] = field(default_factory=dict)
    """Per condition's metric: the paired series of the intervals where both arms measured it."""


def fold_interval(state: AnalysisState, interval: IntervalSample, config: AnalysisConfig) -> AnalysisState:
    """The state after one more interval. A failed measurement adds nothing but an error:
    it can delay a decision, never produce one."""
    if interval.failed or interval.control is None or interval.treatment is None:
        return replace(state, consecutive_errors=state.consecutive_errors + 1,
                       last_error=interval.error or "an arm was not measured")
    paired = dict(state.paired)
    vectors = {metric: paired_vector(metric, interval.control, interval.treatment)
               for metric in dict.fromkeys(c.metric for c in config.conditions)}
    if config.guard.put_failure_allowance is not None:
        vectors.update(put_vectors(interval.control, interval.treatment))
    for key, vector in vectors.items():
        if vector is not None:
            paired[key] = paired.get(key, SeriesSums()).add(vector)
    return AnalysisState(
        samples=state.samples + 1, consecutive_errors=0, last_error=None,
        control=state.control.add(interval.control), treatment=state.treatment.add(interval.treatment),
        recent=(*state.recent, build_guard_point(interval, config.guard))[-GUARD_WINDOW:],
        paired=paired,
    )


def decide(state: AnalysisState, config: AnalysisConfig) -> Verdict:
    """The verdict of an A/B analysis from its folded state.

    Order of precedence: Error (too many consecutive failed measurements) > Abort (guard) >
    Failure (once min_samples intervals were measured) > NoData (a condition's metric missing
    everywhere) > Success > Inconclusive.
    """
    n, errors = state.samples, state.consecutive_errors
    if errors > config.consecutive_error_limit:
        # Not final: the source may come back (Prometheus restarting), and the next good
        # measurement resumes the test where it stopped; nothing is decided meanwhile.
        return Verdict(Outcome.ERROR, f"{errors} consecutive failed measurements (limit "
                       f"{config.consecutive_error_limit}; measuring resumes when the metric source answers); "
                       f"last: {state.last_error}", False, n, errors)
    abort = evaluate_guard(config.guard, state.recent)
    if abort is not None:
        return Verdict(Outcome.ABORT, abort, True, n, errors)
    results, put_abort = evaluate_conditions(config.conditions, state, confidence=config.confidence,
                                             tuned_at=tuning_look(config), guard=config.guard)
    if put_abort is not None:
        return Verdict(Outcome.ABORT, put_abort, True, n, errors, results)
    out_of_samples = config.max_samples is not None and n >= config.max_samples
    if n < config.min_samples:
        note = f"; last measurement failed: {state.last_error}" if errors else ""
        return Verdict(Outcome.INCONCLUSIVE, f"{n} of {config.min_samples} samples measured{note}",
                       False, n, errors, results)
    failures = [r for r in results if r.outcome is Outcome.FAILURE]
    if failures:  # whatever the others say, NoData included
        return Verdict(Outcome.FAILURE, "; ".join(r.reason for r in failures), True, n, errors, results)
    no_data = [r for r in results if r.outcome is Outcome.NO_DATA]
    if no_data:
        return Verdict(Outcome.NO_DATA, "; ".join(r.reason for r in no_data), out_of_samples, n, errors, results)
    if all(r.outcome is Outcome.SUCCESS for r in results):
        required = [r for r, c in zip(results, config.conditions) if not c.guardrail]
        return Verdict(Outcome.SUCCESS, "; ".join(r.reason for r in required), True, n, errors, results)
    pending = "; ".join(r.reason for r in results if r.outcome is Outcome.INCONCLUSIVE)
    suffix = f" after the maximum of {config.max_samples} samples" if out_of_samples else ""
    return Verdict(Outcome.INCONCLUSIVE, pending + suffix, out_of_samples, n, errors, results)


def evaluate_ab(intervals: Sequence[IntervalSample], config: AnalysisConfig) -> Verdict:
    """The verdict over all intervals measured so far, in time order (fold, then decide)."""
    state = AnalysisState()
    for interval in intervals:
        state = fold_interval(state, interval, config)
    return decide(state, config)
