"""The A/A cells of the A/B test's calibration (issue 26): per-interval data shaped like what a
cache's metrics give, for every run at once (numpy, seeded), as the operator's metric source hands
it to `fold_interval`; and the operator's own look-after-every-interval loop over them.

Used by the unit tier's battery (`tests/unit/test_ab_battery.py`, few runs) and by
`benchmarks/ab_calibration.py` (many, beside a fixed-horizon t-test and the previous rule).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from moonlease_operator.api.abtest import BuiltinMetric, MetricDirection
from moonlease_operator.core.analysis import (
    AbortGuard,
    AnalysisConfig,
    AnalysisState,
    ArmSample,
    Condition,
    Histogram,
    IntervalSample,
    Outcome,
    decide,
    fold_interval,
)

MIN_SAMPLES, MAX_SAMPLES, ALPHA = 5, 30, 0.05
TTFT_BOUNDS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, math.inf)
HIT = BuiltinMetric.EXTERNAL_HIT_RATE.value
PREFIX = BuiltinMetric.PREFIX_HIT_RATE.value
TTFT = BuiltinMetric.TTFT_P90.value

Arm = dict[str, np.ndarray]
CellData = tuple[Arm, Arm, "np.ndarray | None"]
"""Per run and interval: the control's and the treatment's arrays, and which intervals failed."""
Cell = Callable[[np.random.Generator, int], CellData]


def ar1(rng: np.random.Generator, shape: tuple[int, int], rho: float, sigma: float) -> np.ndarray:
    """Stationary AR(1) series along the last axis, marginal standard deviation sigma."""
    noise = rng.standard_normal(shape) * sigma * math.sqrt(1 - rho * rho)
    out = np.empty(shape)
    out[:, 0] = rng.standard_normal(shape[0]) * sigma
    for i in range(1, shape[1]):
        out[:, i] = rho * out[:, i - 1] + noise[:, i]
    return out


def hit_counters(rng: np.random.Generator, rate: np.ndarray, requests: float, *, long_tail: bool = False
                 ) -> dict[str, np.ndarray]:
    """Token counters of an arm: Poisson requests per interval, each of a prompt whose tokens hit
    or miss together (256 tokens, or log-normal lengths with a long tail), hit with the
    interval's probability; a local cache in front hits 10 % of requests."""
    shape = rate.shape
    n = rng.poisson(requests, shape) + 1
    p = np.clip(rate, 0.0, 1.0)
    if long_tail:
        top = int(n.max())
        lengths = np.exp(rng.normal(5.5, 1.2, (*shape, top)))
        live = np.arange(top) < n[..., None]
        hit = rng.random((*shape, top)) < p[..., None]
        queries = (lengths * live).sum(-1)
        hits = (lengths * live * hit).sum(-1)
    else:
        hits = rng.binomial(n, p) * 256.0
        queries = n * 256.0
    local = rng.binomial(n, 0.1) * 256.0
    return {"hits": hits, "queries": queries, "prefix_hits": np.minimum(queries, hits + local)}


def ttft_buckets(rng: np.random.Generator, load: np.ndarray) -> np.ndarray:
    """Cumulative TTFT bucket counts: 24 log-normal TTFTs per interval around 0.3 s x load."""
    values = np.exp(np.log(0.3) + load[..., None] + 0.6 * rng.standard_normal((*load.shape, 24)))
    return np.stack([(values <= b).sum(-1) for b in TTFT_BOUNDS], axis=-1).astype(float)


def to_samples(arm: Arm, run: int, i: int, with_ttft: bool) -> ArmSample:
    ttft = arm.get("ttft") if with_ttft else None
    put_keys = float(arm["put_keys"][run, i]) if "put_keys" in arm else math.nan
    if "hits" not in arm:
        return ArmSample(custom={name: float(arm[name][run, i]) for name in ("a", "b", "c") if name in arm})
    return ArmSample(
        external_hits=float(arm["hits"][run, i]), external_queries=float(arm["queries"][run, i]),
        prefix_hits=float(arm["prefix_hits"][run, i]), prefix_queries=float(arm["queries"][run, i]),
        ttft=Histogram(tuple(zip(TTFT_BOUNDS, ttft[run, i].tolist()))) if ttft is not None else None,
        put_failed_keys=float(arm["put_failed"][run, i]) if "put_failed" in arm else None,
        put_keys=None if math.isnan(put_keys) else put_keys,
        custom={name: float(arm[name][run, i]) for name in ("a", "b", "c") if name in arm},
    )


