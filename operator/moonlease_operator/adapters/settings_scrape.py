"""Read what the vLLM pods' connectors run: their settings endpoints, over HTTP. Not pure.

The pods given are scraped — the caller chooses them by the planner's own rule
(`core.connector_delivery.pods_to_contact`: the pods that must report) — at their pod IP and settings
port (`core.connector_delivery.settings_endpoint`), in worker threads, all at once; an endpoint
that does not answer is a report with an error (the planner keeps the stage waiting), never an
exception.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from moonlease_operator.core.connector_delivery import (
    SettingsReport,
    read_settings_report,
    settings_endpoint,
)


def scrape_settings(endpoint: str, timeout: float = 2.0) -> SettingsReport:
    """One pod's report (blocking)."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=timeout) as response:  # noqa: S310
            text = response.read().decode("utf-8")
        samples = [(sample.name, dict(sample.labels), float(sample.value))
                   for family in text_string_to_metric_families(text) for sample in family.samples]
    except (OSError, ValueError) as exc:  # refused, timeout, HTTP error, not Prometheus text
        return SettingsReport(error=f"{endpoint}: {type(exc).__name__}: {exc}")
    return read_settings_report(samples)


async def fetch_settings_reports(pods: Sequence[Mapping[str, Any]], *,
                                 timeout: float = 2.0) -> dict[str, SettingsReport]:
    """Pod name -> report, for every pod given."""
    targets = {str(pod["metadata"]["name"]): settings_endpoint(pod) for pod in pods}
    names = list(targets)

    async def one(name: str) -> SettingsReport:
        endpoint = targets[name]
        if endpoint is None:
            return SettingsReport(error="the pod has no IP or settings port yet")
        return await asyncio.to_thread(scrape_settings, endpoint, timeout)

    reports = await asyncio.gather(*(one(name) for name in names))
    return dict(zip(names, reports, strict=True))
