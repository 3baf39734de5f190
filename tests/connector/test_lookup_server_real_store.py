"""The worker's lookup server bounds resets; the scheduler's lookups keep being answered.

Our scheduler role (a real `VllmConfig`, the fixture of test_scheduler_reset) talks to our
`BoundedLookupServer` over the real IPC channel; the server answers for a worker stand-in that
has exactly what the server reads (`lookup`, `store`, `kv_send_thread`) — a real lookup object
over a real 0.3.14 client of a real master, so no engine is needed. Freezing the master (SIGSTOP)
holds `remove_all`: upstream's server would wait forever and take every later lookup with it.
"""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import get_zmq_rpc_path_lookup

from moonlease_connector.adapters.vllm_lookup_server import BoundedLookupServer
from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from tests.connector.test_scheduler_reset import LAYOUT, connector  # noqa: F401 - the fixture
from tests.support.freeze import frozen
from tests.support.lookup_workers import PatternStore, build_lookup

pytestmark = pytest.mark.store

HASHES = [bytes([5, i]) * 4 for i in range(4)]
KEYS = [f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h.hex()}" for h in HASHES]
SETTINGS = MoonleaseConnectorConfig.for_mode(LeaseMode.LEASE_ALL).model_copy(
    update={"mooncake_lookup_timeout_ms": 300})


def stand_in(lookup, store, send_queue=None):
    return SimpleNamespace(lookup=lambda n, h: lookup.lookup(n, h).result, store=store,
                           kv_send_thread=None if send_queue is None else SimpleNamespace(
                               request_queue=send_queue))


def test_a_reset_against_a_frozen_master_is_refused_in_time_and_lookups_keep_answering(
        connector, mooncake_master, store_pool, store_client_factory):  # noqa: F811
    conn, config, servers = connector
    scheduler = conn.connector_scheduler
    writer = store_client_factory(mooncake_master)
    for key in KEYS:
        assert writer.put(key, b"kv" * 32) == 0
    client = store_client_factory(mooncake_master)
    lookup = build_lookup(LAYOUT, client, SETTINGS, keep_deadline=True)
    server = BoundedLookupServer(stand_in(lookup, client), get_zmq_rpc_path_lookup(config), remove_s=1.0)
    servers.append(server)
    assert scheduler.client.lookup("r1", 64, HASHES).hit_length == 48

    with frozen(mooncake_master.process.pid):
        started = time.monotonic()
        assert conn.reset_cache() is False, "remove_all did not finish: a NACK, not a hang"
        assert time.monotonic() - started < 30
        answered = scheduler.client.lookup("r2", 64, HASHES)
        assert answered is not None and answered.hit_length == 0, "a miss, answered"

    deadline = time.monotonic() + 60
    while (server._remover.busy or lookup.deadline.busy) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert conn.reset_cache() is True
    assert scheduler.client.lookup("r3", 64, HASHES).hit_length == 0, "the store was emptied"


def test_a_reset_with_saves_stuck_in_flight_is_refused_after_the_drain_bound(connector):  # noqa: F811
    conn, config, servers = connector
    stuck = queue.Queue()
    stuck.put("a save job that never finishes")
    store = PatternStore(dict.fromkeys(KEYS, 1))
    removed = []
    store.remove_all = lambda force=False: removed.append(force) or 0
    server = BoundedLookupServer(stand_in(build_lookup(LAYOUT, store, SETTINGS), store, stuck),
                                 get_zmq_rpc_path_lookup(config), drain_s=0.5)
    servers.append(server)
    started = time.monotonic()
    assert conn.reset_cache() is False
    assert time.monotonic() - started < 30 and removed == [], "no remove_all while saves are in flight"
    assert conn.connector_scheduler.client.lookup("r1", 64, HASHES).hit_length == 48
    stuck.task_done()
    assert conn.reset_cache() is True and removed == [True]
