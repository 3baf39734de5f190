"""Measuring an A/B test's arms, for the reconcile the planner says is due. I/O.

`build_metric_source` picks the source the spec asks for: Prometheus (the arms' pods by their
names, or the user's matchers) or, without one, the running pods the arms' workloads select,
scraped directly. `measure_arms` reads them off the event loop and hands back the reading and the
snapshot the next interval is measured against. The snapshot is kept in the operator's memory
(kopf's per-policy memo), not in the status: a restarted operator re-reads it from Prometheus at
`status.abTest.lastMeasuredAt`, or, when scraping, takes a new baseline (one interval is lost,
none is wrong).
"""

from __future__ import annotations

import asyncio
import datetime
import functools
from collections.abc import Callable
from typing import Any

from moonlease_operator.adapters.metric_sources import (
    MetricSource,
    MetricSourceError,
    PrometheusSource,
    ScrapeSource,
    fetch_interval,
)
from moonlease_operator.api import PolicySpec
from moonlease_operator.core.ab_plan import ABReading
from moonlease_operator.core.ab_samples import (
    Snapshot,
    WorkloadRef,
    arm_scrape_endpoints,
    failed_interval,
    pod_matchers,
)
from moonlease_operator.core.analysis import Arm
from moonlease_operator.core.rollout import Observed


def _arm_workloads(spec: PolicySpec) -> dict[Arm, list[WorkloadRef]]:
    ab = spec.rollout.ab_test
    assert ab is not None
    kinds = {t.name: t.kind.value for t in spec.targets if t.name is not None}
    return {Arm.CONTROL: [(kinds[n], n) for n in ab.control.workloads],
            Arm.TREATMENT: [(kinds[n], n) for n in ab.treatment.workloads]}


def build_metric_source(spec: PolicySpec, namespace: str, observed: Observed) -> MetricSource:
    ab = spec.rollout.ab_test
    assert ab is not None
    arms = _arm_workloads(spec)
    prometheus = ab.prometheus
    if prometheus is not None:
        labels = {"pod_label": prometheus.pod_label, "namespace_label": prometheus.namespace_label}
        if prometheus.selectors is not None:
            selectors = {Arm.CONTROL: prometheus.selectors.control, Arm.TREATMENT: prometheus.selectors.treatment}
        else:
            selectors = {arm: pod_matchers(namespace, refs, **labels) for arm, refs in arms.items()}
        if prometheus.store_selectors is not None:  # one master per arm
            stores = {Arm.CONTROL: prometheus.store_selectors.control,
                      Arm.TREATMENT: prometheus.store_selectors.treatment}
        else:
            store = prometheus.store_selector or pod_matchers(
                namespace, [(spec.master.kind.value, spec.master.name)], **labels)
            stores = {arm: store for arm in Arm}
        return PrometheusSource(prometheus.url, selectors, store_selectors=stores,
                                custom_queries=prometheus.custom_queries)
    workload_selectors: dict[Arm, list[dict[str, Any]]] = {
        arm: [dict(obj["spec"]["selector"]) for ref in refs
              if (obj := observed.workloads.get(ref)) is not None and (obj.get("spec") or {}).get("selector")]
        for arm, refs in arms.items()}
    endpoints = arm_scrape_endpoints(observed.pods or (), workload_selectors, ab.scrape.port)
    return ScrapeSource(endpoints, path=ab.scrape.path)


async def measure_arms(source_factory: Callable[[], MetricSource], baseline: Snapshot | None, *,
                       last_measured_at: datetime.datetime | None,
                       now: datetime.datetime) -> tuple[ABReading, Snapshot | None]:
    """The reading for this reconcile (the baseline when there is none yet) and the snapshot to
    keep. Blocking HTTP runs in the default executor. Whatever fails — building the source from
    the spec, a request, an answer — is an error sample, never an exception."""
    loop = asyncio.get_running_loop()
    try:
        return await _measure(loop, source_factory(), baseline, last_measured_at=last_measured_at, now=now)
    except Exception as exc:  # noqa: BLE001 - building or reading a source never fails a reconcile
        start = baseline.at if baseline is not None else now.timestamp()
        return ABReading(now, failed_interval(start, now.timestamp(), f"{type(exc).__name__}: {exc}")), baseline


async def _measure(loop: asyncio.AbstractEventLoop, source: MetricSource, baseline: Snapshot | None, *,
                   last_measured_at: datetime.datetime | None,
                   now: datetime.datetime) -> tuple[ABReading, Snapshot | None]:
    if baseline is None and last_measured_at is not None and isinstance(source, PrometheusSource):
        try:  # Prometheus remembers: measure from where the last operator stopped
            baseline = await loop.run_in_executor(
                None, functools.partial(source.fetch_snapshot, at=last_measured_at.timestamp()))
        except MetricSourceError:
            baseline = None
    sample, snapshot = await loop.run_in_executor(
        None, functools.partial(fetch_interval, source, baseline, at=now.timestamp()))
    return ABReading(now, sample), snapshot
