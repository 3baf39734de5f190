"""The fleet order service as its own process, as the chart runs it (`python -m moonlease_connector.fleet_order`).

Test bed: binds 127.0.0.1 on a free port; ready once ``GET /healthz`` answers 200.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from moonlease_dev.devenv import source_pythonpath
from moonlease_dev.testbed.processes import HealthProbedServer, ManagedProcess, ManagedServer, free_port, http_get


class FleetOrderProcess(HealthProbedServer, ManagedServer):
    health_path = "/healthz"

    def __init__(self, *, capacity: int | None = None, log_dir: Path | None = None) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "moonlease_connector.fleet_order", "--host=127.0.0.1", f"--port={self.port}",
                "--log-level=WARNING", *([f"--capacity={capacity}"] if capacity is not None else [])]
        env = {**os.environ, "PYTHONPATH": source_pythonpath(then=os.environ.get("PYTHONPATH"))}
        self.process = ManagedProcess(f"fleet-order-{self.port}", argv, ready=self._ready, env=env,
                                      log_dir=log_dir, ready_timeout=20.0)

    def metrics(self) -> str:
        status, body = http_get(self.url + "/metrics")
        if status != 200:
            raise RuntimeError(f"fleet order /metrics answered {status}: {body[:200]}")
        return body
