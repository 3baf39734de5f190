"""Operator tuning, passed in explicitly (never read at import time). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from moonlease_operator.core.conflicts import ConflictSettings


@dataclass(frozen=True)
class OperatorOptions:
    """How often and how hard the operator works.

    `reconcile_interval`: seconds between two reconciles of one policy while one of its stages is
    verified (what the pods' connectors report is read over HTTP, which no watch announces).
    `resync_interval`: seconds between two reconciles of a policy otherwise — a safety net: a
    change of the policy, of a workload it covers, of their settings ConfigMaps or (while
    verifying) of a pod wakes it at once, and a reconcile reads the operator's watch caches, not
    the API server. `error_delay`: seconds to wait after a reconcile failed.
    `write_concurrency`: workload patches in flight at once. `api_retries`/`api_backoff`: retries
    of 429/5xx answers and their first delay (doubling). `api_timeout`: per request.
    `prometheus_url_allowlist`: the Prometheus servers an A/B test may read (`core.url_allowlist`);
    empty: none (A/B tests then scrape the pods). `listed_targets`: how many workloads that need
    attention a policy's status lists (`core.target_summary`; all are counted).
    `conflict_reverts`/`conflict_backoff`: after that many reverts in a row of a field the
    operator wrote, by another writer, it leaves the object alone for that many seconds (doubling
    each time, `core.conflicts`); 0 reverts: never back off.
    """

    reconcile_interval: float = 5.0
    resync_interval: float = 300.0
    error_delay: float = 5.0
    write_concurrency: int = 8
    api_retries: int = 4
    api_backoff: float = 0.2
    api_timeout: float = 30.0
    prometheus_url_allowlist: tuple[str, ...] = ()
    listed_targets: int = 20
    conflict_reverts: int = 3
    conflict_backoff: float = 300.0

    def __post_init__(self) -> None:
        """Refuse settings the operator cannot run with, naming the flag to fix."""
        for flag, value in (("--reconcile-interval", self.reconcile_interval),
                            ("--resync-interval", self.resync_interval)):
            if not value > 0:
                raise ValueError(f"{flag} must be a positive number of seconds, not {value}")
        self.conflicts  # noqa: B018 - refuses bad --conflict-reverts / --conflict-backoff
        if self.listed_targets < 0:
            raise ValueError(f"--listed-targets must be 0 or more, not {self.listed_targets}")

    @property
    def conflicts(self) -> ConflictSettings:
        """When to back off from another writer that keeps reverting the operator's changes."""
        return ConflictSettings(reverts=self.conflict_reverts, backoff_seconds=self.conflict_backoff)
