"""A/B analysis of a lease mode: per-interval samples of two arms in, a verdict out. Pure.

One concept per module: `samples` (inputs, conditions, results), `estimators` (per-arm running
sums), `series` (the paired series and its autocorrelation), `decision` (bounds, Holm, guard, fold).

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

from moonlease_operator.core.analysis.decision import (
    AnalysisState,
    GUARD_WINDOW,
    GuardPoint,
    PUT_COUNT_SERIES,
    PUT_RATE_SERIES,
    RATIO_METRICS,
    build_guard_point,
    decide,
    evaluate_ab,
    evaluate_conditions,
    evaluate_guard,
    fold_interval,
    paired_effect,
    paired_vector,
    put_vectors,
    tuning_look,
)
from moonlease_operator.core.analysis.estimators import (
    ArmTotals,
    MeanSums,
    QuantileSums,
    RatioSums,
    estimate_mean,
    estimate_quantile,
    estimate_ratio,
)
from moonlease_operator.core.analysis.samples import (
    AbortGuard,
    AnalysisConfig,
    Arm,
    ArmSample,
    Condition,
    ConditionResult,
    DEFAULT_CONDITIONS,
    Estimate,
    Histogram,
    IntervalSample,
    Outcome,
    TTFT_QUANTILES,
    Verdict,
    histogram_quantile,
)
from moonlease_operator.core.analysis.series import (
    SeriesEstimate,
    SeriesSums,
    series_estimate,
)

__all__ = [
    "AbortGuard",
    "AnalysisConfig",
    "AnalysisState",
    "Arm",
    "ArmSample",
    "ArmTotals",
    "Condition",
    "ConditionResult",
    "DEFAULT_CONDITIONS",
    "Estimate",
    "GUARD_WINDOW",
    "GuardPoint",
    "Histogram",
    "IntervalSample",
    "MeanSums",
    "Outcome",
    "PUT_COUNT_SERIES",
    "PUT_RATE_SERIES",
    "QuantileSums",
    "RATIO_METRICS",
    "RatioSums",
    "SeriesEstimate",
    "SeriesSums",
    "TTFT_QUANTILES",
    "Verdict",
    "build_guard_point",
    "decide",
    "estimate_mean",
    "estimate_quantile",
    "estimate_ratio",
    "evaluate_ab",
    "evaluate_conditions",
    "evaluate_guard",
    "fold_interval",
    "histogram_quantile",
    "paired_effect",
    "paired_vector",
    "put_vectors",
    "series_estimate",
    "tuning_look",
]
