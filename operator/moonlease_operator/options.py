"""Operator tuning, passed in explicitly (never read at import time). Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorOptions:
    """How often and how hard the operator works.

    `reconcile_interval`: seconds between two reconciles of one policy when nothing wakes it
    earlier (any change of the policy — spec, approval annotation — wakes it at once; workload
    progress is noticed at this pace). `error_delay`: seconds to wait after a reconcile failed.
    `write_concurrency`: workload patches in flight at once. `api_retries`/`api_backoff`: retries
    of 429/5xx answers and their first delay (doubling). `api_timeout`: per request.
    `prometheus_url_allowlist`: the Prometheus servers an A/B test may read (`core.url_allowlist`);
    empty: none (A/B tests then scrape the pods).
    """

    reconcile_interval: float = 5.0
    error_delay: float = 5.0
    write_concurrency: int = 8
    api_retries: int = 4
    api_backoff: float = 0.2
    api_timeout: float = 30.0
    prometheus_url_allowlist: tuple[str, ...] = ()
