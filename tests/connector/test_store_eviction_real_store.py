"""Retention `evict` against a real Mooncake 0.3.14 master and store pool (loopback TCP).

`StoreEviction` reads the real master's `/metrics`, and removes through the real client: the
conversation its saves touched least recently leaves whole (its last block first), a newer one
stays, the put that needed the room is stored, and the master's own eviction never runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import pytest

from moonlease_dev.testbed.fleet_order import FleetOrderProcess
from moonlease_dev.testbed.mooncake import MasterSettings
from moonlease_dev.testbed.processes import free_port
from moonlease_connector.adapters.fleet_order_client import FleetOrderClient
from moonlease_connector.adapters.store_eviction import MasterUsage, StoreEviction

pytestmark = pytest.mark.store

KEY_BYTES = 16 << 10
SEGMENT = 16 << 20  # the smallest segment mooncake_client mounts; 80 % watermark: 819 keys


def _store(master_factory: Callable[..., Any], pool_factory: Callable[..., Any],
           client_factory: Callable[..., Any], lease_ttl_ms: int) -> tuple[Any, Any, StoreEviction]:
    """A real master (80 % watermark, this lease TTL), a 16 MiB pool, a client and its evict."""
    master = master_factory(MasterSettings(eviction_high_watermark_ratio=0.8, default_kv_lease_ttl=lease_ttl_ms))
    pool_factory(master, segment_bytes=SEGMENT)
    client = client_factory(master)
    return master, client, StoreEviction(client, MasterUsage(master.metrics_url), 0.8)


def _put(client: Any, eviction: StoreEviction, keys: list[str], shared: set[str] | None = None) -> list[int]:
    """A save's put as the send thread makes it: room first, then the put, then recency."""
    sizes = [KEY_BYTES] * len(keys)
    eviction.before_put(keys, sizes)
    code = client.put_batch(keys, [b"\1" * KEY_BYTES] * len(keys))
    answers = [code] * len(keys)
    eviction.after_put(keys, sizes, answers, shared=shared)
    return answers


def test_the_least_recent_conversation_leaves_whole_before_the_master_evicts(
        mooncake_master_factory: Callable[..., Any], store_pool_factory: Callable[..., Any],
        store_client_factory: Callable[..., Any]) -> None:
    master, client, eviction = _store(mooncake_master_factory, store_pool_factory, store_client_factory, 200)
    older = [f"conv-a-{i}" for i in range(200)]
    newer = [f"conv-b-{i}" for i in range(200)]
    incoming = [f"conv-c-{i}" for i in range(600)]  # 400 + 600 keys > 819 below the watermark

    assert _put(client, eviction, older) == [0] * 200
    assert _put(client, eviction, newer) == [0] * 200
    assert eviction.removed_keys == 0  # both fit: nothing removed
    # The newer conversation is read again (a save re-checks it): it becomes the most recent.
    eviction.saw_exist(newer, client.batch_is_exist(newer))

    assert _put(client, eviction, incoming) == [0] * 600

    present = lambda keys: [answer == 1 for answer in client.batch_probe_key(keys, "none", 1)]  # noqa: E731
    assert all(present(incoming)), "the put that needed room was stored"
    assert all(present(newer)), "the conversation used more recently kept every block"
    older_present = present(older)
    needed = math.ceil((1000 * KEY_BYTES - 0.8 * SEGMENT) / KEY_BYTES)  # 181 keys of room
    assert needed <= older_present.count(False) <= needed + 2
    # Tail first: once a block of the older conversation is gone, every later one is gone too.
    first_gone = older_present.index(False)
    assert not any(older_present[first_gone:])
    assert eviction.removed_keys == older_present.count(False)
    metrics = master.metrics()
    assert metrics.get("master_evicted_key_count", 0.0) == 0  # the master's pass never ran
    assert metrics["master_allocated_bytes"] <= 0.8 * metrics["master_total_capacity_bytes"]


