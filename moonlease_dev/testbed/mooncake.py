"""A real Mooncake store on loopback: master, store pool and clients, for tests and the demo.

The topology is the one users run (NOTES §2): a `mooncake_master`, a separate store-pool process
(`mooncake_client`) that owns the memory segment, and engines/clients that bring no segment of
their own (`standalone-store`), so stored KV outlives any one engine.

Two Mooncake releases are supported: 0.3.14 (the CUDA 13 wheel made to load on CPU, see
`moonlease_dev.devenv`), in this interpreter; and 0.3.13.post1 (no `batch_probe_key`) in its own
virtualenv, reached through a small subprocess proxy because both ship the `mooncake` package.
"""

from __future__ import annotations

import base64
import builtins
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moonlease_dev import devenv
from moonlease_dev.testbed.processes import ManagedProcess, ManagedServer, ServerStartError, free_port, http_get

CURRENT_VERSION = "0.3.14"
OLD_VERSION = "0.3.13"
# Note: the master and our servers bind 127.0.0.1; the transfer engine inside clients and pools
# also opens listeners on all interfaces (no flag or MC_* variable in 0.3.14 changes that), but
# every address we hand it is loopback, so no traffic leaves the machine.


@dataclass(frozen=True)
class MooncakeInstall:
    """Where one Mooncake release lives: its interpreter and its bundled binaries."""

    version: str
    python: Path

    def binary(self, name: str) -> Path:
        site = subprocess.run(
            [str(self.python), "-c", "import mooncake, os; print(os.path.dirname(mooncake.__file__))"],
            check=True, capture_output=True, text=True, env=self.env()).stdout.strip()
        path = Path(site) / name
        if not path.exists():
            raise FileNotFoundError(f"{name} not found in the Mooncake {self.version} install at "
                                    f"{site}; run `make setup`")
        return path

    def env(self) -> dict[str, str]:
        return devenv.library_path_env()


def install_for(version: str) -> MooncakeInstall:
    if version.startswith(CURRENT_VERSION):
        return MooncakeInstall(CURRENT_VERSION, Path(sys.executable))
    if version.startswith(OLD_VERSION):
        python = devenv.old_mooncake_python()
        if not python.exists():
            raise FileNotFoundError(f"Mooncake {OLD_VERSION} virtualenv missing at {python}; "
                                    "run `make setup`")
        return MooncakeInstall(OLD_VERSION, python)
    raise ValueError(f"unsupported Mooncake version {version!r}: use {CURRENT_VERSION} or {OLD_VERSION}")


@dataclass(frozen=True)
class MasterSettings:
    """The master flags a test or the demo chooses, under Mooncake's own flag names.

    `None` leaves the master's own default in force.
    """

    eviction_high_watermark_ratio: float | None = None
    eviction_ratio: float | None = None
    default_kv_lease_ttl: int | None = None  # milliseconds
    default_kv_soft_pin_ttl: int | None = None  # milliseconds
    allow_evict_soft_pinned_objects: bool | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def flags(self) -> list[str]:
        values: dict[str, Any] = {
            "eviction_high_watermark_ratio": self.eviction_high_watermark_ratio,
            "eviction_ratio": self.eviction_ratio,
            "default_kv_lease_ttl": self.default_kv_lease_ttl,
            "default_kv_soft_pin_ttl": self.default_kv_soft_pin_ttl,
            "allow_evict_soft_pinned_objects": self.allow_evict_soft_pinned_objects,
            **self.extra,
        }
        rendered = []
        for name, value in values.items():
            if value is None:
                continue
            if isinstance(value, bool):
                value = "true" if value else "false"
            rendered.append(f"--{name}={value}")
        return rendered


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {sample name as exposed, with its label set: value}.

    Names stay exactly as the server wrote them (prometheus_client's parser would append
    `_total` to Mooncake's counters, which Prometheus itself does not).
    """
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            name, labels, value = match.groups()
            samples[name + (labels or "")] = float(value)
    return samples


class MooncakeMaster(ManagedServer):
    """A real `mooncake_master` on free loopback ports."""

    def __init__(self, settings: MasterSettings | None = None, *, version: str = CURRENT_VERSION,
                 log_dir: Path | None = None) -> None:
        self.settings = settings or MasterSettings()
        self.install = install_for(version)
        self.rpc_port = free_port()
        self.metrics_port = free_port()
        argv = [str(self.install.binary("mooncake_master")),
                "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}",
                "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
                *self.settings.flags()]
        self.process = ManagedProcess(f"mooncake_master-{self.rpc_port}", argv,
                                      ready=self._healthy, env=self.install.env(), log_dir=log_dir)

    @property
    def version(self) -> str:
        return self.install.version

    @property
    def rpc_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def _healthy(self) -> bool:
        status, _ = http_get(f"http://127.0.0.1:{self.metrics_port}/health", timeout=0.5)
        return status == 200

    def metrics(self) -> dict[str, float]:
        status, body = http_get(self.metrics_url)
        if status != 200:
            raise ConnectionError(f"master metrics at {self.metrics_url} answered {status}: {body}")
        return parse_metrics(body)


class StorePool(ManagedServer):
    """A `mooncake_client` process that mounts a memory segment: where stored KV lives."""

    def __init__(self, master: MooncakeMaster, *, segment_bytes: int = 256 << 20,
                 local_buffer_bytes: int = 16 << 20, log_dir: Path | None = None,
                 ready_timeout: float = 30.0) -> None:
        self.master = master
        self.segment_bytes = segment_bytes
        self.port = free_port()
        argv = [str(master.install.binary("mooncake_client")),
                "--host=127.0.0.1", f"--master_server_address={master.rpc_address}",
                "--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
                f"--global_segment_size={segment_bytes}", f"--local_buffer_size={local_buffer_bytes}",
                f"--port={self.port}"]
        self._capacity_before = 0.0
        self.process = ManagedProcess(f"mooncake_store_pool-{self.port}", argv,
                                      ready=self._mounted, env=master.install.env(),
                                      log_dir=log_dir or master.process.log_path.parent,
                                      ready_timeout=ready_timeout)

    def _capacity(self) -> float:
        return self.master.metrics().get("master_total_capacity_bytes", 0.0)

    def _mounted(self) -> bool:
        """Ready once the master counts this pool's segment in its capacity."""
        return self._capacity() >= self._capacity_before + self.segment_bytes

    def start(self) -> StorePool:
        if not self.master.process.running:
            raise ServerStartError("start the master before the store pool")
        self._capacity_before = self._capacity()
        return super().start()


def engine_store_config(master: MooncakeMaster, *, local_buffer_bytes: int = 64 << 20) -> dict[str, Any]:
    """The MOONCAKE_CONFIG_PATH JSON for a vLLM engine that brings no segment of its own."""
    return {
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": master.rpc_address,
        "protocol": "tcp",
        "device_name": "",
        "mode": "standalone-store",
        "global_segment_size": 0,
        "local_buffer_size": local_buffer_bytes,
    }


def write_engine_store_config(master: MooncakeMaster, path: Path, **kwargs: Any) -> Path:
    path.write_text(json.dumps(engine_store_config(master, **kwargs), indent=2))
    return path


def connect_store_client(master: MooncakeMaster, *, segment_bytes: int = 0,
                         local_buffer_bytes: int = 16 << 20) -> Any:
    """A 0.3.14 `MooncakeDistributedStore` in this process (TCP, P2PHANDSHAKE).

    With `segment_bytes=0` it is a pure client: data lives in a `StorePool`.
    """
    devenv.preload()
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, local_buffer_bytes, "tcp", "",
                       master.rpc_address)
    if code != 0:
        raise ConnectionError(f"MooncakeDistributedStore.setup to {master.rpc_address} returned {code}")
    return store


