"""A/B analysis of a lease mode: per-interval samples of two arms in, a verdict out. Pure.

Purely computational, no I/O and no clock: the caller (the operator's handler, the demo, the
benchmarks) measures each analysis interval through a metric source
(`moonlease_operator.adapters.metric_sources`) and either folds it into an `AnalysisState`
(`fold_interval`, then `decide`: what the operator does, keeping the constant-size state in the
policy status) or hands the whole list of intervals to `evaluate_ab` (the same fold). The
verdict is argo-rollouts' kind: Success, Failure or Inconclusive from the success/failure
conditions, plus Abort (an early guard on a clear regression), NoData (the metrics a condition
needs are missing) and Error (too many consecutive failed measurements).

Statistics. Hits and queries are token counts, but the tokens of one request hit or miss
together (a prefix hit covers a whole prefix), so they are not independent Bernoulli trials and
a binomial standard error would be far too small. The unit of replication is the analysis
interval instead: the hit rate of an arm is the ratio estimator R = sum(hits) / sum(queries)
over its intervals, with the cluster (linearisation / delta-method) standard error
    SE(R)^2 = sum_i (h_i - R q_i)^2 / (n (n - 1) qbar^2),
i.e. the interval-to-interval variation of the residuals. TTFT comes from histogram bucket
deltas: the quantile of the pooled buckets (interpolated like PromQL's histogram_quantile), with
a batch-means standard error from the spread of the per-interval quantiles. Custom metrics are
one value per interval: mean and standard error of the mean.

Pairing and autocorrelation. Each condition is decided on the per-interval series of the two
arms measured in the same interval (paired: a swing common to both arms cancels), its standard
error estimated from that series allowing for its lag-1 autocorrelation (the section "the
interval series" below has the method and its references). The arms' own standard errors above
are for the status, and for the unpaired fallback (fewer than two intervals with both arms'
values of a metric), which combines them inflated by the prior autocorrelation.

Decision on bounds. The operator looks after every interval and stops at the first decision, so
a fixed-level test would err far more often than its level (issue 17). Each condition's effect
= treatment - control (signed so that positive is better) gets an always-valid p-value from the
normal-mixture confidence sequence (Robbins 1970; Howard et al. 2021; `core.sequential`) against
the threshold it is decided on: a primary condition against +minEffect (Success: the lower
bound clears it) or -maxRegression (Failure: the upper bound is below it); a guardrail is a
non-inferiority test against -maxRegression (Success, "within tolerance", only once the lower
bound is above it; Failure once the upper bound is below it). Holm's step-down across the
conditions keeps the family-wise error at 1 - confidence for all decisions together, however
many looks: when the arms differ by less than the thresholds, any decision is an error of some
condition's confidence sequence. A Failure on any condition rolls back, whatever the others say.
"""

from __future__ import annotations

import enum
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
    """More consecutive failed measurements than the limit allows (never final: measuring goes on
    and resumes with the next good measurement)."""


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
    """The Mooncake master's put-allocation failures (one master may serve both arms)."""
    put_failed_keys: float | None = None
    """Keys the arm's own engines failed to put (vLLM's store metrics): per arm, shared store or not."""
    put_keys: float | None = None
    """Keys the arm's own engines tried to put (failed or not): the failed-put rate's denominator."""
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
    """Treatment vs control on one metric, decided on the effect's confidence sequence.

    Success when its lower bound clears `min_effect` (a guardrail, "within tolerance": clears
    -`max_regression`); Failure when its upper bound is below -`max_regression` (metric units).
    A `guardrail` condition is not required to show an improvement, only non-inferiority.
    """

    metric: str
    direction: MetricDirection = MetricDirection.HIGHER_IS_BETTER
    min_effect: float = 0.0
    max_regression: float = 0.0
    guardrail: bool = False


