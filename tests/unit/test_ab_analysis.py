"""The A/B analysis core: estimators checked by hand, verdicts through commented scenarios, and
properties (swapping arms flips the verdict, identical arms never succeed, failed measurements
never decide)."""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moonlease_operator.api.abtest import BuiltinMetric, MetricDirection
from moonlease_operator.core.analysis import (
    AbortGuard,
    AnalysisConfig,
    ArmSample,
    Condition,
    Histogram,
    IntervalSample,
    Outcome,
    estimate_mean,
    estimate_quantile,
    estimate_ratio,
    evaluate_ab,
    histogram_quantile,
)

pytestmark = pytest.mark.unit

INF = math.inf
HIT_RATE = Condition(BuiltinMetric.EXTERNAL_HIT_RATE.value, MetricDirection.HIGHER_IS_BETTER,
                     min_effect=0.02, max_regression=0.02)


def arm(hits: float, queries: float, *, ttft: Histogram | None = None, put_failures: float = 0.0) -> ArmSample:
    return ArmSample(prefix_hits=hits, prefix_queries=queries, external_hits=hits, external_queries=queries,
                     ttft=ttft, put_alloc_failures=put_failures, evictions=0.0)


def intervals(control: list[ArmSample], treatment: list[ArmSample]) -> list[IntervalSample]:
    return [IntervalSample(start=10.0 * i, end=10.0 * (i + 1), control=c, treatment=t)
            for i, (c, t) in enumerate(zip(control, treatment))]


def ttft(*counts: float) -> Histogram:
    """Non-cumulative counts for buckets le 0.1, 0.5, 1, +Inf."""
    bounds = (0.1, 0.5, 1.0, INF)
    cumulative, running = [], 0.0
    for le, c in zip(bounds, counts):
        running += c
        cumulative.append((le, running))
    return Histogram(tuple(cumulative))


# ---- estimators, by hand --------------------------------------------------------------------------

def test_ratio_estimator_and_cluster_standard_error_by_hand() -> None:
    # hits/queries (30/100, 50/100): R = 80/200 = 0.4; residuals 30-40=-10, 50-40=10;
    # SE^2 = (100+100) / (2*1*100^2) = 0.01 -> SE = 0.1.
    est = estimate_ratio([(30, 100), (50, 100)])
    assert est is not None
    assert est.value == pytest.approx(0.4)
    assert est.stderr == pytest.approx(0.1)
    assert est.samples == 2


def test_ratio_estimator_ignores_idle_intervals_and_has_no_stderr_from_one() -> None:
    assert estimate_ratio([]) is None
    assert estimate_ratio([(0, 0)]) is None
    one = estimate_ratio([(0, 0), (5, 10)])
    assert one is not None and one.value == 0.5 and one.stderr == INF


def test_token_counts_are_not_treated_as_bernoulli_trials() -> None:
    # A million tokens per interval but intervals disagree: the SE reflects the disagreement,
    # far above the binomial sqrt(p(1-p)/N) ~ 0.0004.
    est = estimate_ratio([(300_000, 1_000_000), (500_000, 1_000_000), (400_000, 1_000_000)])
    assert est is not None
    assert est.value == pytest.approx(0.4)
    assert est.stderr == pytest.approx(math.sqrt((0.01 + 0.01 + 0) / 6))


def test_mean_estimator_by_hand() -> None:
    est = estimate_mean([1.0, 3.0])
    assert est is not None and est.value == 2.0 and est.stderr == pytest.approx(1.0)


def test_histogram_quantile_interpolates_like_promql() -> None:
    h = ttft(10, 20, 10, 0)  # cumulative 10, 30, 40, 40
    # p50: rank 20 in (0.1, 0.5] between counts 10 and 30 -> 0.1 + 0.4 * 10/20 = 0.3
    assert histogram_quantile(0.5, h) == pytest.approx(0.3)
    # p25: rank 10 falls exactly at the first bucket's top: 0 + 0.1 * 10/10 = 0.1
    assert histogram_quantile(0.25, h) == pytest.approx(0.1)
    # p99: rank 39.6 in (0.5, 1] between 30 and 40 -> 0.5 + 0.5 * 9.6/10 = 0.98
    assert histogram_quantile(0.99, h) == pytest.approx(0.98)


