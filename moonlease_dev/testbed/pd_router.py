"""vllm-router (the vLLM project's Rust router, from PyPI) in prefill/decode mode, as a process.

The router sends each request first to a prefill engine with `max_tokens=1` and
`kv_transfer_params={"do_remote_decode": true}`, then the original request to a decode engine.
With the Moonlease connector the KV travels through the store, not between the two engines:
the prefill engine (`kv_role: kv_producer`) saves what it computed, the decode engine
(`kv_role: kv_consumer`) looks the prompt up and loads it. No KV-transfer handshake is needed,
so the router runs without `--kv-connector` (its NIXL/Mooncake-transfer modes pair engines).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from moonlease_dev.bench.serve_plan import ROUTER_POLICIES
from moonlease_dev.testbed.processes import HealthProbedServer, ManagedProcess, ManagedServer, free_port
ROUTER_START_TIMEOUT_S = 120.0


class RouterNotInstalledError(RuntimeError):
    """`vllm-router` is not installed beside this interpreter nor on PATH."""


def router_executable() -> str:
    """The `vllm-router` command: beside this interpreter (the project's venv), else on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.is_file():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise RouterNotInstalledError(
            "vllm-router is not installed: `pip install -r requirements/router.txt` "
            "(tools/setup.sh does it for the development venv)")
    return found


def router_argv(executable: str, prefill_urls: Sequence[str], decode_urls: Sequence[str], *,
                port: int, metrics_port: int, policy: str = "round_robin",
                decode_policy: str | None = None, host: str = "127.0.0.1") -> list[str]:
    """The router's command line in P/D mode (no KV-transfer pairing: the store carries the KV)."""
    if not prefill_urls or not decode_urls:
        raise ValueError("a P/D router needs at least one prefill and one decode engine")
    for name in (policy, decode_policy):
        if name is not None and name not in ROUTER_POLICIES:
            raise ValueError(f"router policy {name!r} is not one of {', '.join(ROUTER_POLICIES)}")
    argv = [executable, "--vllm-pd-disaggregation", "--host", host, "--port", str(port),
            "--policy", policy, "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            "--intra-node-data-parallel-size", "1", "--log-level", "warning"]
    if decode_policy is not None:
        argv += ["--decode-policy", decode_policy]
    for url in prefill_urls:
        argv += ["--prefill", url]
    for url in decode_urls:
        argv += ["--decode", url]
    return argv


class PDRouter(HealthProbedServer, ManagedServer):
    """One vllm-router process routing every request through a prefill then a decode engine."""

    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str], *,
                 policy: str = "round_robin", decode_policy: str | None = None,
                 log_dir: Path | None = None) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.argv = router_argv(router_executable(), prefill_urls, decode_urls, port=self.port,
                                metrics_port=self.metrics_port, policy=policy,
                                decode_policy=decode_policy)
        self.process = ManagedProcess(f"vllm-router-{self.port}", self.argv, ready=self._ready,
                                      log_dir=log_dir, ready_timeout=ROUTER_START_TIMEOUT_S)
