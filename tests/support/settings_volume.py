"""A ConfigMap volume on local disk, and a reader of the connector's settings endpoint.

`ConfigMapVolume` (from the testbed) lays files out as the kubelet does and updates them the
same way. `read_settings_endpoint` scrapes the connector's own settings metrics (HTTP, Prometheus text).
"""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from moonlease_dev.testbed.connector_pods import ConfigMapVolume
from moonlease_dev.testbed.processes import free_port

__all__ = ["ConfigMapVolume", "EndpointSettings", "free_port", "read_settings_endpoint", "scrape",
           "wait_for_endpoint"]

Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(port: int, host: str = "127.0.0.1") -> Samples:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


@dataclass(frozen=True)
class EndpointSettings:
    """What the connector's endpoint says it runs, and the last file it refused (if any)."""

    settings_hash: str
    lease_mode: str
    junction_retention: str
    refused_hash: str | None
    refused_reason: str | None


def read_settings_endpoint(port: int) -> EndpointSettings:
    samples = scrape(port)
    (info, _), = [s for s in samples["moonlease_connector_settings_info"] if s[1] == 1]
    refused = [labels for labels, value in samples.get("moonlease_connector_settings_refused_info", [])
               if value == 1]
    return EndpointSettings(info["settings_hash"], info["lease_mode"], info["junction_retention"],
                            refused[0]["settings_hash"] if refused else None,
                            refused[0]["reason"] if refused else None)


def wait_for_endpoint(port: int, predicate, timeout_s: float = 60.0) -> EndpointSettings:
    """Poll the endpoint until `predicate(settings)` holds (generous: a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    last: EndpointSettings | None = None
    while True:
        try:
            last = read_settings_endpoint(port)
            if predicate(last):
                return last
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"the connector's settings endpoint never matched; last: {last}")
        time.sleep(0.1)