def test_histogram_quantile_in_the_inf_bucket_answers_the_highest_finite_bound() -> None:
    assert histogram_quantile(0.9, ttft(1, 0, 0, 9)) == 1.0
    assert histogram_quantile(0.5, ttft(0, 0, 0, 0)) is None
    assert histogram_quantile(0.5, Histogram(())) is None


def test_quantile_estimate_pools_buckets_and_spreads_over_intervals() -> None:
    fast, slow = ttft(10, 0, 0, 0), ttft(0, 0, 10, 0)
    est = estimate_quantile(0.5, [fast, slow])
    assert est is not None
    # pooled: cumulative 10, 10, 20 -> rank 10 hits le=0.1 exactly -> 0.1
    assert est.value == pytest.approx(0.1)
    # per-interval medians 0.05 and 0.75: SE of their mean = |0.75-0.05|/2 = 0.35
    assert est.stderr == pytest.approx(0.35)


def test_histograms_with_different_bounds_merge_over_the_union_of_bounds() -> None:
    a = Histogram(((1.0, 1.0), (INF, 2.0)))
    b = Histogram(((0.5, 3.0), (2.0, 4.0), (INF, 4.0)))
    # At 0.5: a knows none yet (its first bound is 1.0) + b's 3; at 1.0: 1 + 3; at 2.0: 1 + 4.
    assert a.merged(b).buckets == ((0.5, 3.0), (1.0, 4.0), (2.0, 5.0), (INF, 6.0))
    assert a.merged(b).count == a.count + b.count


def test_config_rejects_fewer_than_two_samples() -> None:
    with pytest.raises(ValueError):
        AnalysisConfig(min_samples=1)
    with pytest.raises(ValueError):
        AnalysisConfig(min_samples=4, max_samples=3)


# ---- verdicts -------------------------------------------------------------------------------------

CONFIG = AnalysisConfig(conditions=(HIT_RATE,), min_samples=3)


def test_clear_win_succeeds_after_min_samples() -> None:
    control = [arm(300, 1000), arm(310, 1000), arm(290, 1000)]
    treatment = [arm(600, 1000), arm(610, 1000), arm(590, 1000)]
    # Two intervals: not enough yet.
    early = evaluate_ab(intervals(control[:2], treatment[:2]), CONFIG)
    assert early.outcome is Outcome.INCONCLUSIVE and not early.final
    assert "2 of 3 samples" in early.reason
    verdict = evaluate_ab(intervals(control, treatment), CONFIG)
    assert verdict.outcome is Outcome.SUCCESS and verdict.final
    assert verdict.samples == 3
    result = verdict.conditions[0]
    assert result.effect == pytest.approx(0.3)
    assert "externalHitRate" in verdict.reason


def test_clear_regression_fails() -> None:
    control = [arm(600, 1000), arm(610, 1000), arm(590, 1000)]
    treatment = [arm(300, 1000), arm(310, 1000), arm(290, 1000)]
    verdict = evaluate_ab(intervals(control, treatment), CONFIG)
    assert verdict.outcome is Outcome.FAILURE and verdict.final
    assert "worse" in verdict.reason


def test_noisy_small_difference_is_inconclusive_then_final_at_max_samples() -> None:
    control = [arm(300, 1000), arm(500, 1000), arm(400, 1000)]
    treatment = [arm(500, 1000), arm(300, 1000), arm(430, 1000)]
    config = replace(CONFIG, max_samples=3)
    verdict = evaluate_ab(intervals(control, treatment), config)
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert verdict.final
    assert "maximum of 3 samples" in verdict.reason
    assert not evaluate_ab(intervals(control, treatment), CONFIG).final


def test_significant_but_below_min_effect_is_inconclusive() -> None:
    control = [arm(400, 1000)] * 4
    treatment = [arm(410, 1000), arm(411, 1000), arm(409, 1000), arm(410, 1000)]
    verdict = evaluate_ab(intervals(control, treatment), CONFIG)
    assert verdict.outcome is Outcome.INCONCLUSIVE


