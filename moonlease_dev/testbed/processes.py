"""Local server processes for the test bed and the demo: start, wait until ready, stop by PID.

Every server binds 127.0.0.1 on a port the OS picked; its output goes to a log file whose tail
is quoted when it fails to start, so a failure says what to check.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self


#: Where `free_port` looks: above the Mooncake transfer engine's own ports (12xxx-16xxx seen),
#: below the kernel's ephemeral range.
PORT_RANGE = (20000, 32768)


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default 32768-60999)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback TCP port that was free a moment ago, outside the kernel's ephemeral range.

    A port the kernel picks (`bind(("127.0.0.1", 0))`) comes from the range it also hands out as
    the local port of every outgoing connection: a server that binds late — a vLLM engine binds
    its metrics port after a minute of start-up — found it taken by some client's connection
    (`Address already in use`, a CI failure of the demo). Ports below that range are only ever
    taken by a bind, so a random one that binds now stays free unless another server asks for
    exactly it. Falls back to the kernel's pick when the range leaves no room.
    """
    low = PORT_RANGE[0]
    high = min(PORT_RANGE[1], _ephemeral_ports()[0])
    for _ in range(64 if high - low > 1000 else 0):
        port = random.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """GET a URL; (status, body). Connection errors come back as status 0 with the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as error:
        return 0, str(error)


class ServerStartError(RuntimeError):
    """A server exited or never became ready; the message carries its log tail."""


class ManagedProcess:
    """One server process with a readiness probe and a PID-based stop.

    It runs in its own session so stopping it also stops anything it forked.
    """

    def __init__(self, name: str, argv: Sequence[str], *, ready: Callable[[], bool],
                 env: dict[str, str] | None = None, log_dir: Path | None = None,
                 ready_timeout: float = 30.0, cwd: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self._ready = ready
        self._env = env
        self._ready_timeout = ready_timeout
        self._cwd = cwd
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="moonlease-")) / f"{name}.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError(f"{self.name} is not running")
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self._process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=self._env,
                                             cwd=self._cwd, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + self._ready_timeout
        try:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise ServerStartError(f"{self.name} exited with code {self._process.returncode} "
                                           f"before it was ready.\n{self.log_tail()}")
                if self._ready():
                    return self
                time.sleep(0.05)
        except BaseException:
            # Ctrl-C (or a failing probe) while waiting: `with` never reached __exit__, so the
            # half-started process would outlive us.
            self.stop()
            raise
        self.stop()
        raise ServerStartError(f"{self.name} was not ready after {self._ready_timeout:.0f} s.\n"
                               f"{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after `timeout` seconds."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=timeout)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except FileNotFoundError:
            return f"(no log at {self.log_path})"
        return f"--- last lines of {self.log_path} ---\n" + "\n".join(text)

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class ManagedServer:
    """A server the test bed owns through one `ManagedProcess`: start, stop, `with`."""

    process: ManagedProcess

    def start(self) -> Self:
        self.process.start()
        return self

    def stop(self) -> None:
        self.process.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class HealthProbedServer:
    """A loopback HTTP server on `self.port` that is ready once `GET <health_path>` answers 200
    (vLLM's OpenAI server and vllm-router: /health; the fleet order service: /healthz)."""

    port: int
    health_path = "/health"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _ready(self) -> bool:
        status, _ = http_get(self.url + self.health_path, timeout=1.0)
        return status == 200