def runs_of(data: CellData, runs: int, *, with_ttft: bool = True) -> list[list[IntervalSample]]:
    """Every run's intervals as the operator's metric source hands them over (TTFT histograms
    only when a condition reads them, as the fold then has less to do)."""
    control, treatment, failed = data
    out = []
    for run in range(runs):
        intervals = []
        for i in range(MAX_SAMPLES):
            if failed is not None and failed[run, i]:
                intervals.append(IntervalSample(i, i + 1, error="Prometheus unreachable"))
            else:
                intervals.append(IntervalSample(i, i + 1, to_samples(control, run, i, with_ttft),
                                                to_samples(treatment, run, i, with_ttft)))
        out.append(intervals)
    return out


REQUESTS = 1000
"""Requests per arm and interval: enough that the hit probability's own autocorrelation, not the
requests' binomial noise, dominates the per-interval series (as on a busy engine)."""


def counters_cell(rho: float, *, drift: float = 0.0, requests: tuple[float, float] = (REQUESTS, REQUESTS),
                  long_tail: bool = False, ttft: bool = True) -> Cell:
    def cell(rng: np.random.Generator, runs: int) -> CellData:
        shape = (runs, MAX_SAMPLES)
        common = ar1(rng, shape, 0.95, drift) if drift else 0.0
        arms = []
        for arm_requests in requests:
            arm = hit_counters(rng, 0.4 + common + ar1(rng, shape, rho, 0.05), arm_requests, long_tail=long_tail)
            if ttft:
                arm["ttft"] = ttft_buckets(rng, ar1(rng, shape, rho, 0.1) + (common * 2 if drift else 0.0))
            arms.append(arm)
        return arms[0], arms[1], None
    return cell


def overlapping_cell(rng: np.random.Generator, runs: int) -> CellData:
    """A custom `rate(x[5m])` read every minute: each reading averages the last 5 minutes."""
    arms = []
    for _ in range(2):
        arm = {}
        for name in ("a", "b", "c"):
            minutes = rng.standard_normal((runs, MAX_SAMPLES + 4))
            arm[name] = np.stack([minutes[:, i:i + 5].mean(-1) for i in range(MAX_SAMPLES)], axis=1)
        arms.append(arm)
    return arms[0], arms[1], None


def outage_cell(rng: np.random.Generator, runs: int) -> CellData:
    """AR(1) 0.5 counters; the source is down for 10 % of intervals, in bursts of up to 3."""
    shape = (runs, MAX_SAMPLES)
    arms = [hit_counters(rng, 0.4 + ar1(rng, shape, 0.5, 0.05), REQUESTS) for _ in range(2)]
    for arm in arms:
        arm["ttft"] = ttft_buckets(rng, ar1(rng, shape, 0.5, 0.1))
    starts = rng.random(shape) < 0.05
    failed = starts | np.roll(starts, 1, axis=1) & (rng.random(shape) < 0.5)
    return arms[0], arms[1], failed


def put_failure_cell(rng: np.random.Generator, runs: int) -> CellData:
    """Store pressure in both arms: a failed-put fraction drifting around 0.02 %, 0.2 % or 5 %
    (a third of the runs each), bursty (AR(1) 0.8 on the log scale), on ~1000 puts per
    interval; half the runs without attempted-put counts (the count fallback)."""
    shape = (runs, MAX_SAMPLES)
    base = np.array([0.0002, 0.002, 0.05])[np.arange(runs) % 3][:, None]
    arms = [hit_counters(rng, 0.4 + ar1(rng, shape, 0.5, 0.05), REQUESTS) for _ in range(2)]
    for arm in arms:
        arm["ttft"] = ttft_buckets(rng, ar1(rng, shape, 0.5, 0.1))
        keys = rng.poisson(1000, shape)
        rate = np.clip(base * np.exp(ar1(rng, shape, 0.8, 0.7) - 0.245), 0, 1)
        arm["put_failed"] = rng.binomial(keys, rate).astype(float)
        arm["put_keys"] = np.where(np.arange(runs)[:, None] % 2 == 0, keys, np.nan).astype(float)
    return arms[0], arms[1], None