def test_ttft_guardrail_fails_a_winning_hit_rate() -> None:
    config = AnalysisConfig(conditions=(HIT_RATE, Condition(BuiltinMetric.TTFT_P90.value,
                                                            MetricDirection.LOWER_IS_BETTER,
                                                            max_regression=0.1, guardrail=True)))
    control = [arm(300, 1000, ttft=ttft(10, 0, 0, 0))] * 3
    treatment = [arm(600, 1000, ttft=ttft(0, 0, 10, 0))] * 3
    verdict = evaluate_ab(intervals(control, treatment), config)
    assert verdict.outcome is Outcome.FAILURE
    assert "ttftP90" in verdict.reason


def test_guardrail_within_tolerance_does_not_block_success() -> None:
    config = AnalysisConfig(conditions=(HIT_RATE, Condition(BuiltinMetric.TTFT_P90.value,
                                                            MetricDirection.LOWER_IS_BETTER,
                                                            max_regression=0.1, guardrail=True)))
    same = ttft(10, 0, 0, 0)
    verdict = evaluate_ab(intervals([arm(300, 1000, ttft=same)] * 3, [arm(600, 1000, ttft=same)] * 3), config)
    assert verdict.outcome is Outcome.SUCCESS
    assert "ttftP90" not in verdict.reason  # the reason names what won, not the guardrail


def test_missing_metric_is_no_data_with_the_metric_named() -> None:
    control = [ArmSample(prefix_hits=1, prefix_queries=2)] * 3
    treatment = [ArmSample(prefix_hits=1, prefix_queries=2)] * 3
    verdict = evaluate_ab(intervals(control, treatment), CONFIG)
    assert verdict.outcome is Outcome.NO_DATA
    assert "externalHitRate" in verdict.reason and "control and treatment" in verdict.reason


def test_custom_metric_condition() -> None:
    config = AnalysisConfig(conditions=(Condition("goodput", MetricDirection.HIGHER_IS_BETTER, min_effect=1.0),))
    control = [ArmSample(custom={"goodput": v}) for v in (10.0, 11.0, 10.5)]
    treatment = [ArmSample(custom={"goodput": v}) for v in (20.0, 21.0, 20.5)]
    assert evaluate_ab(intervals(control, treatment), config).outcome is Outcome.SUCCESS
    assert evaluate_ab(intervals(treatment, control), config).outcome is Outcome.FAILURE


def _puts(arm_sample: ArmSample, failed: float, attempted: float | None = 1000.0) -> ArmSample:
    return replace(arm_sample, put_failed_keys=failed, put_keys=attempted)


def test_a_clearly_higher_failed_put_rate_aborts_before_min_samples() -> None:
    config = replace(CONFIG, min_samples=5, guard=AbortGuard())
    # 30 % of the treatment's puts fail, 0.5 % of the control's, in each interval: clear from the
    # second one on (a noisy excess takes longer: few intervals cannot rule out autocorrelation).
    control = [_puts(arm(300, 1000), 5) for _ in range(2)]
    treatment = [_puts(arm(600, 1000), 300) for _ in range(2)]
    assert evaluate_ab(intervals(control[:1], treatment[:1]), config).outcome is Outcome.INCONCLUSIVE
    verdict = evaluate_ab(intervals(control, treatment), config)
    assert verdict.outcome is Outcome.ABORT and verdict.final and verdict.samples == 2
    assert "failed-put rate above control's by 0.295" in verdict.reason and "allowance 0.01" in verdict.reason


def test_arms_failing_puts_alike_do_not_abort() -> None:
    """Store pressure hits both arms: equal failed-put rates, whatever their noise, never abort."""
    config = replace(CONFIG, min_samples=5, max_samples=30, guard=AbortGuard())
    failed_c = [40, 90, 10, 70, 55, 20, 80, 35, 60, 45]
    failed_t = [70, 30, 85, 25, 60, 75, 15, 65, 40, 50]
    control = [_puts(arm(300, 1000), f) for f in failed_c]
    treatment = [_puts(arm(300, 1000), f) for f in failed_t]
    assert evaluate_ab(intervals(control, treatment), config).outcome is not Outcome.ABORT


