"""Real kubectl (the machine image's /usr/bin/kubectl) against the local API server: `kubectl`
runs it with a kubeconfig and a discovery cache of the test's own, without blocking the event
loop the server answers from."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from moonlease.testbed.kube import LocalApiServer

Kubectl = Callable[..., Awaitable[subprocess.CompletedProcess[str]]]


def kubectl_binary() -> str:
    found = shutil.which("kubectl")
    assert found, "kubectl is not on PATH: the conformance tier runs the real client"
    return found


@pytest.fixture
def kubectl(kube: LocalApiServer, tmp_path: Path) -> Kubectl:
    """`await kubectl("get", "deploy", input=..., timeout=...)`: the finished process (text)."""
    config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    binary = kubectl_binary()

    async def run(*args: str, input: str | None = None, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
        process = await asyncio.create_subprocess_exec(
            binary, f"--kubeconfig={config}", f"--cache-dir={tmp_path / 'cache'}", *args,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(process.communicate(input.encode() if input else None), timeout)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise
        return subprocess.CompletedProcess(list(args), process.returncode or 0, out.decode(), err.decode())

    return run
