"""Metric sources for the A/B analysis: Prometheus' HTTP API, or the pods' own /metrics. I/O.

A source has one method, `fetch_snapshot(at=...)`: every built-in series (see
`core.ab_samples.BUILTIN_SERIES`) of each arm at that instant, plus the user's PromQL values.
It raises `MetricSourceError` when it cannot answer (after its own short retries);
`fetch_interval` turns that into data — an `IntervalSample` in error, which the analysis counts
against its consecutive-error limit and never treats as zeros (argo-rollouts' Error phase).

Blocking (urllib with timeouts): an async caller runs it in an executor.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client.parser import text_string_to_metric_families

from moonlease_operator.api.abtest import render_custom_query
from moonlease_operator.core.ab_samples import (
    BUILTIN_SERIES,
    Series,
    Snapshot,
    build_interval,
    canonical_name,
    failed_interval,
)
from moonlease_operator.core.analysis import Arm, IntervalSample


class MetricSourceError(Exception):
    """The source could not measure (unreachable, bad answer); the message says why."""


class MetricSource(Protocol):
    def fetch_snapshot(self, *, at: float) -> Snapshot: ...


def fetch_interval(source: MetricSource, previous: Snapshot | None, *,
                   at: float) -> tuple[IntervalSample | None, Snapshot | None]:
    """Measure the interval ending `at`: (the sample, the snapshot to diff against next time).

    The first successful snapshot is the baseline and yields no sample. A failed fetch yields an
    error sample and keeps the previous snapshot, so the next good interval spans the gap.
    """
    start = previous.at if previous else at
    try:
        current = source.fetch_snapshot(at=at)
        if previous is None:
            return None, current
        return build_interval(previous, current), current
    except MetricSourceError as exc:
        return failed_interval(start, at, str(exc)), previous
    except Exception as exc:  # noqa: BLE001 - any failure of a source is an error sample, never a crash
        return failed_interval(start, at, f"{type(exc).__name__}: {exc}"), previous


def _with_retries(what: str, attempts: int, delay: float, sleep: Callable[[float], None],
                  call: Callable[[], Any], *, detail: str = "") -> Any:
    last = ""
    for attempt in range(max(1, attempts)):
        if attempt:
            sleep(delay)
        try:
            return call()
        except MetricSourceError as exc:
            last = str(exc)
        except (OSError, ValueError) as exc:  # URLError, timeouts, refused, bad JSON/text
            last = f"{type(exc).__name__}: {exc}"
    raise MetricSourceError(f"{what} failed after {max(1, attempts)} attempts: {last}{detail}")


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects are not followed: the Prometheus URL passed the operator's allowlist, the
    address a redirect names did not (a 3xx then fails the query, saying where it pointed)."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> None:
        raise MetricSourceError(f"HTTP {code} redirect to {newurl} not followed (only the allowlisted"
                                " URL is queried): set prometheus.url to the address that answers")


_OPENER = urllib.request.build_opener(_NoRedirects)


def _get(url: str, timeout: float) -> str:
    with _OPENER.open(url, timeout=timeout) as response:  # http(s) URLs we build, never redirected
        body: bytes = response.read()
    return body.decode("utf-8")


class PrometheusSource:
    """Instant queries against a Prometheus server's HTTP API.

    `selectors`: label matchers per arm (`core.ab_samples.pod_matchers`, or the user's).
    `store_selectors`: matchers for the Mooncake master series of each arm's store, when they
    differ (default: the same). `custom_queries`: {name: PromQL template}, `$selector` replaced by
    the arm's matcher; each must answer one number (wrap it in sum()).
    """

    def __init__(self, url: str, selectors: Mapping[Arm, str], *,
                 store_selectors: Mapping[Arm, str] | None = None,
                 custom_queries: Mapping[str, str] | None = None, timeout: float = 2.0,
                 attempts: int = 2, retry_delay: float = 0.2,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.url = url.rstrip("/")
        self.selectors = dict(selectors)
        self.store_selectors = dict(store_selectors or selectors)
        self.custom_queries = dict(custom_queries or {})
        self.timeout, self.attempts, self.retry_delay, self.sleep = timeout, attempts, retry_delay, sleep

    def _query(self, promql: str, at: float) -> list[dict[str, Any]]:
        def call() -> list[dict[str, Any]]:
            params = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"})
            try:
                payload = json.loads(_get(f"{self.url}/api/v1/query?{params}", self.timeout))
            except urllib.error.HTTPError as exc:
                raise MetricSourceError(f"HTTP {exc.code}: {exc.read(512).decode('utf-8', 'replace')}") from exc
            if payload.get("status") != "success":
                raise MetricSourceError(f"{payload.get('errorType')}: {payload.get('error')}")
            data = payload.get("data") if isinstance(payload, dict) else None
            if not isinstance(data, dict) or data.get("resultType") != "vector":
                raise MetricSourceError(f"expected a vector, got {str(payload)[:200]}")
            return list(data.get("result") or [])
        # The source first: a message is cut to ERROR_MESSAGE_LIMIT characters in the status.
        return _with_retries(f"Prometheus at {self.url}", self.attempts, self.retry_delay, self.sleep, call,
                             detail=f" (query {promql})")

    def _series(self, names: Sequence[str], selector: str, at: float) -> list[Series]:
        matcher = "|".join(sorted({spelling for n in names for spelling in (n, n.replace(":", "_"))}))
        out = []
        for item in self._query(f'{{__name__=~"{matcher}",{selector}}}', at):
            labels = dict(item["metric"])
            name = canonical_name(labels.pop("__name__"))
            if name is not None:
                out.append(Series(name, tuple(sorted(labels.items())), float(item["value"][1])))
        return out

    def fetch_snapshot(self, *, at: float) -> Snapshot:
        store_names = [n for n in BUILTIN_SERIES if n.startswith("master_")]
        vllm_names = [n for n in BUILTIN_SERIES if not n.startswith("master_")]
        series: dict[Arm, tuple[Series, ...]] = {}
        custom: dict[Arm, dict[str, float]] = {}
        for arm in Arm:
            found = self._series(vllm_names, self.selectors[arm], at)
            found += self._series(store_names, self.store_selectors[arm], at)
            series[arm] = tuple(found)
            custom[arm] = {}
            for name, template in self.custom_queries.items():
                result = self._query(render_custom_query(template, self.selectors[arm]), at)
                if len(result) == 1:
                    custom[arm][name] = float(result[0]["value"][1])
                # no answer (or several) leaves the metric missing: its condition reports NoData
        return Snapshot(at=at, series=series, custom=custom)


class ScrapeSource:
    """Reads the pods' `/metrics` directly, when no Prometheus is configured.

    `endpoints`: "host:port" per arm (`core.ab_samples.arm_scrape_endpoints` builds them from
    the pods the arms' workloads select). Every endpoint must answer, or the snapshot fails: a
    partial arm would bias its deltas. Custom PromQL needs Prometheus and is not available here.
    """

    def __init__(self, endpoints: Mapping[Arm, Sequence[str]], *, path: str = "/metrics",
                 timeout: float = 2.0, attempts: int = 2, retry_delay: float = 0.2,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.endpoints = {arm: list(endpoints.get(arm, ())) for arm in Arm}
        self.path = path
        self.timeout, self.attempts, self.retry_delay, self.sleep = timeout, attempts, retry_delay, sleep

    def _scrape(self, endpoint: str) -> list[Series]:
        def call() -> list[Series]:
            text = _get(f"http://{endpoint}{self.path}", self.timeout)
            out = []
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    name = canonical_name(sample.name)
                    if name is not None:
                        labels = dict(sample.labels, instance=endpoint)
                        out.append(Series(name, tuple(sorted(labels.items())), float(sample.value)))
            return out
        return _with_retries(f"scrape of {endpoint}{self.path}", self.attempts, self.retry_delay, self.sleep, call)

    def fetch_snapshot(self, *, at: float) -> Snapshot:
        series: dict[Arm, tuple[Series, ...]] = {}
        for arm in Arm:
            if not self.endpoints[arm]:
                raise MetricSourceError(f"no /metrics endpoints for the {arm.value} arm")
            series[arm] = tuple(s for endpoint in self.endpoints[arm] for s in self._scrape(endpoint))
        return Snapshot(at=at, series=series)