def test_within_the_allowance_does_not_abort() -> None:
    config = replace(CONFIG, guard=AbortGuard(put_failure_rate_allowance=0.05))
    control = [_puts(arm(300, 1000), 0) for _ in range(6)]
    treatment = [_puts(arm(600, 1000), 30 + i % 2) for i in range(6)]  # 3 % more: allowed
    assert evaluate_ab(intervals(control, treatment), config).outcome is Outcome.SUCCESS


def test_without_attempted_puts_the_counts_are_compared() -> None:
    config = replace(CONFIG, min_samples=5, guard=AbortGuard(put_failure_allowance=2))
    control = [arm(300, 1000, put_failures=1 + i % 2) for i in range(4)]
    treatment = [arm(600, 1000, put_failures=40 + i % 2) for i in range(4)]  # the same swing, 39 more
    verdict = evaluate_ab(intervals(control, treatment), config)
    assert verdict.outcome is Outcome.ABORT and "put failures per interval above control's by 39" in verdict.reason
    assert evaluate_ab(intervals(control, treatment), replace(config, guard=AbortGuard(put_failure_allowance=None))
                       ).outcome is not Outcome.ABORT  # the guard off


def test_ttft_past_the_failure_threshold_aborts() -> None:
    config = replace(CONFIG, min_samples=5, guard=AbortGuard(consecutive=2, ttft_threshold_s=0.5))
    control = [arm(300, 1000, ttft=ttft(10, 0, 0, 0))] * 2
    treatment = [arm(300, 1000, ttft=ttft(0, 0, 10, 0))] * 2
    verdict = evaluate_ab(intervals(control, treatment), config)
    assert verdict.outcome is Outcome.ABORT
    assert "TTFT" in verdict.reason


def test_failed_measurements_never_decide_and_count_against_the_limit() -> None:
    config = replace(CONFIG, consecutive_error_limit=2)
    good = intervals([arm(300, 1000)] * 2, [arm(600, 1000)] * 2)
    down = [IntervalSample(start=100.0 + i, end=101.0 + i, error="Prometheus unreachable") for i in range(3)]
    two_down = evaluate_ab(good + down[:2], config)
    assert two_down.outcome is Outcome.INCONCLUSIVE and two_down.consecutive_errors == 2
    assert "Prometheus unreachable" in two_down.reason
    three_down = evaluate_ab(good + down, config)
    assert three_down.outcome is Outcome.ERROR and not three_down.final  # measuring goes on
    assert "resumes when the metric source answers" in three_down.reason
    assert "Prometheus unreachable" in three_down.reason
    # Recovering resets the count; the failed intervals are skipped, not zeros.
    recovered = evaluate_ab(good + down[:2] + intervals([arm(300, 1000)], [arm(600, 1000)]), config)
    assert recovered.outcome is Outcome.SUCCESS and recovered.consecutive_errors == 0


# ---- properties -----------------------------------------------------------------------------------

rates = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
queries = st.integers(min_value=1, max_value=100_000)
arm_samples = st.builds(lambda r, q: arm(round(r * q), q), rates, queries)
arm_lists = st.lists(arm_samples, min_size=3, max_size=8)
SYMMETRIC = AnalysisConfig(conditions=(Condition(BuiltinMetric.EXTERNAL_HIT_RATE.value,
                                                 min_effect=0.01, max_regression=0.01),),
                           min_samples=3)


@given(arm_lists, arm_lists)
@settings(max_examples=200, deadline=None)
def test_swapping_arms_flips_success_and_failure(a: list[ArmSample], b: list[ArmSample]) -> None:
    forward = evaluate_ab(intervals(a, b), SYMMETRIC).outcome
    backward = evaluate_ab(intervals(b, a), SYMMETRIC).outcome
    flipped = {Outcome.SUCCESS: Outcome.FAILURE, Outcome.FAILURE: Outcome.SUCCESS}
    assert backward == flipped.get(forward, forward)