def test_keys_under_lease_are_refused_and_kept(
        mooncake_master_factory: Callable[..., Any], store_pool_factory: Callable[..., Any],
        store_client_factory: Callable[..., Any]) -> None:
    master, client, eviction = _store(mooncake_master_factory, store_pool_factory, store_client_factory, 60_000)
    leased = [f"leased-{i}" for i in range(300)]
    free = [f"free-{i}" for i in range(300)]
    _put(client, eviction, leased)
    _put(client, eviction, free)
    client.batch_is_exist(leased)  # a lookup leases them for 60 s (not through the eviction)

    _put(client, eviction, [f"new-{i}" for i in range(400)])  # needs 181 keys of room

    assert eviction.refused_keys == 300  # the oldest, leased: the master refused to remove them
    assert all(answer == 1 for answer in client.batch_probe_key(leased, "none", 1))
    assert 181 <= eviction.removed_keys <= 183  # taken from the unleased ones instead
    assert eviction.order.take_oldest(1)[0][0].startswith("free-")  # leased ones went to the back


def test_without_metrics_the_connector_removes_nothing() -> None:
    class NoStore:
        def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
            raise AssertionError("nothing may be removed without knowing the store's usage")

    eviction = StoreEviction(NoStore(), MasterUsage("http://127.0.0.1:9/metrics", timeout_s=0.2), 0.8)
    eviction.after_put(["k"], [KEY_BYTES], [0])
    assert eviction.before_put(["x"], [1 << 40]) == 0
    assert MasterUsage(None)() is None


def test_two_connectors_evict_never_removes_what_the_other_leased(
        mooncake_master_factory: Callable[..., Any], store_pool_factory: Callable[..., Any],
        store_client_factory: Callable[..., Any]) -> None:
    """Two engines on one store, each with its own client and recency order: keys engine A's
    lookups read (and so lease) are engine B's oldest, yet B's eviction cannot remove them."""
    master, client_b, evict_b = _store(mooncake_master_factory, store_pool_factory, store_client_factory, 60_000)
    client_a = store_client_factory(master)
    evict_a = StoreEviction(client_a, MasterUsage(master.metrics_url), 0.8)
    shared = [f"shared-{i}" for i in range(300)]  # saved by B, read by A
    b_only = [f"b-only-{i}" for i in range(300)]
    a_only = [f"a-only-{i}" for i in range(200)]
    _put(client_b, evict_b, shared)
    _put(client_b, evict_b, b_only)
    _put(client_a, evict_a, a_only)
    assert evict_a.removed_keys == evict_b.removed_keys == 0  # 800 keys fit below 819
    assert client_a.batch_is_exist(shared) == [1] * 300  # A's lookup: leased for 60 s

    # B's next save needs 281 keys of room; its oldest are the ones A leased.
    assert _put(client_b, evict_b, [f"b-new-{i}" for i in range(300)]) == [0] * 300

    present = lambda keys: [answer == 1 for answer in client_a.batch_probe_key(keys, "none", 1)]  # noqa: E731
    assert all(present(shared)), "a key the other connector leased was removed"
    assert all(present(a_only)), "B removed a key only A's saves wrote"
    assert evict_b.refused_keys == 300
    assert 281 <= evict_b.removed_keys <= 283
    assert present(b_only).count(False) == evict_b.removed_keys
    assert master.metrics().get("master_evicted_key_count", 0.0) == 0


@pytest.mark.parametrize("marked_shared", [True, False])
def test_evict_leaves_a_shared_prefix_to_the_master_even_when_it_is_oldest_and_unleased(
        mooncake_master_factory: Callable[..., Any], store_pool_factory: Callable[..., Any],
        store_client_factory: Callable[..., Any], marked_shared: bool) -> None:
    """Engine B saved a system prompt other engines' prompts follow; B's own order calls it
    oldest, and nobody holds a lease on it right now. Marked shared by B's save (retention's
    shared-prefix tracker), B's eviction takes its own conversation instead; unmarked, it would
    remove the prefix every other engine reads."""
    master, client, evict_b = _store(mooncake_master_factory, store_pool_factory, store_client_factory, 100)
    system = [f"system-{i}" for i in range(300)]
    conversation = [f"b-conv-{i}" for i in range(400)]
    _put(client, evict_b, system, shared=set(system) if marked_shared else set())
    _put(client, evict_b, conversation)
    time.sleep(0.3)  # every lease (100 ms) has expired: the master would let either go

    assert _put(client, evict_b, [f"b-new-{i}" for i in range(200)]) == [0] * 200  # 81 keys of room

    present = lambda keys: [answer == 1 for answer in client.batch_probe_key(keys, "none", 1)]  # noqa: E731
    assert 81 <= evict_b.removed_keys <= 83
    if marked_shared:
        assert all(present(system)), "evict removed a shared prefix"
        assert present(conversation).count(False) == evict_b.removed_keys
    else:  # the same order without the mark: the prefix is the oldest, and goes first
        assert present(system).count(False) == evict_b.removed_keys
        assert all(present(conversation))
    assert master.metrics().get("master_evicted_key_count", 0.0) == 0


