"""The paired per-interval series of a condition and its autocorrelation-corrected standard
error (the method and its references below). Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from moonlease_operator.core.sequential import (
    effective_df,
    planned_rho,
    variance_inflation,
)


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