@given(arm_lists)
@settings(max_examples=200, deadline=None)
def test_identical_arms_never_succeed_nor_fail(a: list[ArmSample]) -> None:
    verdict = evaluate_ab(intervals(a, a), SYMMETRIC)
    assert verdict.outcome is Outcome.INCONCLUSIVE


@given(arm_lists, arm_lists, st.lists(st.booleans(), min_size=3, max_size=8))
@settings(max_examples=200, deadline=None)
def test_failed_measurements_never_promote(a: list[ArmSample], b: list[ArmSample], fail: list[bool]) -> None:
    """Replacing intervals by failures can only remove evidence: Success survives only if the
    remaining measured intervals alone show it."""
    measured = intervals(a, b)
    mixed = [IntervalSample(start=i.start, end=i.end, error="down") if f else i for i, f in zip(measured, fail)]
    verdict = evaluate_ab(mixed, SYMMETRIC)
    if verdict.outcome is Outcome.SUCCESS:
        kept = [i for i in mixed if not i.failed]
        assert evaluate_ab(kept, SYMMETRIC).outcome is Outcome.SUCCESS
        assert len(kept) >= SYMMETRIC.min_samples


# ---- the folded state equals the direct formulas ---------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1e6), st.floats(1, 1e6)), min_size=2, max_size=40))
@example([(1.0, 1.0), (978119.0, 983070.0)])  # nearly proportional: true stderr 1e-8, folded 0
def test_running_ratio_sums_match_the_residual_formula(pairs: list[tuple[float, float]]) -> None:
    """Welford's centred moments give the same cluster standard error as summing residuals.

    The folded form gets the residual sum as Chh - 2R Chq + R^2 Cqq, a difference of terms far
    larger than itself when the intervals are nearly proportional, so it is exact only to
    float64's precision of those terms: the absolute bound is that rounding (a few ulps per
    accumulated interval, `eps * 4 (n + 3)` of their size) carried through the square root —
    not a constant (two intervals near 1e6 queries give a true stderr of 1e-8 and a folded 0)."""
    pairs = [(min(h, q), q) for h, q in pairs]
    n = len(pairs)
    ratio = sum(h for h, _ in pairs) / sum(q for _, q in pairs)
    qbar = sum(q for _, q in pairs) / n
    direct = math.sqrt(sum((h - ratio * q) ** 2 for h, q in pairs) / (n * (n - 1))) / qbar
    hbar = sum(h for h, _ in pairs) / n
    magnitude = sum((h - hbar) ** 2 + 2 * ratio * abs((h - hbar) * (q - qbar)) + (ratio * (q - qbar)) ** 2
                    for h, q in pairs)
    rounding = math.sqrt(4 * (n + 3) * sys.float_info.epsilon * magnitude / (n * (n - 1))) / qbar
    estimate = estimate_ratio(pairs)
    assert estimate is not None
    assert estimate.value == pytest.approx(ratio, rel=1e-9)
    assert estimate.stderr == pytest.approx(direct, rel=1e-6, abs=max(rounding, 1e-12))



def test_the_folded_state_holds_what_the_direct_formulas_give() -> None:
    """Folded interval by interval (failures in between), the state's estimates are the ratio
    estimator and residual standard error computed directly from the measured intervals."""
    from moonlease_operator.core.analysis import AnalysisState, fold_interval

    config = AnalysisConfig(conditions=(HIT_RATE,), min_samples=3)
    pairs = [(500, 1000), (430, 900), (610, 1100), (0, 0), (520, 1000)]  # one idle interval
    samples = intervals([arm(h, q) for h, q in pairs], [arm(h, q) for h, q in pairs])
    samples.insert(2, IntervalSample(start=0, end=1, error="Prometheus down"))
    samples.append(IntervalSample(start=0, end=1, error="Prometheus down"))
    state = AnalysisState()
    for interval in samples:
        state = fold_interval(state, interval, config)
    assert (state.samples, state.consecutive_errors, state.last_error) == (5, 1, "Prometheus down")
    used = [(h, q) for h, q in pairs if q > 0]
    ratio = sum(h for h, _ in used) / sum(q for _, q in used)
    qbar = sum(q for _, q in used) / len(used)
    stderr = math.sqrt(sum((h - ratio * q) ** 2 for h, q in used) / (len(used) * (len(used) - 1))) / qbar
    estimate = state.control.estimate(HIT_RATE.metric)
    assert estimate is not None and estimate.samples == 4
    assert estimate.value == pytest.approx(ratio) and estimate.stderr == pytest.approx(stderr)
    assert len(state.recent) == 5 and all(p.put_excess == 0 for p in state.recent)


