"""A/B metric sources against a real Prometheus scraping real exporters, one per arm.

Each arm's exporter serves vLLM's prefix-cache counters and TTFT histogram and the Mooncake
master's put-failure and eviction counts under their real names; the test drives the values
interval by interval, waits until Prometheus has scraped them (a step gauge), measures the
interval through the source and asks `evaluate_ab` for the verdict, as the operator does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client import Histogram as PromHistogram

from moonlease_dev.testbed.prometheus import PrometheusServer
from moonlease_operator.adapters.metric_sources import (
    MetricSource,
    PrometheusSource,
    ScrapeSource,
    fetch_interval,
)
from moonlease_operator.core.ab_samples import Snapshot, arm_scrape_endpoints
from moonlease_operator.api.abtest import BuiltinMetric, MetricDirection
from moonlease_operator.core.analysis import (
    AbortGuard,
    AnalysisConfig,
    Arm,
    Condition,
    IntervalSample,
    Outcome,
    Verdict,
    evaluate_ab,
)

pytestmark = pytest.mark.prometheus

LABELS = ("model_name", "engine")
MODEL = {"model_name": "tiny", "engine": "0"}
HIT_RATE = Condition(BuiltinMetric.EXTERNAL_HIT_RATE.value, MetricDirection.HIGHER_IS_BETTER,
                     min_effect=0.05, max_regression=0.05)
TTFT_GUARD = Condition(BuiltinMetric.TTFT_P90.value, MetricDirection.LOWER_IS_BETTER, max_regression=0.5,
                       guardrail=True)


class ArmExporter:
    """One arm's pods and store, as a real /metrics endpoint."""

    def __init__(self, registry: CollectorRegistry, address: str, *, external: bool = True) -> None:
        self.address = address
        self.queries = Counter("vllm:prefix_cache_queries", "tokens queried", LABELS, registry=registry)
        self.hits = Counter("vllm:prefix_cache_hits", "tokens hit", LABELS, registry=registry)
        self.external = external
        if external:
            self.ext_queries = Counter("vllm:external_prefix_cache_queries", "store tokens queried", LABELS,
                                       registry=registry)
            self.ext_hits = Counter("vllm:external_prefix_cache_hits", "store tokens hit", LABELS,
                                    registry=registry)
        self.ttft = PromHistogram("vllm:time_to_first_token_seconds", "TTFT", LABELS, registry=registry,
                                  buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
        self.put_failures = Counter("master_put_start_alloc_failures", "put alloc failures", registry=registry)
        self.evicted = Gauge("master_evicted_key_count", "evicted keys", registry=registry)
        self.step = Gauge("moonlease_test_step", "interval the test has driven", registry=registry)

    def serve(self, *, hit_rate: float, tokens: int = 1000, ttft_s: float = 0.08, put_failures: int = 0) -> None:
        hits = round(hit_rate * tokens)
        self.queries.labels(**MODEL).inc(tokens)
        self.hits.labels(**MODEL).inc(hits)
        if self.external:
            self.ext_queries.labels(**MODEL).inc(tokens)
            self.ext_hits.labels(**MODEL).inc(hits)
        for _ in range(20):
            self.ttft.labels(**MODEL).observe(ttft_s)
        self.put_failures.inc(put_failures)
        self.evicted.inc(3)


@dataclass
class ABBed:
    control: ArmExporter
    treatment: ArmExporter
    prometheus: PrometheusServer
    steps: int = 0
    snapshot: Snapshot | None = None
    intervals: list[IntervalSample] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)

    def source(self, **kwargs: object) -> PrometheusSource:
        return PrometheusSource(self.prometheus.url, {Arm.CONTROL: 'job="control"', Arm.TREATMENT: 'job="treatment"'},
                                **kwargs)  # type: ignore[arg-type]

    def publish(self) -> None:
        """Mark the driven values and wait until Prometheus has scraped both arms."""
        self.steps += 1
        for arm in (self.control, self.treatment):
            arm.step.set(self.steps)
        for job in ("control", "treatment"):
            assert self.prometheus.wait_for(f'moonlease_test_step{{job="{job}"}} >= {self.steps}'), job

    def measure(self, source: MetricSource, config: AnalysisConfig) -> Verdict | None:
        sample, self.snapshot = fetch_interval(source, self.snapshot, at=time.time())
        if sample is None:
            return None
        self.intervals.append(sample)
        verdict = evaluate_ab(self.intervals, config)
        self.verdicts.append(verdict)
        return verdict

    def run(self, source: MetricSource, config: AnalysisConfig,
            plan: Sequence[tuple[dict[str, float], dict[str, float]]]) -> Verdict:
        """Baseline, then one interval per (control, treatment) drive; stop at a final verdict."""
        self.publish()
        assert self.measure(source, config) is None  # the baseline
        verdict = None
        for control, treatment in plan:
            self.control.serve(**control)  # type: ignore[arg-type]
            self.treatment.serve(**treatment)  # type: ignore[arg-type]
            self.publish()
            verdict = self.measure(source, config)
            assert verdict is not None
            if verdict.final:
                break
        assert verdict is not None
        return verdict


