"""A Mooncake master and a store pool in containers of the mooncake image, started with the
arguments the chart renders (its --rpc_address/--host are the pod IP there, the container's
address on the podman network here)."""

from __future__ import annotations

from dataclasses import dataclass

from moonlease_dev.testbed.mooncake import parse_metrics
from moonlease_dev.testbed.processes import http_get
from tests.images.podman import Container, Network, run_detached, wait_until

RPC_PORT = 50051
METRICS_PORT = 9003
POOL_PORT = 50052
POOL_HTTP_PORT = 9300


@dataclass
class StoreContainers:
    master: Container
    pool: Container
    segment_bytes: int

    @property
    def master_address(self) -> str:
        return f"{self.master.address}:{RPC_PORT}"

    def master_metrics(self) -> dict[str, float]:
        status, body = http_get(f"http://{self.master.address}:{METRICS_PORT}/metrics", timeout=2)
        if status != 200:
            raise ConnectionError(f"master metrics answered {status}")
        return parse_metrics(body)


def start_store(network: Network, image: str, *, segment_mib: int = 256) -> StoreContainers:
    master = run_detached(network, image, [
        "--rpc_address=0.0.0.0", f"--rpc_port={RPC_PORT}", f"--metrics_port={METRICS_PORT}",
        "--logtostderr=true"], name="master")
    wait_until(lambda: http_get(f"http://{master.address}:{METRICS_PORT}/health", timeout=1)[0] == 200,
               timeout=60, what="the master's /health", container=master)
    pool_address = network.address()
    network._next -= 1  # run_detached hands out the same address next
    pool = run_detached(network, image, [
        f"--host={pool_address}", f"--master_server_address={master.address}:{RPC_PORT}",
        "--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
        f"--global_segment_size={segment_mib}MB", "--local_buffer_size=16MB",
        f"--port={POOL_PORT}", "--enable_http_server=true", f"--http_port={POOL_HTTP_PORT}",
        "--logtostderr=true"], name="store-pool", entrypoint="mooncake_client")
    assert pool.address == pool_address
    store = StoreContainers(master, pool, segment_mib << 20)
    wait_until(lambda: store.master_metrics().get("master_total_capacity_bytes", 0) >= store.segment_bytes,
               timeout=60, what="the pool's segment in the master's capacity", container=pool)
    return store
