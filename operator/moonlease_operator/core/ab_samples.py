"""From raw metric readings to A/B interval samples. Pure.

A metric source (adapters/metric_sources.py) reads, at one instant, every series of the built-in
metrics for each arm (a `Snapshot`); `build_interval` turns two consecutive snapshots into one
`IntervalSample` of counter deltas, the input of `core.analysis.evaluate_ab`. Both sources —
Prometheus' HTTP API and direct `/metrics` scraping — share this code, so they agree.

Deltas are taken per series and then summed per arm, reset-aware like PromQL's increase(): a
series whose value fell (its pod restarted) contributes its current value; a series absent from
the previous snapshot (a new pod) contributes its whole value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moonlease_operator.api.common import LabelSelector
from moonlease_operator.core.analysis import Arm, ArmSample, Histogram, IntervalSample

# vLLM (vllm/v1/metrics/loggers.py; counters exposed with `_total`) and the Mooncake master
# (master_service metrics, see NOTES §3). Labels: model_name, engine for vLLM.
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"
PUT_ALLOC_FAILURES = "master_put_start_alloc_failures_total"
STORE_FAILED_KEYS = "vllm:mooncake_store_operation_failed_keys_total"  # {operation="save_put"}: puts
STORE_KEYS = "vllm:mooncake_store_operation_keys_total"  # {operation="save_put"}: puts attempted
EVICTED_KEYS = "master_evicted_key_count"

BUILTIN_SERIES = (PREFIX_QUERIES, PREFIX_HITS, EXTERNAL_QUERIES, EXTERNAL_HITS, TTFT_BUCKET,
                  STORE_FAILED_KEYS, STORE_KEYS, PUT_ALLOC_FAILURES, EVICTED_KEYS)

# prometheus-client escapes `:` to `_` when a scraper negotiates OpenMetrics (Prometheus does), so
# the same vLLM counter reaches Prometheus as `vllm_prefix_cache_queries_total`: accept both.
_CANONICAL = {**{n: n for n in BUILTIN_SERIES}, **{n.replace(":", "_"): n for n in BUILTIN_SERIES}}


def canonical_name(name: str) -> str | None:
    """The built-in series `name` denotes, in either spelling; None for any other series."""
    return _CANONICAL.get(name)


@dataclass(frozen=True)
class Series:
    name: str
    labels: tuple[tuple[str, str], ...]
    """Sorted (name, value) pairs, without __name__."""
    value: float


@dataclass(frozen=True)
class Snapshot:
    """Every built-in series per arm at one instant (`at`, seconds), and custom query values."""

    at: float
    series: Mapping[Arm, tuple[Series, ...]]
    custom: Mapping[Arm, Mapping[str, float]] = field(default_factory=dict)


def _deltas(previous: Sequence[Series], current: Sequence[Series]) -> list[Series]:
    before = {(s.name, s.labels): s.value for s in previous}
    out = []
    for s in current:
        old = before.get((s.name, s.labels))
        delta = s.value if old is None or s.value < old else s.value - old
        out.append(Series(s.name, s.labels, delta))
    return out


def _total(deltas: Sequence[Series], name: str, **labels: str) -> float | None:
    values = [s.value for s in deltas if s.name == name and all(dict(s.labels).get(k) == v for k, v in labels.items())]
    return sum(values) if values else None


def _histogram(deltas: Sequence[Series], name: str) -> Histogram | None:
    by_le: dict[float, float] = {}
    for s in deltas:
        if s.name != name:
            continue
        le = dict(s.labels).get("le")
        if le is None:
            continue
        bound = math.inf if le in ("+Inf", "Inf", "inf") else float(le)
        by_le[bound] = by_le.get(bound, 0.0) + s.value
    if not by_le or math.inf not in by_le:
        return None
    return Histogram(tuple(sorted(by_le.items())))


def build_arm_sample(previous: Sequence[Series], current: Sequence[Series],
                     custom: Mapping[str, float]) -> ArmSample:
    deltas = _deltas(previous, current)
    return ArmSample(
        prefix_hits=_total(deltas, PREFIX_HITS), prefix_queries=_total(deltas, PREFIX_QUERIES),
        external_hits=_total(deltas, EXTERNAL_HITS), external_queries=_total(deltas, EXTERNAL_QUERIES),
        ttft=_histogram(deltas, TTFT_BUCKET),
        put_alloc_failures=_total(deltas, PUT_ALLOC_FAILURES), evictions=_total(deltas, EVICTED_KEYS),
        put_failed_keys=_total(deltas, STORE_FAILED_KEYS, operation="save_put"),
        put_keys=_total(deltas, STORE_KEYS, operation="save_put"),
        custom=dict(custom),
    )


def build_interval(previous: Snapshot, current: Snapshot) -> IntervalSample:
    """The interval between two snapshots; an arm with no series at all counts as unmeasured."""
    arms: dict[Arm, ArmSample | None] = {}
    missing = []
    for arm in Arm:
        now = current.series.get(arm, ())
        if not now and not current.custom.get(arm):
            arms[arm] = None
            missing.append(arm.value)
            continue
        arms[arm] = build_arm_sample(previous.series.get(arm, ()), now, current.custom.get(arm, {}))
    error = f"no series for the {' and '.join(missing)} arm" if missing else None
    return IntervalSample(start=previous.at, end=current.at, control=arms[Arm.CONTROL],
                          treatment=arms[Arm.TREATMENT], error=error)


# ---- errors as data ----------------------------------------------------------------------------------

ERROR_MESSAGE_LIMIT = 120
"""Characters of a metric source's error that reach the status and Events."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


