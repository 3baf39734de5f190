"""Real kubectl (the machine image's /usr/bin/kubectl) against the local API server: `kubectl`
runs it with a kubeconfig and a discovery cache of the test's own, without blocking the event
loop the server answers from."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from moonlease_dev.testbed.kube import LocalApiServer

Kubectl = Callable[..., Awaitable[subprocess.CompletedProcess[str]]]


def kubectl_binary() -> str:
    found = shutil.which("kubectl")
    assert found, "kubectl is not on PATH: the conformance tier runs the real client"
    return found


@pytest.fixture
def kubectl(kube: LocalApiServer, tmp_path: Path) -> Kubectl:
    """`await kubectl("get", "deploy", input=..., timeout=...)`: the finished process (text);
    `plugin=True` for a plugin's command (`kubectl moonlease ...`); `extra_env` (e.g. KUBE_EDITOR)."""
    config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    binary = kubectl_binary()

    # Plugins (kubectl-moonlease, installed beside this interpreter) are found on PATH and take no
    # global flags before their name: they read the kubeconfig from $KUBECONFIG.
    env = {**os.environ, "KUBECONFIG": str(config),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    async def run(*args: str, input: str | None = None, timeout: float = 20.0, plugin: bool = False,
                  extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        flags = [] if plugin else [f"--cache-dir={tmp_path / 'cache'}"]
        process = await asyncio.create_subprocess_exec(
            binary, *flags, *args, env={**env, **(extra_env or {})}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(process.communicate(input.encode() if input else None), timeout)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise
        return subprocess.CompletedProcess(list(args), process.returncode or 0, out.decode(), err.decode())

    return run


def deployment_yaml(name: str = "web", replicas: int = 2) -> str:
    return f"""apiVersion: apps/v1
kind: Deployment
metadata: {{name: {name}, namespace: default}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: {name}}}}}
  template:
    metadata: {{labels: {{app: {name}}}}}
    spec: {{containers: [{{name: {name}, image: "nginx:1.27"}}]}}
"""


def header(output: str) -> list[str]:
    """The column names of the first line `kubectl get` printed (multi-word names kept whole)."""
    return [cell.strip() for cell in output.splitlines()[0].split("  ") if cell.strip()]


async def apply_ok(kubectl: Kubectl, text: str, *extra: str) -> str:
    done = await kubectl("apply", "-f", "-", *extra, input=text)
    assert done.returncode == 0, done.stderr
    return done.stdout
