"""The scheduler's lookup client bounds the wait for worker rank 0 (`BoundedLookupClient`).

Real parts: our scheduler role (a real `VllmConfig`, the fixture of test_scheduler_reset) and its
real ZMQ client over the real IPC path; on the other end our `BoundedLookupServer` answering for
a worker stand-in whose lookup runs inline, as the worker's does — a real lookup object over a
real 0.3.14 client of a real master and store pool. Freezing the master (SIGSTOP) holds the
worker in its store call: the scheduler must get a miss within the deadline, later lookups must
miss at once without reaching the worker, and lookups hit again once the master answers. With
no worker at all, the scheduler's lookup is a miss within the deadline too (upstream's client
would wait forever).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import get_zmq_rpc_path_lookup

from moonlease_connector.adapters.vllm_lookup_client import BoundedLookupClient
from moonlease_connector.adapters.vllm_lookup_server import BoundedLookupServer
from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.lookup_breaker import BreakerState
from tests.connector.test_scheduler_reset import LAYOUT, connector  # noqa: F401 - the fixture
from tests.support.freeze import frozen
from tests.support.lookup_workers import PatternStore, build_lookup

pytestmark = pytest.mark.store

HASHES = [bytes([7, i]) * 4 for i in range(4)]
KEYS = [f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h.hex()}" for h in HASHES]
TIMEOUT_S = 0.3
HIT = 48  # 4 blocks of 16, the last token recomputed
#: Bounds that catch a hang on a loaded 2-core machine, not a slow step.
EVENTUALLY_S = 60


def inline_worker(lookup, store=None):
    """What the lookup server reads of a worker; counts the lookups that reached it."""
    calls = []

    def run(num_tokens, hashes):
        calls.append(num_tokens)
        return lookup.lookup(num_tokens, hashes).result

    return SimpleNamespace(lookup=run, store=store, kv_send_thread=None), calls


def bounded_client(conn) -> BoundedLookupClient:
    client = conn.connector_scheduler.client
    assert isinstance(client, BoundedLookupClient), "our client replaced upstream's"
    client.timeout_s = TIMEOUT_S  # the fixture's config has the default 1 s; shorter here
    return client


def eventually_hits(client, what: str) -> None:
    deadline = time.monotonic() + EVENTUALLY_S
    hit = 0
    while time.monotonic() < deadline:
        hit = client.lookup(f"poll-{time.monotonic()}", 64, HASHES).hit_length
        if hit:
            break
        time.sleep(0.05)
    assert hit == HIT, what


def test_a_lookup_stuck_in_a_frozen_master_misses_in_time_and_later_ones_miss_at_once(
        connector, mooncake_master, store_pool, store_client_factory):  # noqa: F811
    conn, config, servers = connector
    client = bounded_client(conn)
    writer = store_client_factory(mooncake_master)
    for key in KEYS:
        assert writer.put(key, b"kv" * 32) == 0
    settings = MoonleaseConnectorConfig.for_mode(LeaseMode.LEASE_ALL)
    lookup = build_lookup(LAYOUT, store_client_factory(mooncake_master), settings,
                          served_by_client=True)
    assert lookup.deadline is None, "served through the client: the worker runs it inline"
    worker, calls = inline_worker(lookup)
    server = BoundedLookupServer(worker, get_zmq_rpc_path_lookup(config))
    servers.append(server)
    assert client.lookup("r1", 64, HASHES).hit_length == HIT

    with frozen(mooncake_master.process.pid):
        reached = len(calls)
        started = time.monotonic()
        assert client.lookup("r2", 64, HASHES).hit_length == 0
        waited = time.monotonic() - started
        assert TIMEOUT_S * 0.9 <= waited < TIMEOUT_S + 10, "a miss at the deadline, not a hang"
        assert client.breaker_state is BreakerState.OPEN
        started = time.monotonic()
        for n in range(3):
            assert client.lookup(f"r{3 + n}", 64, HASHES).hit_length == 0
        assert time.monotonic() - started < TIMEOUT_S, "later lookups miss at once"
        assert len(calls) == reached + 1, "only the first reached the worker (still stuck in it)"
        assert server.busy, "the worker is still in the frozen store call"
    # The store call returns, the late reply is dropped, and lookups are sent again.
    eventually_hits(client, "lookups hit again once the master answers")
    assert client.breaker_state is BreakerState.CLOSED
    stats = conn.connector_scheduler.take_lookup_stats()
    assert stats is not None and stats.reduce()["lookup_misses"] >= 4, "store_timeout misses counted"


def test_with_no_worker_a_lookup_misses_within_the_deadline_and_hits_once_one_answers(
        connector):  # noqa: F811
    conn, config, servers = connector
    client = bounded_client(conn)
    for mode in ("sync", "async"):
        started = time.monotonic()
        if mode == "sync":
            result = client.lookup("dead-1", 64, HASHES)
        else:  # upstream's asynchronous path: None until the (bounded) lookup is done
            result = None
            while result is None and time.monotonic() - started < EVENTUALLY_S:
                result = client.lookup("dead-2", 64, HASHES, non_block=True)
                time.sleep(0.01)
        assert result is not None and result.hit_length == 0
        assert time.monotonic() - started < TIMEOUT_S + 10, f"{mode}: a miss, not a wait forever"
    assert client.breaker_state is not BreakerState.CLOSED

    # A worker comes up: the next probe reaches it, its reply closes the breaker.
    store = PatternStore(dict.fromkeys(KEYS, 1))
    lookup = build_lookup(LAYOUT, store, MoonleaseConnectorConfig(), served_by_client=True)
    servers.append(BoundedLookupServer(inline_worker(lookup, store)[0],
                                       get_zmq_rpc_path_lookup(config)))
    eventually_hits(client, "the probe reached the new worker and lookups hit again")
    # A reset still goes through the same channel afterwards.
    removed = []
    store.remove_all = lambda force=False: removed.append(force) or 0
    assert conn.reset_cache() is True and removed == [True]
