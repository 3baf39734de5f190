"""The mooncake image runs the master and the store pool (read-only root, uid 65532, the CPU
libcuda stub in the image) and a client outside the containers stores in and loads from them."""

from __future__ import annotations

import os

import pytest

from moonlease_dev import devenv
from tests.images.conftest import Images
from tests.images.podman import Network, podman
from tests.images.store import start_store

pytestmark = pytest.mark.images


def test_the_mooncake_image_serves_a_store_a_client_outside_uses(images: Images, network: Network) -> None:
    image = images["mooncake"]
    assert podman("run", "--rm", "--read-only", "--entrypoint", "id", image, "-u").stdout.strip() == "65532"
    store = start_store(network, image)
    devenv.preload()
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    # No segment of its own (size 0): whatever it puts lands in the pool's segment, in its container.
    code = client.setup(network.gateway, "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", store.master_address)
    assert code == 0, f"setup against {store.master_address} returned {code}:\n{store.master.logs()}"
    try:
        value = os.urandom(1 << 20)
        assert client.put("moonlease-image-test", value) == 0
        assert client.is_exist("moonlease-image-test") == 1
        assert client.get("moonlease-image-test") == value
        metrics = store.master_metrics()
        assert metrics["master_key_count"] >= 1
        assert metrics["master_total_capacity_bytes"] == store.segment_bytes  # the pool's segment only
    finally:
        client.close()
