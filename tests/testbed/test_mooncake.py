"""The Mooncake test bed is real: a master process, a store pool, clients of both releases."""

from __future__ import annotations

import time

import pytest

from moonlease_dev.testbed.mooncake import MasterSettings, MooncakeMaster, OLD_VERSION
from moonlease_dev.testbed.processes import http_get

pytestmark = pytest.mark.store

# Mooncake's "object has a lease" error: a non-forced remove of a leased key is refused.
LEASED = -706


def test_master_serves_prometheus_metrics(mooncake_master: MooncakeMaster) -> None:
    metrics = mooncake_master.metrics()
    assert "master_key_count" in metrics
    assert "master_total_capacity_bytes" in metrics
    status, body = http_get(mooncake_master.metrics_url)
    assert status == 200 and "# TYPE master_key_count" in body


def test_master_stops_by_pid_and_frees_its_port(mooncake_master_factory) -> None:
    master = mooncake_master_factory()
    pid = master.process.pid
    master.stop()
    status, _ = http_get(master.metrics_url, timeout=0.5)
    assert status == 0, "the metrics port still answers after stop"
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)


def test_store_pool_holds_data_that_outlives_the_writer(
        mooncake_master, store_pool, store_client_factory) -> None:
    capacity = mooncake_master.metrics()["master_total_capacity_bytes"]
    assert capacity >= store_pool.segment_bytes

    writer = store_client_factory(mooncake_master)  # brings no segment: data goes to the pool
    payload = bytes(range(256)) * 64
    assert writer.put("moonlease_dev/testbed/key", payload) == 0
    writer.close()

    reader = store_client_factory(mooncake_master)
    assert reader.get("moonlease_dev/testbed/key") == payload
    assert mooncake_master.metrics()["master_key_count"] == 1


def test_lease_ttl_flag_reaches_the_master(mooncake_master_factory, store_pool_factory,
                                           store_client_factory) -> None:
    """batch_is_exist leases a key for default_kv_lease_ttl: remove is refused until it expires."""
    master = mooncake_master_factory(default_kv_lease_ttl=1500)
    store_pool_factory(master)
    client = store_client_factory(master)
    client.put("leased", b"x" * 1024)

    assert client.batch_is_exist(["leased"]) == [1]
    assert client.remove("leased") == LEASED
    time.sleep(1.8)
    assert client.remove("leased") == 0


def test_batch_probe_key_takes_no_lease(mooncake_master, store_pool, store_client_factory) -> None:
    client = store_client_factory(mooncake_master)
    client.put("probed", b"y" * 1024)
    assert client.batch_probe_key(["probed", "absent"], "none") == [1, 0]
    assert client.remove("probed") == 0


def test_eviction_flags_reach_the_master(mooncake_master_factory, store_pool_factory,
                                         store_client_factory) -> None:
    """A pool filled past eviction_high_watermark_ratio evicts lease-expired keys."""
    master = mooncake_master_factory(MasterSettings(eviction_high_watermark_ratio=0.5,
                                                    eviction_ratio=0.2, default_kv_lease_ttl=100))
    store_pool_factory(master, segment_bytes=16 << 20)
    client = store_client_factory(master)
    block = b"z" * (256 << 10)
    for index in range(48):  # 12 MiB of 16: past the 50 % watermark
        client.put(f"fill/{index}", block)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and master.metrics().get("master_evicted_key_count", 0) == 0:
        time.sleep(0.1)
    assert master.metrics()["master_evicted_key_count"] > 0


def test_old_release_client_and_master(mooncake_master_factory, store_pool_factory,
                                       store_client_factory) -> None:
    """Mooncake 0.3.13.post1 runs from its own virtualenv and lacks batch_probe_key."""
    master = mooncake_master_factory(version=OLD_VERSION)
    assert master.version == OLD_VERSION
    store_pool_factory(master)
    client = store_client_factory(master, version=OLD_VERSION)
    assert client.put("old/key", b"old") == 0
    assert client.get("old/key") == b"old"
    assert client.batch_is_exist(["old/key", "old/none"]) == [1, 0]
    with pytest.raises(AttributeError):
        client.batch_probe_key(["old/key"], "none")


def test_clients_of_both_releases_share_a_current_master(mooncake_master, store_pool,
                                                         store_client_factory) -> None:
    current = store_client_factory(mooncake_master)
    old = store_client_factory(mooncake_master, version=OLD_VERSION)
    assert current.put("shared/key", b"from 0.3.14") == 0
    assert old.get("shared/key") == b"from 0.3.14"
