"""Running the project's images with rootful podman for the image smoke tests.

Containers run as the chart runs them: read-only root filesystem, writable scratch only where the
chart mounts an emptyDir (tmpfs here), the image's own user. They share one podman network with
fixed addresses (so a process can be told its peer's address before the peer starts); the host
reaches them at those addresses and they reach the host at the network's gateway. Nothing leaves
the machine.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
IMAGES_SCRIPT = REPO / "tools" / "images.sh"


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ... failed ({result.returncode}): {result.stderr[-2000:]}")
    return result


def image_name(target: str) -> str:
    """The name `make images` gives a target (tools/images.sh decides it)."""
    name = subprocess.run(["bash", str(IMAGES_SCRIPT), "--name", target], capture_output=True, text=True,
                          check=True).stdout.strip()
    # podman stores an unqualified name under localhost/.
    return name if "." in name.split("/")[0] or name.startswith("localhost/") else f"localhost/{name}"


@dataclass
class Network:
    """A podman bridge network on a random 10.x.y.0/24 subnet: `.1` is the host (gateway)."""

    name: str
    prefix: str  # "10.x.y."
    _next: int = 10
    containers: list[str] = field(default_factory=list)

    @property
    def gateway(self) -> str:
        return self.prefix + "1"

    def address(self) -> str:
        """A fresh container address on this network."""
        self._next += 1
        return f"{self.prefix}{self._next}"

    @classmethod
    def create(cls) -> Network:
        for _ in range(20):
            prefix = f"10.{random.randint(100, 250)}.{random.randint(0, 250)}."
            name = f"moonlease-test-{uuid.uuid4().hex[:8]}"
            result = podman("network", "create", "--subnet", prefix + "0/24", "--gateway", prefix + "1", name,
                            check=False)
            if result.returncode == 0:
                return cls(name, prefix)
        raise RuntimeError(f"could not create a podman network: {result.stderr}")

    def bring_up(self, image: str) -> None:
        """Make the host's end of the network (the gateway address) exist: podman creates the
        bridge only when a container joins, so a container that just sleeps holds it up."""
        if any(name.endswith("-holder") for name in self.containers):
            return
        run_detached(self, image, ["infinity"], name="holder", entrypoint="sleep")

    def remove(self) -> None:
        for name in self.containers:
            podman("rm", "--force", "--time", "5", name, check=False)
        podman("network", "rm", "--force", self.name, check=False)


@dataclass
class Container:
    name: str
    address: str

    def logs(self, tail: int = 80) -> str:
        result = podman("logs", "--tail", str(tail), self.name, check=False)
        return result.stdout + result.stderr

    def running(self) -> bool:
        result = podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return result.stdout.strip() == "true"

    def stop(self) -> None:
        podman("stop", "--time", "10", self.name, check=False)

    def inspect(self) -> dict[str, Any]:
        return json.loads(podman("inspect", self.name).stdout)[0]


def run_detached(network: Network, image: str, args: Sequence[str] = (), *, name: str,
                 entrypoint: str | None = None, env: dict[str, str] | None = None,
                 volumes: Sequence[str] = (), tmpfs: Sequence[str] = ("/tmp",),
                 extra: Sequence[str] = ()) -> Container:
    """Start a container as the chart runs it: read-only root, tmpfs scratch, no added privileges."""
    address = network.address()
    full_name = f"{network.name}-{name}"
    argv = ["run", "--detach", "--name", full_name, "--network", network.name, "--ip", address,
            "--read-only", "--security-opt", "no-new-privileges", "--cap-drop", "ALL"]
    for path in tmpfs:
        argv += ["--tmpfs", f"{path}:rw,mode=1777"]
    for volume in volumes:
        argv += ["--volume", volume]
    for key, value in (env or {}).items():
        argv += ["--env", f"{key}={value}"]
    if entrypoint is not None:
        argv += ["--entrypoint", entrypoint]
    argv += [*extra, image, *args]
    network.containers.append(full_name)
    podman(*argv)
    return Container(full_name, address)


def wait_until(check: Callable[[], Any], *, timeout: float, what: str,
               container: Container | None = None, interval: float = 0.5) -> Any:
    """Poll `check` until it returns something truthy; a stopped container fails at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except Exception as error:  # noqa: BLE001 - not up yet: keep polling
            value, last = None, error
        else:
            last = None
        if value:
            return value
        if container is not None and not container.running():
            raise AssertionError(f"{container.name} exited while waiting for {what}:\n{container.logs()}")
        if time.monotonic() > deadline:
            logs = f"\n{container.logs()}" if container is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last!r}){logs}")
        time.sleep(interval)
