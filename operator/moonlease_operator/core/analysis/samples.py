"""The A/B analysis' inputs and outputs: one interval's samples of each arm, the conditions
and guards a test decides on, and the estimates, results and verdict it reports. Pure."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from moonlease_operator.api.abtest import BuiltinMetric, MetricDirection


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