DEFAULT_CONDITIONS: tuple[Condition, ...] = (
    Condition(BuiltinMetric.EXTERNAL_HIT_RATE.value, MetricDirection.HIGHER_IS_BETTER,
              min_effect=0.02, max_regression=0.02),
    Condition(BuiltinMetric.TTFT_P90.value, MetricDirection.LOWER_IS_BETTER,
              max_regression=0.05, guardrail=True),
)


@dataclass(frozen=True)
class AbortGuard:
    """Early abort on a clear regression.

    Put failures: the treatment's failed-put rate (its engines' failed put keys per put key
    attempted) against the control's, as one more hypothesis in the conditions' Holm family,
    tested on the paired interval series like a condition from the first two intervals on:
    Abort once the lower bound of treatment - control exceeds `put_failure_rate_allowance`.
    Identical arms under store pressure fail puts alike and do not abort (issue 26: the earlier
    "excess in 2 consecutive intervals" rule aborted 44-94 % of A/A tests). Without the attempted
    counts (an older vLLM, master-only metrics) the per-interval failure counts are compared the
    same way, with `put_failure_allowance` failures per interval. None disables the put guard.

    TTFT: when the treatment's TTFT `ttft_quantile` exceeds `ttft_threshold_s` seconds in each of
    the latest `consecutive` measured intervals (an absolute limit, not a comparison).
    """

    consecutive: int = 2
    put_failure_allowance: float | None = 0.0
    put_failure_rate_allowance: float = 0.01
    ttft_threshold_s: float | None = None
    ttft_quantile: float = 0.99


@dataclass(frozen=True)
class AnalysisConfig:
    conditions: tuple[Condition, ...] = DEFAULT_CONDITIONS
    min_samples: int = 3
    """Measured intervals needed before Success or Failure (the guard may abort earlier)."""
    max_samples: int | None = None
    """Intervals after which an undecided analysis ends Inconclusive; None = no limit."""
    confidence: float = 0.95
    """Two-sided confidence of each condition's interval (Student t, min(n) - 1 df)."""
    consecutive_error_limit: int = 4
    guard: AbortGuard = field(default_factory=AbortGuard)

    def __post_init__(self) -> None:
        if self.min_samples < 2:
            raise ValueError("min_samples must be at least 2: a standard error needs two intervals")
        if self.max_samples is not None and self.max_samples < self.min_samples:
            raise ValueError("max_samples must be at least min_samples")
        if not any(not c.guardrail for c in self.conditions):
            raise ValueError("at least one primary (non-guardrail) condition: guardrails alone can only hold the line")


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
    lower: float | None = None
    """Lower bound of the effect's always-valid confidence sequence at `level` (None: no data)."""
    upper: float | None = None
    p_value: float | None = None
    """Always-valid two-sided p-value of "no difference"."""
    level: float | None = None
    """The level Holm's step-down tested this condition at."""
    autocorrelation: float | None = None
    """Lag-1 autocorrelation of the interval series the standard error came from."""
    paired: bool = False
    """Whether the effect came from the paired per-interval series (else: the unpaired fallback)."""
    samples: int = 0
    """Intervals behind the effect."""
    threshold: float | None = None
    """The effect the decision was tested against (None: between a primary's thresholds)."""


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


# ---- estimators ---------------------------------------------------------------------------------
#
# Each estimator folds per-interval values into running sums (Welford's centred moments, stable
# over thousands of intervals), so that the operator keeps a constant-size analysis state in the
# policy status instead of every interval's raw counts; the list forms fold the same way.