def cold_cell(rng: np.random.Generator, runs: int) -> CellData:
    """The treatment's restarted engines start cold: 5 points of hit rate short in the first
    interval, halving with each interval after."""
    shape = (runs, MAX_SAMPLES)
    cold = 0.05 * 0.5 ** np.arange(MAX_SAMPLES)
    control = hit_counters(rng, 0.4 + ar1(rng, shape, 0.5, 0.05), REQUESTS)
    treatment = hit_counters(rng, 0.4 - cold + ar1(rng, shape, 0.5, 0.05), REQUESTS)
    for arm in (control, treatment):
        arm["ttft"] = ttft_buckets(rng, ar1(rng, shape, 0.5, 0.1))
    return control, treatment, None


def config_for(conditions: int, *, custom: bool = False, min_effect: float = 0.0, max_regression: float = 0.0,
               ttft_regression: float = 0.0) -> AnalysisConfig:
    names = ("a", "b", "c") if custom else (HIT, PREFIX, TTFT)
    chosen = [Condition(names[0], min_effect=min_effect, max_regression=max_regression)]
    if conditions == 3:
        chosen.append(Condition(names[1], min_effect=min_effect, max_regression=max_regression))
        chosen.append(Condition(names[2], MetricDirection.HIGHER_IS_BETTER if custom else MetricDirection.LOWER_IS_BETTER,
                                max_regression=ttft_regression, guardrail=True))
    return AnalysisConfig(conditions=tuple(chosen), min_samples=MIN_SAMPLES, max_samples=MAX_SAMPLES,
                          confidence=1 - ALPHA, guard=AbortGuard())


def first_decisions(config: AnalysisConfig, runs: list[list[IntervalSample]]) -> dict[Outcome, int]:
    """Each run looked at after every interval, stopped at its first final verdict."""
    outcomes: dict[Outcome, int] = {}
    for intervals in runs:
        state = AnalysisState()
        for interval in intervals:
            state = fold_interval(state, interval, config)
            if state.samples < 2:
                continue
            verdict = decide(state, config)
            if verdict.final:
                outcomes[verdict.outcome] = outcomes.get(verdict.outcome, 0) + 1
                break
    return outcomes


FALSE = (Outcome.SUCCESS, Outcome.FAILURE, Outcome.ABORT)
CELLS: dict[str, tuple[Cell, bool]] = {
    "iid": (counters_cell(0.0), False),
    "ar1-0.5": (counters_cell(0.5), False),
    "ar1-0.8": (counters_cell(0.8), False),
    "overlapping-windows": (overlapping_cell, True),
    "unequal-long-tailed": (counters_cell(0.5, requests=(60, 5), long_tail=True), False),
    "common-drift": (counters_cell(0.5, drift=0.1), False),
    "outages": (outage_cell, False),
    "put-failures-both-arms": (put_failure_cell, False),
}


def effect_cell(effect: float, drift: float = 0.0) -> Cell:
    """One custom metric, N(0, 1) per arm and interval, the treatment better by `effect`; with a
    drift common to both arms (AR(1) 0.95 of standard deviation `drift`) when given."""
    def cell(rng: np.random.Generator, runs: int) -> CellData:
        shape = (runs, MAX_SAMPLES)
        common = ar1(rng, shape, 0.95, drift) if drift else np.zeros(shape)
        return {"a": common + rng.standard_normal(shape)}, {"a": common + effect + rng.standard_normal(shape)}, None
    return cell


def power_config() -> AnalysisConfig:
    """One primary condition on the custom metric `a`, thresholds 0, no put guard."""
    return AnalysisConfig(conditions=(Condition("a"),), min_samples=MIN_SAMPLES, max_samples=MAX_SAMPLES,
                          confidence=1 - ALPHA, guard=AbortGuard(put_failure_allowance=None))
