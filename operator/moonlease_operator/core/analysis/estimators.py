"""Per-arm estimators kept as constant-size running sums: the ratio estimator of a hit rate
with its cluster standard error, the mean of a custom metric, the pooled TTFT quantile with
its batch-means error, and an arm's totals over its measured intervals. Pure."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from moonlease_operator.api.abtest import BuiltinMetric
from moonlease_operator.core.analysis.samples import (
    ArmSample,
    Estimate,
    Histogram,
    TTFT_QUANTILES,
    histogram_quantile,
)


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