@pytest.fixture
def ab_bed(prometheus: Callable[..., PrometheusServer],
           metrics_exporter: Callable[[], tuple[CollectorRegistry, str]]) -> Callable[..., ABBed]:
    def make(*, external: bool = True) -> ABBed:
        control = ArmExporter(*metrics_exporter(), external=external)
        treatment = ArmExporter(*metrics_exporter(), external=external)
        server = prometheus({"control": [control.address], "treatment": [treatment.address]})
        return ABBed(control, treatment, server)
    return make


def steady(rate: float, n: int, jitter: float = 0.01, **extra: float) -> list[dict[str, float]]:
    return [dict(hit_rate=rate + (jitter if i % 2 else -jitter), **extra) for i in range(n)]


def test_clear_win_promotes_with_per_arm_estimates(ab_bed: Callable[..., ABBed]) -> None:
    bed = ab_bed()
    config = AnalysisConfig(conditions=(HIT_RATE, TTFT_GUARD), min_samples=3, max_samples=6)
    # Prometheus stores vLLM's `vllm:` names as `vllm_` (OpenMetrics escaping): match either.
    source = bed.source(custom_queries={
        "queried": 'sum({__name__=~"vllm[:_]prefix_cache_queries_total",$selector})'})
    verdict = bed.run(source, config, list(zip(steady(0.30, 6), steady(0.60, 6))))
    assert verdict.outcome is Outcome.SUCCESS, verdict.reason
    # 3 intervals at the earliest; the always-valid rule with 2 degrees of freedom may want a 4th
    assert 3 <= verdict.samples <= 6
    assert [v.outcome for v in bed.verdicts[:2]] == [Outcome.INCONCLUSIVE] * 2
    hit_rate = verdict.conditions[0]
    assert hit_rate.control is not None and hit_rate.treatment is not None
    assert hit_rate.control.value == pytest.approx(0.30, abs=0.02)
    assert hit_rate.treatment.value == pytest.approx(0.60, abs=0.02)
    # The user's PromQL is evaluated per arm through $selector.
    assert bed.intervals[-1].control is not None
    assert bed.intervals[-1].control.custom["queried"] == 1000 * verdict.samples
    assert bed.intervals[-1].control.evictions == 3


def test_regression_rolls_back(ab_bed: Callable[..., ABBed]) -> None:
    bed = ab_bed()
    config = AnalysisConfig(conditions=(HIT_RATE,), min_samples=3, max_samples=6)
    verdict = bed.run(bed.source(), config, list(zip(steady(0.50, 6), steady(0.20, 6))))
    assert verdict.outcome is Outcome.FAILURE, verdict.reason
    assert "externalHitRate" in verdict.reason


def test_ttft_regression_fails_the_guardrail(ab_bed: Callable[..., ABBed]) -> None:
    bed = ab_bed()
    config = AnalysisConfig(conditions=(HIT_RATE, TTFT_GUARD), min_samples=3, max_samples=4)
    plan = list(zip(steady(0.30, 4, ttft_s=0.08), steady(0.60, 4, ttft_s=2.0)))
    verdict = bed.run(bed.source(), config, plan)
    assert verdict.outcome is Outcome.FAILURE, verdict.reason
    assert "ttftP90" in verdict.reason


def test_no_difference_is_inconclusive_and_holds(ab_bed: Callable[..., ABBed]) -> None:
    bed = ab_bed()
    config = AnalysisConfig(conditions=(HIT_RATE,), min_samples=3, max_samples=3)
    plan = list(zip(steady(0.40, 3, jitter=0.10), steady(0.41, 3, jitter=0.10)))
    verdict = bed.run(bed.source(), config, plan)
    assert verdict.outcome is Outcome.INCONCLUSIVE and verdict.final, verdict.reason
    assert "maximum of 3 samples" in verdict.reason


def test_steady_excess_put_failures_abort_early(ab_bed: Callable[..., ABBed]) -> None:
    bed = ab_bed()
    config = AnalysisConfig(conditions=(HIT_RATE,), min_samples=5, guard=AbortGuard(put_failure_allowance=2))
    plan = [(dict(hit_rate=0.3), dict(hit_rate=0.6, put_failures=20)) for _ in range(5)]
    verdict = bed.run(bed.source(), config, plan)
    assert verdict.outcome is Outcome.ABORT, verdict.reason
    # The exporters serve the master's allocation failures only: the per-interval counts compared.
    assert "put failures per interval above control's by 20" in verdict.reason and "allowance 2" in verdict.reason
    assert verdict.samples == 2  # aborted before min_samples, despite the winning hit rate
    assert Outcome.SUCCESS not in [v.outcome for v in bed.verdicts]


