"""A/B analysis of a lease mode: per-interval samples of two arms in, a verdict out. Pure.

Purely computational, no I/O and no clock: the caller (the operator's handler, the demo, the
benchmarks) measures each analysis interval through a metric source
(`moonlease_operator.adapters.metric_sources`) and hands the whole list of intervals to
`evaluate_ab`, which decides once, as argo-rollouts' analysis does: Success, Failure or
Inconclusive from the success/failure conditions, plus Abort (an early guard on a clear
regression), NoData (the metrics a condition needs are missing) and Error (too many consecutive
failed measurements).

Statistics. Hits and queries are token counts, but the tokens of one request hit or miss
together (a prefix hit covers a whole prefix), so they are not independent Bernoulli trials and
a binomial standard error would be far too small. The unit of replication is the analysis
interval instead: the hit rate of an arm is the ratio estimator R = sum(hits) / sum(queries)
over its intervals, with the cluster (linearisation / delta-method) standard error
    SE(R)^2 = sum_i (h_i - R q_i)^2 / (n (n - 1) qbar^2),
i.e. the interval-to-interval variation of the residuals. TTFT comes from histogram bucket
deltas: the quantile of the pooled buckets (interpolated like PromQL's histogram_quantile), with
a batch-means standard error from the spread of the per-interval quantiles. Custom metrics are
one value per interval: mean and standard error of the mean. A condition compares
treatment - control (signed so that positive is better) with the combined standard error
sqrt(se_t^2 + se_c^2) at `z` standard errors.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


class Arm(str, enum.Enum):
    CONTROL = "control"
    TREATMENT = "treatment"


class Outcome(str, enum.Enum):
    SUCCESS = "Success"
    """Every required condition shows the treatment better, and no condition shows it worse."""
    FAILURE = "Failure"
    """Some condition shows the treatment worse beyond its tolerance."""
    INCONCLUSIVE = "Inconclusive"
    """Neither yet (`final` says whether the analysis has run out of samples)."""
    ABORT = "Abort"
    """The early guard fired: a clear regression, stop without waiting for more samples."""
    NO_DATA = "NoData"
    """A metric a condition needs is missing from every interval: no decision is possible."""
    ERROR = "Error"
    """More consecutive failed measurements than the limit allows."""


class Direction(str, enum.Enum):
    HIGHER_IS_BETTER = "HigherIsBetter"
    LOWER_IS_BETTER = "LowerIsBetter"


class BuiltinMetric(str, enum.Enum):
    PREFIX_HIT_RATE = "prefixCacheHitRate"
    EXTERNAL_HIT_RATE = "externalHitRate"
    TTFT_P50 = "ttftP50"
    TTFT_P90 = "ttftP90"
    TTFT_P99 = "ttftP99"
    PUT_FAILURES = "putAllocFailures"
    EVICTIONS = "evictions"


TTFT_QUANTILES: Mapping[str, float] = {
    BuiltinMetric.TTFT_P50.value: 0.5, BuiltinMetric.TTFT_P90.value: 0.9, BuiltinMetric.TTFT_P99.value: 0.99,
}


@dataclass(frozen=True)
class Histogram:
    """Deltas of a Prometheus histogram over one interval: (upper bound `le`, cumulative count).

    Sorted by bound; the last bound is +Inf (its count is the total), as Prometheus exposes it.
    """

    buckets: tuple[tuple[float, float], ...]

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def cumulative_at(self, bound: float) -> float:
        """Observations known to be <= bound: the count of the largest own bound <= `bound`."""
        count = 0.0
        for le, c in self.buckets:
            if le > bound:
                break
            count = c
        return count

    def merged(self, other: Histogram) -> Histogram:
        """Bucket-wise sum. Same bounds (the usual case: same metric, same vLLM) sum exactly;
        different bounds (pods of two vLLM versions in one arm) sum over the union of bounds,
        each histogram counted at its largest bound below (conservative: never early)."""
        if [le for le, _ in self.buckets] == [le for le, _ in other.buckets]:
            return Histogram(tuple((le, a + b) for (le, a), (_, b) in zip(self.buckets, other.buckets)))
        bounds = sorted({le for le, _ in self.buckets} | {le for le, _ in other.buckets})
        return Histogram(tuple((le, self.cumulative_at(le) + other.cumulative_at(le)) for le in bounds))


def histogram_quantile(q: float, histogram: Histogram) -> float | None:
    """The q-quantile by linear interpolation within buckets, as PromQL's histogram_quantile.

    None when the histogram is empty. A rank in the +Inf bucket answers the highest finite
    bound; the first bucket's lower bound is 0 (TTFT is never negative).
    """
    buckets = histogram.buckets
    total = histogram.count
    if not buckets or total <= 0 or not math.isinf(buckets[-1][0]):
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound  # unreachable: the +Inf bucket holds the total


@dataclass(frozen=True)
class ArmSample:
    """One arm over one interval: counter deltas (None = that metric was missing)."""

    prefix_hits: float | None = None
    prefix_queries: float | None = None
    external_hits: float | None = None
    external_queries: float | None = None
    ttft: Histogram | None = None
    put_alloc_failures: float | None = None
    evictions: float | None = None
    custom: Mapping[str, float] = field(default_factory=dict)
    """User PromQL results by name; a name absent here was missing this interval."""


@dataclass(frozen=True)
class IntervalSample:
    """Both arms over one analysis interval [start, end] (seconds, from the caller's clock)."""

    start: float
    end: float
    control: ArmSample | None = None
    treatment: ArmSample | None = None
    error: str | None = None
    """Why the measurement failed (source down, bad answer); None when both arms were measured."""

    @property
    def failed(self) -> bool:
        return self.error is not None or self.control is None or self.treatment is None


@dataclass(frozen=True)
class Condition:
    """Treatment vs control on one metric.

    Success when the treatment is better by at least `min_effect` (in the metric's unit) and the
    interval estimate - z*SE excludes no improvement; failure when it is worse by at least
    `max_regression` and estimate + z*SE excludes no regression. A `guardrail` condition can only
    fail: it is not required to show an improvement.
    """

    metric: str
    direction: Direction = Direction.HIGHER_IS_BETTER
    min_effect: float = 0.0
    max_regression: float = 0.0
    guardrail: bool = False


DEFAULT_CONDITIONS: tuple[Condition, ...] = (
    Condition(BuiltinMetric.EXTERNAL_HIT_RATE.value, Direction.HIGHER_IS_BETTER,
              min_effect=0.02, max_regression=0.02),
    Condition(BuiltinMetric.TTFT_P90.value, Direction.LOWER_IS_BETTER,
              max_regression=0.05, guardrail=True),
)


@dataclass(frozen=True)
class AbortGuard:
    """Early abort on a clear regression, checked on the latest `consecutive` measured intervals.

    Fires when, in each of them, the treatment's put-allocation failures exceed the control's by
    more than `put_failure_allowance`, and the per-interval excess does not fall (rising put
    failures); or when the treatment's TTFT `ttft_quantile` exceeds `ttft_threshold_s` seconds.
    None disables a check.
    """

    consecutive: int = 2
    put_failure_allowance: float | None = 0.0
    ttft_threshold_s: float | None = None
    ttft_quantile: float = 0.99


@dataclass(frozen=True)
class AnalysisConfig:
    conditions: tuple[Condition, ...] = DEFAULT_CONDITIONS
    min_samples: int = 3
    """Measured intervals needed before Success or Failure (the guard may abort earlier)."""
    max_samples: int | None = None
    """Intervals after which an undecided analysis ends Inconclusive; None = no limit."""
    z: float = 1.96
    consecutive_error_limit: int = 4
    guard: AbortGuard = field(default_factory=AbortGuard)

    def __post_init__(self) -> None:
        if self.min_samples < 2:
            raise ValueError("min_samples must be at least 2: a standard error needs two intervals")
        if self.max_samples is not None and self.max_samples < self.min_samples:
            raise ValueError("max_samples must be at least min_samples")
        if not self.conditions:
            raise ValueError("at least one condition")


@dataclass(frozen=True)
class Estimate:
    value: float
    stderr: float
    samples: int


@dataclass(frozen=True)
class ConditionResult:
    metric: str
    control: Estimate | None
    treatment: Estimate | None
    effect: float | None
    """Treatment minus control, signed so positive is better; None when either arm is missing."""
    stderr: float | None
    outcome: Outcome
    reason: str


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: str
    final: bool
    """The analysis is over (decided, aborted, errored, or out of samples)."""
    samples: int
    """Measured intervals (both arms present)."""
    consecutive_errors: int
    conditions: tuple[ConditionResult, ...] = ()


# ---- estimators -------------------------------------------------------------------------------

def estimate_ratio(pairs: Sequence[tuple[float, float]]) -> Estimate | None:
    """Ratio estimator sum(h)/sum(q) over intervals with its cluster standard error.

    `pairs` are (hits, queries) per interval; intervals without queries carry no information
    and are dropped. None when nothing is left; stderr is inf with a single interval.
    """
    used = [(h, q) for h, q in pairs if q > 0]
    n = len(used)
    if n == 0:
        return None
    total_q = sum(q for _, q in used)
    ratio = sum(h for h, _ in used) / total_q
    if n < 2:
        return Estimate(ratio, math.inf, n)
    qbar = total_q / n
    residuals = sum((h - ratio * q) ** 2 for h, q in used)
    return Estimate(ratio, math.sqrt(residuals / (n * (n - 1))) / qbar, n)


def estimate_mean(values: Sequence[float]) -> Estimate | None:
    n = len(values)
    if n == 0:
        return None
    mean = sum(values) / n
    if n < 2:
        return Estimate(mean, math.inf, n)
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return Estimate(mean, math.sqrt(variance / n), n)


def estimate_quantile(q: float, histograms: Sequence[Histogram]) -> Estimate | None:
    """Quantile of the pooled histogram; batch-means stderr from the per-interval quantiles."""
    nonempty = [h for h in histograms if h.count > 0]
    if not nonempty:
        return None
    pooled = nonempty[0]
    for h in nonempty[1:]:
        pooled = pooled.merged(h)
    value = histogram_quantile(q, pooled)
    if value is None:
        return None
    per_interval = [v for v in (histogram_quantile(q, h) for h in nonempty) if v is not None]
    spread = estimate_mean(per_interval)
    stderr = spread.stderr if spread is not None else math.inf
    return Estimate(value, stderr, len(nonempty))


def estimate_metric(metric: str, samples: Sequence[ArmSample]) -> Estimate | None:
    """One arm's estimate of a named metric over its measured intervals; None when missing."""
    if metric == BuiltinMetric.PREFIX_HIT_RATE.value:
        return estimate_ratio([(s.prefix_hits, s.prefix_queries) for s in samples
                               if s.prefix_hits is not None and s.prefix_queries is not None])
    if metric == BuiltinMetric.EXTERNAL_HIT_RATE.value:
        return estimate_ratio([(s.external_hits, s.external_queries) for s in samples
                               if s.external_hits is not None and s.external_queries is not None])
    if metric in TTFT_QUANTILES:
        return estimate_quantile(TTFT_QUANTILES[metric], [s.ttft for s in samples if s.ttft is not None])
    if metric == BuiltinMetric.PUT_FAILURES.value:
        return estimate_mean([s.put_alloc_failures for s in samples if s.put_alloc_failures is not None])
    if metric == BuiltinMetric.EVICTIONS.value:
        return estimate_mean([s.evictions for s in samples if s.evictions is not None])
    return estimate_mean([s.custom[metric] for s in samples if metric in s.custom])


# ---- the decision -------------------------------------------------------------------------------

def evaluate_condition(condition: Condition, control: Sequence[ArmSample], treatment: Sequence[ArmSample],
                       *, z: float) -> ConditionResult:
    c = estimate_metric(condition.metric, control)
    t = estimate_metric(condition.metric, treatment)
    if c is None or t is None:
        missing = " and ".join(arm.value for arm, e in ((Arm.CONTROL, c), (Arm.TREATMENT, t)) if e is None)
        return ConditionResult(condition.metric, c, t, None, None, Outcome.NO_DATA,
                               f"{condition.metric}: no data for {missing}")
    sign = 1.0 if condition.direction is Direction.HIGHER_IS_BETTER else -1.0
    effect = sign * (t.value - c.value)
    stderr = math.sqrt(c.stderr ** 2 + t.stderr ** 2)
    described = (f"{condition.metric}: treatment {t.value:.4g} vs control {c.value:.4g} "
                 f"(effect {effect:+.4g} ± {z * stderr:.3g})")
    if effect <= -condition.max_regression and effect + z * stderr < 0:
        return ConditionResult(condition.metric, c, t, effect, stderr, Outcome.FAILURE,
                               f"{described}: worse beyond tolerance {condition.max_regression:g}")
    if condition.guardrail:
        return ConditionResult(condition.metric, c, t, effect, stderr, Outcome.SUCCESS,
                               f"{described}: within tolerance")
    if effect >= condition.min_effect and effect - z * stderr > 0:
        return ConditionResult(condition.metric, c, t, effect, stderr, Outcome.SUCCESS,
                               f"{described}: better by at least {condition.min_effect:g}")
    return ConditionResult(condition.metric, c, t, effect, stderr, Outcome.INCONCLUSIVE,
                           f"{described}: not significant")


def _trailing_errors(intervals: Sequence[IntervalSample]) -> int:
    count = 0
    for interval in reversed(intervals):
        if not interval.failed:
            break
        count += 1
    return count


def evaluate_guard(guard: AbortGuard, measured: Sequence[IntervalSample]) -> str | None:
    """Why the guard fires on the latest measured intervals, or None."""
    if guard.consecutive < 1 or len(measured) < guard.consecutive:
        return None
    latest = measured[-guard.consecutive:]
    if guard.put_failure_allowance is not None:
        excess: list[float] = []
        for interval in latest:
            c, t = interval.control, interval.treatment
            if c is None or t is None or c.put_alloc_failures is None or t.put_alloc_failures is None:
                break
            excess.append(t.put_alloc_failures - c.put_alloc_failures)
        if (len(excess) == len(latest) and all(e > guard.put_failure_allowance for e in excess)
                and all(b >= a for a, b in zip(excess, excess[1:]))):
            return (f"treatment put-allocation failures above control's by {', '.join(f'{e:g}' for e in excess)} "
                    f"in the last {len(excess)} intervals (allowance {guard.put_failure_allowance:g})")
    if guard.ttft_threshold_s is not None:
        quantiles: list[float] = []
        for interval in latest:
            t = interval.treatment
            value = histogram_quantile(guard.ttft_quantile, t.ttft) if t is not None and t.ttft is not None else None
            if value is None:
                break
            quantiles.append(value)
        if len(quantiles) == len(latest) and all(v > guard.ttft_threshold_s for v in quantiles):
            return (f"treatment TTFT p{guard.ttft_quantile * 100:g} {', '.join(f'{v:.3g}s' for v in quantiles)} "
                    f"past the failure threshold {guard.ttft_threshold_s:g}s in the last {len(quantiles)} intervals")
    return None


def evaluate_ab(intervals: Sequence[IntervalSample], config: AnalysisConfig) -> Verdict:
    """The verdict of an A/B analysis over all intervals measured so far, in time order.

    Order of precedence: Error (too many consecutive failed measurements) > Abort (guard) >
    NoData (a condition's metric missing everywhere, once min_samples intervals were measured)
    > Failure > Success > Inconclusive. Failed measurements are skipped, not zeros: they can
    delay a decision but never produce one.
    """
    errors = _trailing_errors(intervals)
    measured = [i for i in intervals if not i.failed]
    n = len(measured)
    if errors > config.consecutive_error_limit:
        last = intervals[-1].error or "an arm was not measured"
        return Verdict(Outcome.ERROR, f"{errors} consecutive failed measurements (limit "
                       f"{config.consecutive_error_limit}); last: {last}", True, n, errors)
    abort = evaluate_guard(config.guard, measured)
    if abort is not None:
        return Verdict(Outcome.ABORT, abort, True, n, errors)
    control = [i.control for i in measured if i.control is not None]
    treatment = [i.treatment for i in measured if i.treatment is not None]
    results = tuple(evaluate_condition(c, control, treatment, z=config.z) for c in config.conditions)
    out_of_samples = config.max_samples is not None and n >= config.max_samples
    if n < config.min_samples:
        note = f"; last measurement failed: {intervals[-1].error}" if errors else ""
        return Verdict(Outcome.INCONCLUSIVE, f"{n} of {config.min_samples} samples measured{note}",
                       False, n, errors, results)
    no_data = [r for r in results if r.outcome is Outcome.NO_DATA]
    if no_data:
        return Verdict(Outcome.NO_DATA, "; ".join(r.reason for r in no_data), out_of_samples, n, errors, results)
    failures = [r for r in results if r.outcome is Outcome.FAILURE]
    if failures:
        return Verdict(Outcome.FAILURE, "; ".join(r.reason for r in failures), True, n, errors, results)
    if all(r.outcome is Outcome.SUCCESS for r in results):
        required = [r for r, c in zip(results, config.conditions) if not c.guardrail] or list(results)
        return Verdict(Outcome.SUCCESS, "; ".join(r.reason for r in required), True, n, errors, results)
    pending = "; ".join(r.reason for r in results if r.outcome is Outcome.INCONCLUSIVE)
    suffix = f" after the maximum of {config.max_samples} samples" if out_of_samples else ""
    return Verdict(Outcome.INCONCLUSIVE, pending + suffix, out_of_samples, n, errors, results)