def test_the_send_threads_store_handle_hands_the_jobs_shared_prefix_to_evict(
        mooncake_master_factory: Callable[..., Any], store_pool_factory: Callable[..., Any],
        store_client_factory: Callable[..., Any]) -> None:
    """The engine path: `_RetentionStore` (what upstream's send thread calls) passes the job's
    shared-prefix keys with every re-check and put, so evict's order marks exactly those."""
    import torch
    from mooncake.store import ReplicateConfig

    from moonlease_connector.adapters.vllm_retention import _RetentionStore

    master = mooncake_master_factory(MasterSettings())
    store_pool_factory(master, segment_bytes=SEGMENT)
    client = store_client_factory(master)
    value = 4096
    buffer = torch.zeros(4 * value, dtype=torch.uint8)
    assert client.register_buffer(buffer.data_ptr(), buffer.numel()) == 0
    eviction = StoreEviction(client, MasterUsage(master.metrics_url), 0.8)
    shared_now = frozenset({"job-0", "job-1"})
    store = _RetentionStore(client, lambda key: False, lambda decision, count: None,
                            eviction=lambda: eviction, shared=lambda: shared_now)
    keys = [f"job-{i}" for i in range(4)]
    assert store.batch_is_exist(keys) == [0, 0, 0, 0]
    assert store.batch_put_from_multi_buffers(
        keys, [[buffer.data_ptr() + i * value] for i in range(4)], [[value]] * 4, ReplicateConfig()) == [0] * 4
    assert [eviction.order.is_shared(key) for key in keys] == [True, True, False, False]

    shared_now = frozenset()  # the next job's prompt shares nothing with these keys any more
    assert store.batch_is_exist(keys) == [1, 1, 1, 1]
    assert not any(eviction.order.is_shared(key) for key in keys)


def test_a_conversation_a_load_read_is_kept_over_one_saved_later_but_not_read(
        mooncake_master_factory: Callable[..., Any], store_pool_factory: Callable[..., Any],
        store_client_factory: Callable[..., Any]) -> None:
    """A save skips the prefix its request loaded, so only the load says that prefix is in use.
    The receive thread's store handle (`LoadObserver`) hands what a real `BatchGet` read to the
    send thread's evict (`saw_load`, from another thread); the next put then removes the
    conversation nobody read since, not the one just loaded — and, as before the change, a key
    this connector never saved is not adopted by a load."""
    import threading

    import torch

    from moonlease_connector.adapters.vllm_retention import LoadObserver

    master, client, eviction = _store(mooncake_master_factory, store_pool_factory, store_client_factory, 100)
    older = [f"conv-a-{i}" for i in range(300)]
    newer = [f"conv-b-{i}" for i in range(300)]
    _put(client, eviction, older)
    _put(client, eviction, newer)
    other_engines = [f"conv-x-{i}" for i in range(4)]
    assert client.put_batch(other_engines, [b"\1" * KEY_BYTES] * 4) == 0

    buffer = torch.zeros(KEY_BYTES * 8, dtype=torch.uint8)
    assert client.register_buffer(buffer.data_ptr(), buffer.numel()) == 0
    loads = LoadObserver(client, eviction.saw_load)
    read = [*older, *other_engines, "never-stored"]  # A's next turn loads A; and two others
    addrs = [[buffer.data_ptr() + (i % 8) * KEY_BYTES] for i in range(len(read))]

    def receive_thread() -> None:
        answers = loads.batch_get_into_multi_buffers(read, addrs, [[KEY_BYTES]] * len(read))
        assert [answer >= 0 for answer in answers] == [True] * 304 + [False]

    thread = threading.Thread(target=receive_thread)
    thread.start()
    thread.join()
    time.sleep(0.3)  # every lease (100 ms) has expired: the master would let any of them go

    assert _put(client, eviction, [f"conv-c-{i}" for i in range(300)]) == [0] * 300  # 81 of room
    present = lambda keys: [answer == 1 for answer in client.batch_probe_key(keys, "none", 1)]  # noqa: E731
    assert eviction.removed_keys >= 81
    assert all(present(older)), "evict removed the conversation a load had just read"
    assert all(present(other_engines)), "a load made another engine's keys this connector's"
    assert present(newer).count(False) == eviction.removed_keys
    assert not present(newer[-eviction.removed_keys:]).count(True), "B leaves tail first"
    assert master.metrics().get("master_evicted_key_count", 0.0) == 0


