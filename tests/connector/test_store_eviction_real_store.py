"""Retention `evict` against a real Mooncake 0.3.14 master and store pool (loopback TCP).

`StoreEviction` reads the real master's `/metrics`, and removes through the real client: the
conversation its saves touched least recently leaves whole (its last block first), a newer one
stays, the put that needed the room is stored, and the master's own eviction never runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from moonlease_dev.testbed.mooncake import MasterSettings
from moonlease_connector.adapters.store_eviction import MasterUsage, StoreEviction

pytestmark = pytest.mark.store

KEY_BYTES = 16 << 10
SEGMENT = 16 << 20  # the smallest segment mooncake_client mounts; 80 % watermark: 819 keys


def _put(client: Any, eviction: StoreEviction, keys: list[str]) -> list[int]:
    """A save's put as the send thread makes it: room first, then the put, then recency."""
    sizes = [KEY_BYTES] * len(keys)
    eviction.before_put(keys, sizes)
    code = client.put_batch(keys, [b"\1" * KEY_BYTES] * len(keys))
    answers = [code] * len(keys)
    eviction.after_put(keys, sizes, answers)
    return answers


def test_the_least_recent_conversation_leaves_whole_before_the_master_evicts(
        mooncake_master_factory: Callable[..., Any], store_pool_factory: Callable[..., Any],
        store_client_factory: Callable[..., Any]) -> None:
    master = mooncake_master_factory(MasterSettings(eviction_high_watermark_ratio=0.8,
                                                    default_kv_lease_ttl=200))
    store_pool_factory(master, segment_bytes=SEGMENT)
    client = store_client_factory(master)
    eviction = StoreEviction(client, MasterUsage(master.metrics_url), 0.8)
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
    master = mooncake_master_factory(MasterSettings(eviction_high_watermark_ratio=0.8,
                                                    default_kv_lease_ttl=60_000))
    store_pool_factory(master, segment_bytes=SEGMENT)
    client = store_client_factory(master)
    eviction = StoreEviction(client, MasterUsage(master.metrics_url), 0.8)
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
    master = mooncake_master_factory(MasterSettings(eviction_high_watermark_ratio=0.8,
                                                    default_kv_lease_ttl=60_000))
    store_pool_factory(master, segment_bytes=SEGMENT)
    client_a, client_b = store_client_factory(master), store_client_factory(master)
    evict_a = StoreEviction(client_a, MasterUsage(master.metrics_url), 0.8)
    evict_b = StoreEviction(client_b, MasterUsage(master.metrics_url), 0.8)
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