@dataclass(frozen=True)
class RatioSums:
    """Running (hits, queries) moments of the intervals with queries: enough for the ratio
    estimator and its cluster standard error, since sum (h - R q)^2 = Chh - 2R Chq + R^2 Cqq
    when R = mean(h) / mean(q)."""

    n: int = 0
    mean_hits: float = 0.0
    mean_queries: float = 0.0
    c_hh: float = 0.0
    c_qq: float = 0.0
    c_hq: float = 0.0

    def add(self, hits: float, queries: float) -> RatioSums:
        if queries <= 0:
            return self  # an idle interval carries no information
        n = self.n + 1
        dh, dq = hits - self.mean_hits, queries - self.mean_queries
        mean_h, mean_q = self.mean_hits + dh / n, self.mean_queries + dq / n
        return RatioSums(n, mean_h, mean_q, self.c_hh + dh * (hits - mean_h), self.c_qq + dq * (queries - mean_q),
                         self.c_hq + dh * (queries - mean_q))

    def estimate(self) -> Estimate | None:
        if self.n == 0:
            return None
        ratio = self.mean_hits / self.mean_queries
        if self.n < 2:
            return Estimate(ratio, math.inf, 1)
        residuals = max(0.0, self.c_hh - 2 * ratio * self.c_hq + ratio * ratio * self.c_qq)
        return Estimate(ratio, math.sqrt(residuals / (self.n * (self.n - 1))) / self.mean_queries, self.n)


@dataclass(frozen=True)
class MeanSums:
    """Running mean and centred sum of squares of one value per interval."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, value: float) -> MeanSums:
        n = self.n + 1
        delta = value - self.mean
        mean = self.mean + delta / n
        return MeanSums(n, mean, self.m2 + delta * (value - mean))

    def estimate(self) -> Estimate | None:
        if self.n == 0:
            return None
        if self.n < 2:
            return Estimate(self.mean, math.inf, 1)
        return Estimate(self.mean, math.sqrt(self.m2 / (self.n - 1) / self.n), self.n)


@dataclass(frozen=True)
class QuantileSums:
    """The pooled histogram of the non-empty intervals, and the batch means of their
    per-interval quantiles (one running mean per tracked quantile)."""

    quantiles: tuple[float, ...] = tuple(TTFT_QUANTILES.values())
    pooled: Histogram | None = None
    intervals: int = 0
    batches: tuple[MeanSums, ...] = ()

    def add(self, histogram: Histogram) -> QuantileSums:
        if histogram.count <= 0:
            return self
        batches = list(self.batches) or [MeanSums() for _ in self.quantiles]
        for index, q in enumerate(self.quantiles):
            value = histogram_quantile(q, histogram)
            if value is not None:
                batches[index] = batches[index].add(value)
        pooled = histogram if self.pooled is None else self.pooled.merged(histogram)
        return QuantileSums(self.quantiles, pooled, self.intervals + 1, tuple(batches))

    def estimate(self, q: float) -> Estimate | None:
        if self.pooled is None or q not in self.quantiles:
            return None
        value = histogram_quantile(q, self.pooled)
        if value is None:
            return None
        spread = self.batches[self.quantiles.index(q)].estimate()
        return Estimate(value, spread.stderr if spread is not None else math.inf, self.intervals)


def estimate_ratio(pairs: Sequence[tuple[float, float]]) -> Estimate | None:
    """Ratio estimator sum(h)/sum(q) over intervals with its cluster standard error.

    `pairs` are (hits, queries) per interval; intervals without queries carry no information
    and are dropped. None when nothing is left; stderr is inf with a single interval.
    """
    sums = RatioSums()
    for hits, queries in pairs:
        sums = sums.add(hits, queries)
    return sums.estimate()


def estimate_mean(values: Sequence[float]) -> Estimate | None:
    sums = MeanSums()
    for value in values:
        sums = sums.add(value)
    return sums.estimate()


def estimate_quantile(q: float, histograms: Sequence[Histogram]) -> Estimate | None:
    """Quantile of the pooled histogram; batch-means stderr from the per-interval quantiles."""
    sums = QuantileSums((q,))
    for histogram in histograms:
        sums = sums.add(histogram)
    return sums.estimate(q)


@dataclass(frozen=True)
class ArmTotals:
    """One arm's running sums over its measured intervals: what every estimate needs."""

    prefix: RatioSums = RatioSums()
    external: RatioSums = RatioSums()
    ttft: QuantileSums = QuantileSums()
    put_alloc_failures: MeanSums = MeanSums()
    put_failed_keys: MeanSums = MeanSums()
    evictions: MeanSums = MeanSums()
    custom: Mapping[str, MeanSums] = field(default_factory=dict)

    def add(self, s: ArmSample) -> ArmTotals:
        custom = dict(self.custom)
        for name, value in s.custom.items():
            custom[name] = custom.get(name, MeanSums()).add(value)
        return ArmTotals(
            prefix=self.prefix.add(s.prefix_hits, s.prefix_queries)
            if s.prefix_hits is not None and s.prefix_queries is not None else self.prefix,
            external=self.external.add(s.external_hits, s.external_queries)
            if s.external_hits is not None and s.external_queries is not None else self.external,
            ttft=self.ttft.add(s.ttft) if s.ttft is not None else self.ttft,
            put_alloc_failures=self.put_alloc_failures.add(s.put_alloc_failures)
            if s.put_alloc_failures is not None else self.put_alloc_failures,
            put_failed_keys=self.put_failed_keys.add(s.put_failed_keys)
            if s.put_failed_keys is not None else self.put_failed_keys,
            evictions=self.evictions.add(s.evictions) if s.evictions is not None else self.evictions,
            custom=custom,
        )

    def estimate(self, metric: str) -> Estimate | None:
        """This arm's estimate of a named metric; None when it was never measured."""
        if metric == BuiltinMetric.PREFIX_HIT_RATE.value:
            return self.prefix.estimate()
        if metric == BuiltinMetric.EXTERNAL_HIT_RATE.value:
            return self.external.estimate()
        if metric in TTFT_QUANTILES:
            return self.ttft.estimate(TTFT_QUANTILES[metric])
        if metric == BuiltinMetric.PUT_FAILURES.value:
            return self.put_alloc_failures.estimate()
        if metric == BuiltinMetric.PUT_FAILED_KEYS.value:
            return self.put_failed_keys.estimate()
        if metric == BuiltinMetric.EVICTIONS.value:
            return self.evictions.estimate()
        sums = self.custom.get(metric)
        return sums.estimate() if sums is not None else None


