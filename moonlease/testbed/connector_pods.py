"""Running connectors for the pods of the local API server: what the operator verifies.

Test-bed component (real parts, no vLLM): for every pod that mounts a connector-settings
ConfigMap, `ConnectorPods` plays the kubelet — it keeps a ConfigMap-shaped directory
(`ConfigMapVolume`: timestamped directory, atomic `..data` symlink swap) in step with the
ConfigMap's data — and runs the connector's own `SettingsWatcher` and `SettingsExporter` on that
file, serving the settings endpoint on `host` (loopback unless an operator in a container must
reach it). The pod is annotated with the endpoint's port (`moonlease.io/settings-metrics-port`),
since every simulated pod shares one IP (the simulator's `pod_ip`, which must equal `host`).

`freeze(workload)` stops the kubelet's updates for a workload's pods (their connectors keep
reporting the settings they have): a fleet where a change never takes effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moonlease.testbed.kube import CONFIGMAPS, PODS, LocalApiServer
from moonlease_connector.adapters.settings_watcher import LiveSettings, SettingsExporter, SettingsWatcher
from moonlease_connector.config import ConnectorConfigError, MoonleaseConnectorConfig
from moonlease_connector.core.capabilities import StoreCapabilities
from moonlease_connector.core.live_settings import ActiveSettings, SettingsSource
from moonlease_connector.settings import SETTINGS_FILE_NAME
from moonlease_operator.core.connector_delivery import SETTINGS_PORT_ANNOTATION, SETTINGS_VOLUME
from moonlease_operator.core.workload_args import EXTRA_CONFIG_KEY, kv_doc

#: The Mooncake client the simulated pods run: 0.3.14, every lease mode available.
POD_CLIENT = StoreCapabilities("0.3.14", True, ("none", "LastHitOnly"))


class ConfigMapVolume:
    """A directory laid out as the kubelet lays out a ConfigMap volume, updated the same way."""

    def __init__(self, root: Path, key: str = SETTINGS_FILE_NAME) -> None:
        self.root = root
        self.key = key
        self.version = 0
        root.mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> str:
        return str(self.root / self.key)

    def write(self, text: str) -> None:
        self.version += 1
        target = self.root / f"..2026_{os.getpid()}_{self.version:04d}"
        target.mkdir()
        (target / self.key).write_text(text)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(target.name)
        os.replace(tmp, self.root / "..data")
        link = self.root / self.key
        if not link.is_symlink():
            link.symlink_to(f"..data/{self.key}")


@dataclass
class _Pod:
    volume: ConfigMapVolume
    exporter: SettingsExporter
    watcher: SettingsWatcher
    port: int
    written: str | None = None
    annotated: bool = False


@dataclass
class ConnectorPods:
    kube: LocalApiServer
    root: Path
    namespace: str | None = None  # None: every namespace
    interval: float = 0.05
    host: str = "127.0.0.1"  # where the endpoints listen: the simulated pods' status.podIP
    frozen: set[str] = field(default_factory=set)
    _pods: dict[str, _Pod] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    def freeze(self, workload: str) -> None:
        """The kubelet stops updating the settings files of this workload's pods."""
        self.frozen.add(workload)

    def thaw(self, workload: str) -> None:
        self.frozen.discard(workload)

    def endpoint(self, pod: str) -> str:
        return f"{self.host}:{self._pods[pod].port}"

    async def sync(self) -> None:
        """One pass: start connectors for new pods, update files, stop those of gone pods."""
        seen = set()
        for pod in self.kube.list(PODS, self.namespace):
            volume = next((v for v in (pod.get("spec") or {}).get("volumes") or []
                           if v.get("name") == SETTINGS_VOLUME), None)
            if volume is None:
                continue
            name, namespace = pod["metadata"]["name"], pod["metadata"].get("namespace")
            seen.add(name)
            state = self._pods.get(name) or self._start(name, pod)
            owner = next((o["name"] for o in pod["metadata"].get("ownerReferences") or []), "")
            config_map = self.kube.get(CONFIGMAPS, namespace, (volume.get("configMap") or {}).get("name", ""))
            text = ((config_map or {}).get("data") or {}).get(SETTINGS_FILE_NAME)
            if text is not None and text != state.written and (owner not in self.frozen or state.written is None):
                state.volume.write(text)
                state.written = text
            if not state.annotated:
                await self.kube.patch(PODS, namespace, name,
                                      {"metadata": {"annotations": {SETTINGS_PORT_ANNOTATION: str(state.port)}}})
                state.annotated = True
        for name in set(self._pods) - seen:
            self._stop(self._pods.pop(name))

    def _start(self, name: str, pod: dict[str, Any]) -> _Pod:
        container = next((c for c in (pod.get("spec") or {}).get("containers") or []
                          if any(m.get("name") == SETTINGS_VOLUME for m in c.get("volumeMounts") or [])), {})
        extra = (kv_doc(container) or {}).get(EXTRA_CONFIG_KEY) or {}
        env = {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}
        try:
            defaults = MoonleaseConnectorConfig.from_sources(extra, env)
        except ConnectorConfigError:
            defaults = MoonleaseConnectorConfig()
        volume = ConfigMapVolume(self.root / name)
        live = LiveSettings(ActiveSettings(defaults, SettingsSource.STARTUP))
        exporter = SettingsExporter()
        exporter.show(live.current())
        port = exporter.serve(0, self.host)
        watcher = SettingsWatcher(volume.path, live, defaults=defaults, capabilities=POD_CLIENT,
                                  layout_problem=lambda mode: None, exporter=exporter,
                                  poll_interval_s=self.interval)
        watcher.start()
        state = _Pod(volume, exporter, watcher, port)
        self._pods[name] = state
        return state

    @staticmethod
    def _stop(state: _Pod) -> None:
        state.watcher.stop()
        state.exporter.close()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a pod deleted mid-pass: the next pass sees it
                await self.sync()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for state in self._pods.values():
            self._stop(state)
        self._pods.clear()
