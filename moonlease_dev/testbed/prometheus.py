"""A real Prometheus server on loopback, scraping the targets a test or the demo gives it.

Uses the Debian `prometheus` binary (`make setup` installs it). Scrapes every second by default
so tests see samples quickly; queried over the HTTP API exactly as the operator's A/B analysis
does in production.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from moonlease_dev.testbed.processes import ManagedProcess, ManagedServer, free_port, http_get


class PrometheusServer(ManagedServer):
    """`prometheus` with static scrape jobs: {job name: ["127.0.0.1:port", ...]}."""

    def __init__(self, jobs: Mapping[str, Sequence[str]], *, scrape_interval: str = "1s",
                 metrics_path: str = "/metrics", workdir: Path | None = None,
                 binary: str | None = None) -> None:
        found = binary or shutil.which("prometheus")
        if found is None:
            raise FileNotFoundError("prometheus not found: run `make setup` (Debian package prometheus)")
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="moonlease-prometheus-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "scrape_configs": [
                {"job_name": job, "metrics_path": metrics_path,
                 "static_configs": [{"targets": list(targets)}]}
                for job, targets in jobs.items()
            ],
        }
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        argv = [found, f"--config.file={config_path}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                "--web.enable-lifecycle", "--log.level=warn"]
        self.process = ManagedProcess(f"prometheus-{self.port}", argv, ready=self._ready,
                                      log_dir=self.workdir)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _ready(self) -> bool:
        return http_get(f"{self.url}/-/ready", timeout=0.5)[0] == 200

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query; the `result` list of the API's vector answer."""
        status, body = http_get(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
        if status != 200:
            raise RuntimeError(f"Prometheus query {promql!r} answered {status}: {body[:500]}")
        payload = json.loads(body)
        return list(payload["data"]["result"])

    def wait_for(self, promql: str, timeout: float = 20.0) -> list[dict[str, Any]]:
        """Poll until the query returns at least one series (scrapes take a moment)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.25)

    def targets_health(self) -> dict[str, str]:
        status, body = http_get(f"{self.url}/api/v1/targets")
        if status != 200:
            raise RuntimeError(f"Prometheus targets answered {status}")
        return {t["scrapeUrl"]: t["health"] for t in json.loads(body)["data"]["activeTargets"]}