# ---- the interval series: paired differences and their autocorrelation ----------------------------
#
# Why. Consecutive intervals of a cache are not independent: a session outlives an interval, a
# slow load swing spans several, so per-interval hit rates are positively autocorrelated (lag-1
# 0.5 to 0.8 is common). The textbook standard error s / sqrt(n) assumes independence and is then
# far too small: measured on A/A data, 16 % false decisions at rho 0.5 and 56 % at rho 0.8 with a
# nominal 5 % (issue 26). And the two arms share the same traffic swings, so their per-interval
# difference varies much less than either arm: comparing them unpaired wastes the power a drift
# common to both arms leaves (86 % -> 27 % in issue 26).
#
# Method. Each condition folds, per interval where both arms measured it, a small vector x_i (the
# arms' hits and queries for a hit rate, the arms' values otherwise) into running lag-0 and lag-1
# cross-product sums (`SeriesSums`, constant size). The effect is a smooth function f of the
# vectors' means; by the delta method its error is the mean of the linearised series
# z_i = grad f . (x_i - mean), whose lag-0 and lag-1 autocovariances are quadratic forms of those
# sums. The variance of the mean of z is the AR(1)-corrected ("effective sample size") variance:
#
#     Var(zbar) = SS * v_n / (n (n - v_n)),   v_n = 1 + 2 sum_{k=1}^{n-1} (1 - k/n) rho^k,
#
# the exact variance inflation of a mean of n AR(1) terms (v_n -> (1 + rho) / (1 - rho)), with
# SS / (n - v_n) the sample variance corrected for the same autocorrelation (Bayley & Hammersley
# 1946, "The effective number of independent observations in an autocorrelated time series",
# JRSS Suppl. 8; Wilks 2011, "Statistical Methods in the Atmospheric Sciences", 3rd ed., §5.2.4),
# studentised with n / v_n - 1 degrees of freedom (at least 3: `core.sequential.effective_df`).
# rho is the lag-1 autocorrelation r1 = c1 / c0,
# made fit for 5 to 30 intervals, where r1 is badly biased and noisy: the small-sample bias
# correction (n r1 + 1) / (n - 4) (Marriott & Pope 1954, Biometrika 41; from 7 intervals on),
# shrunk towards a prior of 0.7 worth 10 intervals (caches are autocorrelated; few intervals
# cannot show otherwise), plus half its standard error 1 / sqrt(n), within [0, 0.98]. So an
# i.i.d. series pays for the doubt (the documented detectable effects include it) and a
# strongly autocorrelated one does not decide on a lucky stretch. Newey-West with a few lags
# was rejected: with n <= 30 and rho 0.8 it leaves most of the long-run variance out.