def test_the_guard_prefers_the_arms_own_failed_puts_over_a_shared_masters() -> None:
    """On one shared store both arms read the same master counters: the engines' own failed put
    keys tell the arms apart."""
    config = AnalysisConfig(conditions=(HIT_RATE,), min_samples=5, guard=AbortGuard())

    def pair(failed_c: float, failed_t: float) -> tuple[ArmSample, ArmSample]:
        return (_puts(arm(300, 1000, put_failures=7), failed_c), _puts(arm(600, 1000, put_failures=7), failed_t))

    worse = [pair(0, 200) for _ in range(4)]
    verdict = evaluate_ab(intervals([c for c, _ in worse], [t for _, t in worse]), config)
    assert verdict.outcome is Outcome.ABORT and "failed-put rate" in verdict.reason
    shared_only = [(arm(300, 1000, put_failures=f), arm(600, 1000, put_failures=f)) for f in (0, 10, 30, 5)]
    verdict = evaluate_ab(intervals([c for c, _ in shared_only], [t for _, t in shared_only]), config)
    assert verdict.outcome is Outcome.INCONCLUSIVE  # same master, same counts: no excess


# ---- Student's t -----------------------------------------------------------------------------------

@pytest.mark.parametrize("confidence, df, table", [
    (0.95, 1, 12.7062), (0.95, 3, 3.1824), (0.90, 3, 2.3534), (0.95, 10, 2.2281), (0.99, 5, 4.0321),
    (0.80, 20, 1.3253), (0.95, 10**6, 1.9600),
])
def test_t_critical_values_match_the_tables(confidence: float, df: int, table: float) -> None:
    from moonlease_operator.core.sequential import t_critical

    assert t_critical(confidence, df) == pytest.approx(table, abs=1e-4)


def test_no_degree_of_freedom_means_no_decision() -> None:
    from moonlease_operator.core.sequential import t_critical

    assert t_critical(0.95, 0) == math.inf


def test_few_noisy_intervals_no_longer_decide_what_a_normal_z_would() -> None:
    """Effect 0.1 from 4 paired intervals (differences 0.10, 0.12, 0.08, 0.10): a z on the
    independent-interval standard error would call it; the series' error, which allows for an
    autocorrelation that 4 intervals cannot rule out, does not."""
    control = [arm(h, 1000) for h in (200, 300, 250, 330)]
    treatment = [arm(h, 1000) for h in (300, 420, 330, 430)]
    verdict = evaluate_ab(intervals(control, treatment), AnalysisConfig(conditions=(HIT_RATE,), min_samples=4))
    result = verdict.conditions[0]
    naive = math.sqrt(sum((d - 0.1) ** 2 for d in (0.1, 0.12, 0.08, 0.1)) / 3 / 4)
    assert result.effect == pytest.approx(0.1) and result.paired and result.samples == 4
    assert 0.1 - 1.96 * naive > 0 and result.stderr > naive
    assert verdict.outcome is Outcome.INCONCLUSIVE


# ---- the interval series (issue 26): pairing, autocorrelation, decisions on bounds ------------------

def _custom(pairs: list[tuple[dict[str, float], dict[str, float]]]) -> list[IntervalSample]:
    return [IntervalSample(i, i + 1, ArmSample(custom=c), ArmSample(custom=t)) for i, (c, t) in enumerate(pairs)]


