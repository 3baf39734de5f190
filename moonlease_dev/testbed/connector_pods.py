"""Running connectors for the pods of the local API server: what the operator verifies.

Test-bed component (real parts, no vLLM): for every pod whose container mounts a
connector-settings ConfigMap *and* whose command line, read as the kubelet runs it (`sh -c`
scripts included, `core.command_line`), starts vLLM with our connector and names the settings
file, `ConnectorPods` plays the kubelet — it keeps a ConfigMap-shaped directory
(`ConfigMapVolume`: timestamped directory, atomic `..data` symlink swap) in step with the
ConfigMap's data — and runs the connector's own `SettingsWatcher` and `SettingsExporter` on that
file, serving the settings endpoint on `host` (loopback unless an operator in a container must
reach it). The pod is annotated with the endpoint's port (`moonlease.io/settings-metrics-port`),
since every simulated pod shares one IP (the simulator's `pod_ip`, which must equal `host`).

`freeze(workload)` stops the kubelet's updates for a workload's pods (their connectors keep
reporting the settings they have): a fleet where a change never takes effect.

Event-driven, as the kubelet is: after a first pass over every pod, a pass looks only at the
pods written since (and at the pods mounting a ConfigMap written since), so that a fleet of
5,000 pods of which a hundred mount settings costs nothing at rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moonlease_dev.testbed.kube import CONFIGMAPS, PODS, LocalApiServer, ResourceType
from moonlease_dev.testbed.kube.simulator import workload_of
from moonlease_connector.adapters.settings_watcher import LiveSettings, SettingsExporter, SettingsWatcher
from moonlease_settings.config import ConnectorConfigError, MoonleaseConnectorConfig
from moonlease_connector.core.capabilities import StoreCapabilities
from moonlease_connector.core.live_settings import ActiveSettings, SettingsSource
from moonlease_settings.settings_file import SETTINGS_FILE_NAME
from moonlease_operator.core.connector_delivery import (
    SETTINGS_PORT_ANNOTATION,
    SETTINGS_VOLUME,
    loads_our_settings,
    startup_sources,
)
from moonlease_operator.core.workload_args import EXTRA_CONFIG_KEY

#: The Mooncake client the simulated pods run: 0.3.14, every lease mode available.
POD_CLIENT = StoreCapabilities("0.3.14", True, ("none", "LastHitOnly"))


def _connector_container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The container that mounts the settings volume (empty: none does)."""
    return next((c for c in (pod.get("spec") or {}).get("containers") or []
                 if any(m.get("name") == SETTINGS_VOLUME for m in c.get("volumeMounts") or [])), {})


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
        while target.exists():  # the directory of an earlier pod of the same name
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
    namespace: str | None = None
    uid: str = ""  # the pod object this connector runs in (a re-created pod gets a new one)
    owner: str = ""
    config_map: str = ""
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
    _dirty: set[tuple[str | None, str]] = field(default_factory=set)  # pods (namespace, name) to look at
    _scan_all: bool = True  # the first pass looks at every pod
    _listening: bool = False

    def __post_init__(self) -> None:
        self.kube.emulator.add_write_listener(self._on_write)
        self._listening = True

    def _on_write(self, rtype: ResourceType, event_type: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        namespace = meta.get("namespace")
        if self.namespace is not None and namespace != self.namespace:
            return
        if rtype == PODS:
            self._dirty.add((namespace, meta.get("name", "")))
        elif rtype == CONFIGMAPS:
            self._dirty.update((state.namespace, pod) for pod, state in self._pods.items()
                               if state.namespace == namespace and state.config_map == meta.get("name"))

    def freeze(self, workload: str) -> None:
        """The kubelet stops updating the settings files of this workload's pods."""
        self.frozen.add(workload)

    def thaw(self, workload: str) -> None:
        self.frozen.discard(workload)
        self._dirty.update((state.namespace, pod) for pod, state in self._pods.items() if state.owner == workload)

    def endpoint(self, pod: str) -> str:
        return f"{self.host}:{self._pods[pod].port}"

    async def sync(self) -> None:
        """One pass: start connectors for new pods, update files, stop those of gone pods —
        over every pod the first time, then over the pods written since (see module doc)."""
        if self._scan_all:
            self._scan_all = False
            self._dirty.update(self.kube.emulator.live_names(PODS, self.namespace))
            self._dirty.update((state.namespace, pod) for pod, state in self._pods.items())
        work, self._dirty = sorted(self._dirty, key=lambda key: (key[0] or "", key[1])), set()
        for index, (namespace, name) in enumerate(work):
            try:
                await self._sync_pod(namespace, name)
            except BaseException:
                self._dirty.update(work[index:])  # the next pass tries again
                raise

    async def _sync_pod(self, namespace: str | None, name: str) -> None:
        pod = self.kube.emulator.stored_object(PODS, namespace, name)  # read-only: most pods mount nothing
        volume = next((v for v in ((pod or {}).get("spec") or {}).get("volumes") or []
                       if v.get("name") == SETTINGS_VOLUME), None)
        if pod is None or volume is None or not loads_our_settings(_connector_container(pod)):
            state = self._pods.get(name)
            if state is not None and state.namespace == namespace:
                self._stop(self._pods.pop(name))
            return
        config_map_name = (volume.get("configMap") or {}).get("name", "")
        config_map = self.kube.emulator.stored_object(CONFIGMAPS, namespace, config_map_name)
        text = ((config_map or {}).get("data") or {}).get(SETTINGS_FILE_NAME)
        state = self._pods.get(name)
        uid = str(pod["metadata"].get("uid", ""))
        if state is not None and state.uid != uid:  # deleted and created again: a new container
            self._stop(self._pods.pop(name))
            state = None
        if state is None:
            state = self._start(name, pod, text)
            state.uid = uid
        state.namespace = namespace
        state.owner = workload_of(self.kube.emulator, pod)
        state.config_map = config_map_name
        if text is not None and text != state.written and (state.owner not in self.frozen or state.written is None):
            state.volume.write(text)
            state.written = text
        if not state.annotated:
            await self.kube.patch(PODS, namespace, name,
                                  {"metadata": {"annotations": {SETTINGS_PORT_ANNOTATION: str(state.port)}}})
            state.annotated = True

    @property
    def idle(self) -> bool:
        """No pod or ConfigMap written since the last pass."""
        return not (self._scan_all or self._dirty)

    def _start(self, name: str, pod: Mapping[str, Any], text: str | None) -> _Pod:
        """Start a pod's connector; `text`, the settings file its ConfigMap holds now, is in its
        volume before the connector starts (a kubelet mounts the volume before the container
        runs), so the connector starts on it rather than switching to it a poll later."""
        doc, env = startup_sources(_connector_container(pod))
        extra = doc.get(EXTRA_CONFIG_KEY) or {}
        try:
            defaults = MoonleaseConnectorConfig.from_sources(extra, env)
        except ConnectorConfigError:
            defaults = MoonleaseConnectorConfig()
        volume = ConfigMapVolume(self.root / name)
        if text is not None:
            volume.write(text)
        live = LiveSettings(ActiveSettings(defaults, SettingsSource.STARTUP))
        exporter = SettingsExporter()
        exporter.show(live.current())
        port = exporter.serve(0, self.host)
        watcher = SettingsWatcher(volume.path, live, defaults=defaults, capabilities=POD_CLIENT,
                                  layout_problem=lambda mode: None, exporter=exporter,
                                  poll_interval_s=self.interval)
        watcher.start()
        state = _Pod(volume, exporter, watcher, port, written=text)
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
        if self._listening:
            self.kube.emulator.remove_write_listener(self._on_write)
            self._listening = False