def test_on_the_fleet_order_an_engine_removes_what_the_fleet_used_least_recently(
        mooncake_master_factory: Callable[..., Any], store_pool_factory: Callable[..., Any],
        store_client_factory: Callable[..., Any]) -> None:
    """Two engines on one store, both on one fleet order service (its own process, as the chart
    runs it). Engine A saved its conversation, then engine B saved one, then engine B loaded A's
    conversation (a sibling turn routed to B). A's own order would call A's conversation its
    oldest; the fleet's calls B's conversation the least recently used, and that is what A's
    next save removes."""
    master, client_a, _ = _store(mooncake_master_factory, store_pool_factory, store_client_factory, 100)
    client_b = store_client_factory(master)
    with FleetOrderProcess() as service:
        on_fleet = lambda client: StoreEviction(client, MasterUsage(master.metrics_url), 0.8,  # noqa: E731
                                                order=FleetOrderClient(service.url))
        evict_a, evict_b = on_fleet(client_a), on_fleet(client_b)
        a_conversation = [f"a-conv-{i}" for i in range(300)]
        b_conversation = [f"b-conv-{i}" for i in range(300)]
        _put(client_a, evict_a, a_conversation)
        _put(client_b, evict_b, b_conversation)
        evict_b.saw_load(a_conversation)  # B's receive thread read A's conversation: now the fleet's newest
        for eviction in (evict_a, evict_b):
            assert eviction.order.flush()
        time.sleep(0.3)  # every lease (100 ms) has expired: the master would let either go

        assert _put(client_a, evict_a, [f"a-new-{i}" for i in range(400)]) == [0] * 400  # 181 keys of room

        present = lambda keys: [a == 1 for a in client_a.batch_probe_key(keys, "none", 1)]  # noqa: E731
        assert all(present(a_conversation)), "the conversation the fleet read last was removed"
        gone = present(b_conversation).count(False)
        assert 181 <= gone <= 183 and evict_a.removed_keys == gone
        assert not any(present(b_conversation)[-gone:]), "B's conversation leaves tail first"
        assert master.metrics().get("master_evicted_key_count", 0.0) == 0
        metrics = service.metrics()
        assert f"moonlease_fleet_order_keys_taken_total {float(gone)}" in metrics
        for eviction in (evict_a, evict_b):
            eviction.order.close()


def test_a_fleet_order_that_does_not_answer_removes_nothing_and_the_put_goes_ahead(
        mooncake_master_factory: Callable[..., Any], store_pool_factory: Callable[..., Any],
        store_client_factory: Callable[..., Any]) -> None:
    """The service down: a take gets no answer within its timeout, evict removes nothing, the
    put is stored (the master's own eviction makes the room, as without evict)."""
    master, client, _ = _store(mooncake_master_factory, store_pool_factory, store_client_factory, 100)
    order = FleetOrderClient(f"http://127.0.0.1:{free_port()}", timeout_s=0.2)
    eviction = StoreEviction(client, MasterUsage(master.metrics_url), 0.8, order=order)
    _put(client, eviction, [f"old-{i}" for i in range(600)])
    time.sleep(0.3)
    started = time.monotonic()
    assert _put(client, eviction, [f"new-{i}" for i in range(400)]) == [0] * 400
    assert time.monotonic() - started < 5
    assert eviction.removed_keys == 0 and order.unanswered_takes >= 1 and order.failed_requests >= 1
    order.close()