def test_series_sums_give_the_autocovariances_of_any_linear_combination() -> None:
    import numpy as np

    from moonlease_operator.core.analysis import SeriesSums

    rng = np.random.default_rng(3)
    x = rng.normal(1000.0, 30.0, (40, 4)).cumsum(axis=0)  # a drifting level: the origin keeps precision
    sums = SeriesSums()
    for row in x:
        sums = sums.add(row.tolist())
    g = (0.3, -1.2, 0.7, 2.0)
    z = x @ np.array(g)
    z = z - z.mean()
    c0, c1 = sums.autocovariances(g)
    assert c0 == pytest.approx((z * z).mean(), rel=1e-9)
    assert c1 == pytest.approx((z[1:] * z[:-1]).sum() / len(z), rel=1e-9)
    assert sums.means() == pytest.approx(x.mean(axis=0).tolist(), rel=1e-12)


def test_a_drift_common_to_both_arms_cancels_in_the_paired_series() -> None:
    import numpy as np

    rng = np.random.default_rng(5)
    drift = np.cumsum(rng.normal(0.0, 1.0, 30))  # both arms follow the same load swing
    c, t = drift + rng.normal(0, 0.1, 30), drift + 0.5 + rng.normal(0, 0.1, 30)
    config = AnalysisConfig(conditions=(Condition("goodput", min_effect=0.1),), min_samples=5, max_samples=30)
    verdict = evaluate_ab(_custom([({"goodput": a}, {"goodput": b}) for a, b in zip(c, t)]), config)
    result = verdict.conditions[0]
    assert result.paired and result.samples == 30
    unpaired = math.hypot(result.control.stderr, result.treatment.stderr)
    assert result.stderr < unpaired / 5  # the drift is gone from the difference
    assert verdict.outcome is Outcome.SUCCESS and result.lower > 0.1


def test_a_point_estimate_past_min_effect_promotes_only_once_its_bound_is() -> None:
    # Differences 0.03 +- 0.01 around minEffect 0.02: the estimate clears it, the bound does not.
    diffs = [0.03 + 0.01 * (-1) ** i for i in range(12)]
    config = AnalysisConfig(conditions=(Condition("gain", min_effect=0.02, max_regression=0.02),),
                            min_samples=5, max_samples=12)
    verdict = evaluate_ab(_custom([({"gain": 0.0}, {"gain": d}) for d in diffs]), config)
    result = verdict.conditions[0]
    assert result.effect == pytest.approx(0.03) and result.effect > 0.02 and result.lower < 0.02
    assert result.threshold == 0.02 and verdict.outcome is Outcome.INCONCLUSIVE
    assert verdict.final  # out of samples: held, not promoted


def test_a_guardrail_is_pending_until_shown_within_tolerance() -> None:
    gain = [({"gain": 0.0, "lat": 1.0 + (i % 3)}, {"gain": 1.0 + 0.01 * (i % 2), "lat": 1.0 + ((i + 1) % 3)})
            for i in range(8)]
    config = AnalysisConfig(conditions=(Condition("gain", min_effect=0.1),
                                        Condition("lat", MetricDirection.LOWER_IS_BETTER, max_regression=0.05,
                                                  guardrail=True)), min_samples=5, max_samples=30)
    verdict = evaluate_ab(_custom(gain), config)
    gain_result, guard = verdict.conditions
    assert gain_result.outcome is Outcome.SUCCESS
    assert guard.outcome is Outcome.INCONCLUSIVE and "pending" in guard.reason and guard.threshold == -0.05
    assert verdict.outcome is Outcome.INCONCLUSIVE and not verdict.final  # a noisy guardrail holds the promotion


def test_a_failure_rolls_back_even_when_another_condition_has_no_data() -> None:
    pairs = [({"gain": 1.0 + 0.01 * (i % 2)}, {"gain": 0.0 + 0.01 * (i % 2)}) for i in range(6)]
    config = AnalysisConfig(conditions=(Condition("gain", max_regression=0.1), Condition("never")),
                            min_samples=5, max_samples=30)
    verdict = evaluate_ab(_custom(pairs), config)
    assert [r.outcome for r in verdict.conditions] == [Outcome.FAILURE, Outcome.NO_DATA]
    assert verdict.outcome is Outcome.FAILURE and verdict.final


def test_guardrails_alone_are_not_an_analysis() -> None:
    with pytest.raises(ValueError, match="primary"):
        AnalysisConfig(conditions=(Condition("lat", guardrail=True),))