def test_put_failures_in_both_arms_alike_never_abort_a_winning_treatment(ab_bed: Callable[..., ABBed]) -> None:
    """Store pressure fails puts in both arms (when lease policies matter most): the guard
    compares the arms, so failures the control shows too do not abort the test."""
    bed = ab_bed()
    config = AnalysisConfig(conditions=(HIT_RATE,), min_samples=5, max_samples=8,
                            guard=AbortGuard(put_failure_allowance=2))
    failures = [20, 14, 26, 17, 23, 20, 15, 25]  # the same pressure, interval by interval
    plan = [(dict(hit_rate=0.3, put_failures=f), dict(hit_rate=0.6, put_failures=failures[-1 - i]))
            for i, f in enumerate(failures)]
    verdict = bed.run(bed.source(), config, plan)
    assert Outcome.ABORT not in [v.outcome for v in bed.verdicts], [v.reason for v in bed.verdicts]
    assert verdict.outcome is Outcome.SUCCESS, verdict.reason


def test_missing_metrics_give_no_data_with_a_clear_reason(ab_bed: Callable[..., ABBed]) -> None:
    bed = ab_bed(external=False)
    config = AnalysisConfig(conditions=(HIT_RATE,), min_samples=2, max_samples=2)
    verdict = bed.run(bed.source(), config, list(zip(steady(0.3, 2), steady(0.6, 2))))
    assert verdict.outcome is Outcome.NO_DATA
    assert verdict.reason == "externalHitRate: no data for control and treatment"


def test_prometheus_down_is_an_error_measurement_never_a_promotion(ab_bed: Callable[..., ABBed]) -> None:
    bed = ab_bed()
    config = AnalysisConfig(conditions=(HIT_RATE,), min_samples=3, consecutive_error_limit=2)
    source = bed.source(timeout=0.5, attempts=2, retry_delay=0.05)
    bed.run(source, config, list(zip(steady(0.3, 2), steady(0.6, 2))))
    assert [v.outcome for v in bed.verdicts] == [Outcome.INCONCLUSIVE] * 2  # winning, but 2 of 3
    bed.prometheus.stop()
    bed.control.serve(hit_rate=0.3)
    bed.treatment.serve(hit_rate=0.6)
    outcomes = [bed.measure(source, config) for _ in range(3)]
    assert [v.outcome for v in outcomes if v] == [Outcome.INCONCLUSIVE, Outcome.INCONCLUSIVE, Outcome.ERROR]
    assert all(i.failed for i in bed.intervals[-3:])
    error = bed.intervals[-1].error or ""
    assert "failed after 2 attempts" in error and bed.prometheus.url in error
    assert "3 consecutive failed measurements" in outcomes[-1].reason  # type: ignore[union-attr]
    assert Outcome.SUCCESS not in [v.outcome for v in bed.verdicts]


def test_direct_scraping_without_prometheus(ab_bed: Callable[..., ABBed]) -> None:
    bed = ab_bed()
    pods = [{"metadata": {"labels": {"app": app}, "annotations": {"prometheus.io/port": address.split(":")[1]}},
             "status": {"phase": "Running", "podIP": address.split(":")[0]}}
            for app, address in (("decode-a", bed.control.address), ("decode-b", bed.treatment.address))]
    endpoints = arm_scrape_endpoints(pods, {Arm.CONTROL: [{"matchLabels": {"app": "decode-a"}}],
                                            Arm.TREATMENT: [{"matchLabels": {"app": "decode-b"}}]}, 8000)
    assert endpoints == {Arm.CONTROL: [bed.control.address], Arm.TREATMENT: [bed.treatment.address]}
    source = ScrapeSource(endpoints)
    config = AnalysisConfig(conditions=(HIT_RATE, TTFT_GUARD), min_samples=3, max_samples=5)
    bed.snapshot = source.fetch_snapshot(at=time.time())
    for control, treatment in zip(steady(0.3, 5), steady(0.6, 5)):
        bed.control.serve(**control)
        bed.treatment.serve(**treatment)
        verdict = bed.measure(source, config)
        assert verdict is not None
        if verdict.final:
            break
    assert verdict.outcome is Outcome.SUCCESS, verdict.reason
    assert 3 <= verdict.samples <= 5
    first = bed.intervals[0]
    assert first.treatment is not None and first.treatment.external_queries == 1000
    assert first.treatment.ttft is not None and first.treatment.ttft.count == 20

    unreachable = ScrapeSource({Arm.CONTROL: [bed.control.address], Arm.TREATMENT: ["127.0.0.1:1"]},
                               timeout=0.5, attempts=2, retry_delay=0.01)
    sample, kept = fetch_interval(unreachable, bed.snapshot, at=time.time())
    assert sample is not None and sample.failed and kept is bed.snapshot
    assert "127.0.0.1:1/metrics failed after 2 attempts" in (sample.error or "")
