"""Live settings: watch the settings file, swap the connector's settings, export what runs.

I/O adapter without vLLM (the operator's tests serve pods' endpoints with it on loopback).

- `LiveSettings` holds the `ActiveSettings` a connector runs; readers take one snapshot per
  lookup (`current()`), the watcher replaces it whole, so a lookup never mixes two versions.
- `SettingsWatcher` polls the file (default every second, on a daemon thread). Kubernetes
  updates a ConfigMap volume by swapping its `..data` symlink, so the watcher compares the
  resolved file's identity (device, inode, size, mtime) and then its content; each new content
  goes to `core.live_settings.decide_switch`, which applies or refuses it.
- `SettingsExporter` serves what runs as Prometheus metrics on the connector's own port
  (vLLM's /metrics only changes on an engine step, so an idle engine could never confirm a
  switch there): `moonlease_connector_settings_info{lease_mode, junction_retention,
  settings_hash, source}` (1), `moonlease_connector_settings_refused_info{settings_hash,
  reason}` (1 for the last refused file, gone once a file is applied),
  `moonlease_connector_settings_refusals_total{reason}` and
  `moonlease_connector_settings_switches_total`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from moonlease_settings.config import MoonleaseConnectorConfig
from moonlease_connector.core.capabilities import StoreCapabilities
from moonlease_connector.core.live_settings import (
    ActiveSettings,
    LayoutCheck,
    RefusalReason,
    SwitchDecision,
    decide_switch,
    refuse,
)
from moonlease_settings.settings_file import (
    SETTINGS_INFO_METRIC,
    SETTINGS_REFUSALS_METRIC,
    SETTINGS_REFUSED_METRIC,
    SETTINGS_SWITCHES_METRIC,
)

logger = logging.getLogger("vllm.moonlease.connector.settings")


class LiveSettings:
    """The settings a connector runs, replaced whole by the watcher."""

    def __init__(self, active: ActiveSettings) -> None:
        self._active = active

    def current(self) -> ActiveSettings:
        return self._active  # one reference read: a consistent snapshot

    def replace(self, active: ActiveSettings) -> None:
        self._active = active


class SettingsExporter:
    """Prometheus families saying what the connector runs, on a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._info = Gauge(SETTINGS_INFO_METRIC,
                           "Connector settings in use (value 1): lease mode, junction retention, "
                           "settings hash and source (startup or file).",
                           ["lease_mode", "junction_retention", "settings_hash", "source"],
                           registry=self.registry)
        self._refused = Gauge(SETTINGS_REFUSED_METRIC,
                              "The last settings file refused since the last switch (value 1).",
                              ["settings_hash", "reason"], registry=self.registry)
        self._refusals = Counter(SETTINGS_REFUSALS_METRIC.removesuffix("_total"),
                                 "Settings files the connector refused, by reason.", ["reason"],
                                 registry=self.registry)
        self._switches = Counter(SETTINGS_SWITCHES_METRIC.removesuffix("_total"),
                                 "Settings switches the connector applied from its settings file.",
                                 registry=self.registry)
        for reason in RefusalReason:
            self._refusals.labels(reason.value)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def show(self, active: ActiveSettings) -> None:
        self._info.clear()
        self._info.labels(active.config.lease_mode.value,
                          str(active.config.mooncake_junction_retention).lower(),
                          active.hash, active.source.value).set(1)

    def record(self, decision: SwitchDecision) -> None:
        if decision.refusal is not None:
            self._refusals.labels(decision.refusal.value).inc()
            self._refused.clear()
            self._refused.labels(decision.refused_hash or "", decision.refusal.value).set(1)
            return
        if decision.switched:
            self._switches.inc()
        self._refused.clear()
        self.show(decision.active)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics on `port` (0: any free port); returns the bound port."""
        self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@dataclass(frozen=True)
class _FileVersion:
    identity: tuple[int, int, int, int]
    text: str


class SettingsWatcher:
    """Reads the settings file when it changes and applies or refuses what it says."""

    def __init__(self, path: str, live: LiveSettings, *, defaults: MoonleaseConnectorConfig,
                 capabilities: StoreCapabilities, layout_problem: LayoutCheck,
                 exporter: SettingsExporter | None = None,
                 on_decision: Callable[[SwitchDecision], None] | None = None,
                 poll_interval_s: float = 1.0) -> None:
        self.path = path
        self.live = live
        self.defaults = defaults
        self.capabilities = capabilities
        self.layout_problem = layout_problem
        self.exporter = exporter
        self.on_decision = on_decision
        self.poll_interval_s = poll_interval_s
        self._seen: _FileVersion | None = None
        self._unreadable: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> SwitchDecision | None:
        """Read the file if it changed; the decision taken, or None when nothing changed."""
        with self._lock:
            try:
                stat = os.stat(self.path)  # follows the ..data symlink of a ConfigMap volume
                identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
                if self._seen is not None and self._seen.identity == identity:
                    return None
                with open(self.path, encoding="utf-8") as handle:
                    text = handle.read()
            except OSError as error:
                message = f"cannot read {self.path}: {error.strerror or error}"
                if message == self._unreadable:
                    return None
                self._unreadable = message
                self._seen = None
                return self._decided(refuse(self.live.current(), RefusalReason.UNREADABLE, message))
            self._unreadable = None
            previous, self._seen = self._seen, _FileVersion(identity, text)
            if previous is not None and previous.text == text:
                return None
            decision = decide_switch(self.live.current(), text, defaults=self.defaults,
                                     capabilities=self.capabilities,
                                     layout_problem=self.layout_problem)
            return self._decided(decision)

    def _decided(self, decision: SwitchDecision) -> SwitchDecision:
        if decision.refusal is None:
            self.live.replace(decision.active)
            log = logger.info if decision.switched else logger.debug
            log("Moonlease %s", decision.message)
        else:
            logger.warning("Moonlease %s", decision.message)
        if self.exporter is not None:
            self.exporter.record(decision)
        if self.on_decision is not None:
            self.on_decision(decision)
        return decision

    def start(self) -> None:
        """Apply the file as it is now, then keep watching it on a daemon thread."""
        self.poll_once()
        self._thread = threading.Thread(target=self._run, name="moonlease-settings-watcher",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self.poll_once()
            except Exception:  # the watcher must outlive any surprise; the settings stay
                logger.exception("Moonlease settings watcher: unexpected error; still watching")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