def clean_error_message(text: str, limit: int = ERROR_MESSAGE_LIMIT) -> str:
    """An error from a metric source, fit for the status and Events: control characters (a
    server's newlines, terminal escapes) become one space, and the text is cut to `limit`
    characters (an error page's body can be anything, of any length)."""
    flat = _CONTROL.sub(" ", text).strip()
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


def failed_interval(start: float, end: float, error: str) -> IntervalSample:
    """The error sample of a measurement that failed: the one way a failure becomes data."""
    return IntervalSample(start=start, end=end, error=clean_error_message(error) or "measurement failed")


# ---- which pods and series belong to an arm -----------------------------------------------------------

PORT_ANNOTATION = "prometheus.io/port"
"""Pod annotation naming its metrics port (the Prometheus scrape convention); overrides the spec's."""

WorkloadRef = tuple[str, str]  # (kind, name)


def workload_pod_pattern(kind: str, name: str) -> str:
    """A regex of the names of a workload's pods: `<name>-<replicaset hash>-<suffix>` for a
    Deployment, `<name>-<ordinal>` for a StatefulSet (so `decode` never matches `decode-b`'s).
    Object names are DNS subdomains: `.` is the only regex metacharacter they can hold."""
    escaped = name.replace(".", r"\.")
    return f"{escaped}-[0-9]+" if kind == "StatefulSet" else f"{escaped}-[a-z0-9]+-[a-z0-9]+"


def pod_matchers(namespace: str, workloads: Sequence[WorkloadRef], *, pod_label: str = "pod",
                 namespace_label: str = "namespace") -> str:
    """PromQL label matchers for the pods of `workloads` in `namespace` (a PromQL string
    literal: the regex's backslashes doubled)."""
    pattern = "|".join(workload_pod_pattern(kind, name) for kind, name in workloads).replace("\\", "\\\\")
    return f'{namespace_label}="{namespace}",{pod_label}=~"{pattern}"'


def arm_scrape_endpoints(pods: Sequence[Mapping[str, Any]], selectors: Mapping[Arm, Sequence[Mapping[str, Any]]],
                         default_port: int) -> dict[Arm, list[str]]:
    """`ip:port` of each running pod with an IP that an arm's workload selects.

    `selectors` are each arm's workloads' `spec.selector` (matchLabels and matchExpressions);
    a pod's `prometheus.io/port` annotation overrides `default_port`.
    """
    parsed = {arm: [LabelSelector.model_validate(s) for s in found] for arm, found in selectors.items()}
    endpoints: dict[Arm, list[str]] = {arm: [] for arm in Arm}
    for pod in pods:
        metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
        labels = metadata.get("labels") or {}
        ip = status.get("podIP")
        if status.get("phase") != "Running" or not ip:
            continue
        port = (metadata.get("annotations") or {}).get(PORT_ANNOTATION) or default_port
        for arm, arm_selectors in parsed.items():
            if any(selector.matches(labels) for selector in arm_selectors):
                endpoints[arm].append(f"{ip}:{port}")
                break
    # Two pods on one address (host networking, or all pods on one machine) are one endpoint:
    # scraping it twice would count its series twice.
    return {arm: sorted(set(found)) for arm, found in endpoints.items()}