@dataclass(frozen=True)
class SeriesSums:
    """Running sums of a vector per interval: its origin (the first vector; every sum is about it
    for precision), sum, lag-0 and lag-1 cross products (row-major k x k) and the latest vector."""

    n: int = 0
    origin: tuple[float, ...] = ()
    total: tuple[float, ...] = ()
    lag0: tuple[float, ...] = ()
    lag1: tuple[float, ...] = ()
    last: tuple[float, ...] = ()

    def add(self, x: Sequence[float]) -> SeriesSums:
        if self.n == 0:
            k = len(x)
            zero = (0.0,) * k
            return SeriesSums(1, tuple(float(v) for v in x), zero, (0.0,) * (k * k), (0.0,) * (k * k), zero)
        y = tuple(float(v) - o for v, o in zip(x, self.origin))
        k = len(y)
        return SeriesSums(
            self.n + 1, self.origin, tuple(a + b for a, b in zip(self.total, y)),
            tuple(self.lag0[i * k + j] + y[i] * y[j] for i in range(k) for j in range(k)),
            tuple(self.lag1[i * k + j] + y[i] * self.last[j] for i in range(k) for j in range(k)),
            y)

    def means(self) -> tuple[float, ...]:
        return tuple(o + s / self.n for o, s in zip(self.origin, self.total))

    def autocovariances(self, gradient: Sequence[float]) -> tuple[float, float]:
        """(c0, c1): lag-0 and lag-1 autocovariances (divided by n) of z_i = gradient . x_i."""
        k, n = len(gradient), self.n
        g = gradient

        def form(matrix: tuple[float, ...]) -> float:
            return sum(g[i] * matrix[i * k + j] * g[j] for i in range(k) for j in range(k))

        total = sum(a * b for a, b in zip(g, self.total))
        last = sum(a * b for a, b in zip(g, self.last))
        mean = total / n
        c0 = form(self.lag0) / n - mean * mean
        # sum_{i>=2} (z_i - m)(z_{i-1} - m), with z_1 = 0 (the origin): the cross sum, less m times
        # the sums of z_2..z_n and z_1..z_{n-1}, plus (n - 1) m^2.
        c1 = (form(self.lag1) - mean * total - mean * (total - last) + (n - 1) * mean * mean) / n
        return max(0.0, c0), c1


@dataclass(frozen=True)
class SeriesEstimate:
    """What the interval series says about an effect's uncertainty."""

    stderr: float
    df: int
    """Degrees of freedom of the studentised effect (`core.sequential.effective_df`)."""
    autocorrelation: float | None
    """The series' raw lag-1 autocorrelation r1 (None: no spread to correlate)."""
    rho: float
    """The autocorrelation the standard error allows for (see the section's comment)."""


def series_estimate(c0: float, c1: float, n: int) -> SeriesEstimate:
    """The standard error of a series' mean from its autocovariances (c0, c1, each over n)."""
    if n < 2:
        return SeriesEstimate(math.inf, 0, None, 0.0)
    r1 = c1 / c0 if c0 > 0 else None
    rho = planned_rho(r1 if r1 is not None else 0.0, n)
    inflation = variance_inflation(rho, n)
    squares = c0 * n
    stderr = math.sqrt(squares * inflation / (n * (n - inflation))) if n > inflation else math.inf
    return SeriesEstimate(stderr, effective_df(n, inflation), r1, rho)


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