class StoreClientProxy:
    """A `MooncakeDistributedStore` living in another interpreter (another Mooncake release).

    Method calls travel as JSON lines; bytes as base64. Remote exceptions are re-raised here
    with their type name when it is a builtin (so a missing method is an `AttributeError`).
    """

    def __init__(self, install: MooncakeInstall, master: MooncakeMaster, *, segment_bytes: int = 0,
                 local_buffer_bytes: int = 16 << 20) -> None:
        self.version = install.version
        self._methods: frozenset[str] = frozenset()
        self.log_path = master.process.log_path.parent / f"store-proxy-{install.version}.log"
        with self.log_path.open("ab") as log:
            # -P: the script's folder holds our mooncake.py, which must not shadow the package.
            self._process = subprocess.Popen(
                [str(install.python), "-P", str(Path(__file__).with_name("store_proxy.py"))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                env=install.env(), text=True)
        self._methods = frozenset(self._call("__dir__"))
        code = self._call("setup", "127.0.0.1", "P2PHANDSHAKE", segment_bytes, local_buffer_bytes,
                          "tcp", "", master.rpc_address)
        if code != 0:
            self.shutdown()
            raise ConnectionError(f"Mooncake {self.version} setup to {master.rpc_address} returned {code}")

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        assert self._process.stdin is not None and self._process.stdout is not None
        request = {"method": method, "args": [_encode(a) for a in args],
                   "kwargs": {k: _encode(v) for k, v in kwargs.items()}}
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            raise ConnectionError(f"Mooncake {self.version} proxy exited (code {self._process.poll()}); "
                                  f"see {self.log_path}")
        reply = json.loads(line)
        if "error" in reply:
            error_type = getattr(builtins, reply["error"]["type"], RuntimeError)
            if not (isinstance(error_type, type) and issubclass(error_type, Exception)):
                error_type = RuntimeError
            raise error_type(f"[Mooncake {self.version}] {reply['error']['message']}")
        return _decode(reply["result"])

    def __getattr__(self, method: str) -> Any:
        """Only the methods the remote release has, so feature detection sees the truth."""
        if method.startswith("_") or method not in self._methods:
            raise AttributeError(f"Mooncake {self.version} MooncakeDistributedStore has no {method!r}")
        return lambda *args, **kwargs: self._call(method, *args, **kwargs)

    def shutdown(self) -> None:
        if self._process.poll() is None:
            try:
                self._call("close")
            except (ConnectionError, RuntimeError, BrokenPipeError):
                pass
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()


def _encode(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "__bytes__" in value:
        return base64.b64decode(value["__bytes__"])
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value
