"""Selective lease against a real Mooncake 0.3.14 master; leases witnessed by the store itself.

A key under a read lease refuses a non-forced remove (-706); an unleased one is removed (0).
Eviction between probe and lease is done for real: a second client force-removes keys between
the two calls.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from moonlease_dev.testbed.mooncake import OLD_VERSION
from moonlease_connector.adapters.mooncake_store import detect_capabilities
from moonlease_connector.adapters.vllm_worker import refuse_unsupported_mode
from moonlease_settings.config import ConnectorConfigError, LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.capabilities import missing_capability
from moonlease_connector.core.lookup import MissReason, build_candidates
from tests.support.lookup_workers import (
    HASH_BLOCK,
    LAYOUTS,
    OperationRecorder,
    build_lookup,
    keys_the_load_reads,
)

pytestmark = pytest.mark.store

LEASED = -706
SELECTIVE = MoonleaseConnectorConfig.for_mode(LeaseMode.SELECTIVE)
FULL_SWA = LAYOUTS[4]  # full attention (2 ranks) + a 24-token sliding window
HASHES = [random.Random(11).randbytes(8) + bytes([i]) for i in range(16)]
NUM_TOKENS = len(HASHES) * HASH_BLOCK


class EvictingStore:
    """The real client, with a second client that force-removes keys right before each lease."""

    def __init__(self, store: Any, evictor: Any, evictions: list[set[str]]) -> None:
        self._store, self._evictor, self._evictions = store, evictor, list(evictions)

    def batch_probe_key(self, keys: list[str], policy: str = "none", candidate_size: int = 1) -> list[int]:
        return self._store.batch_probe_key(keys, policy, candidate_size)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        if self._evictions:
            for key in self._evictions.pop(0):
                assert self._evictor.remove(key, True) == 0
        return self._store.batch_is_exist(keys)


@pytest.fixture
def filled_store(mooncake_master_factory, store_pool_factory, store_client_factory):
    master = mooncake_master_factory(default_kv_lease_ttl=30_000)
    store_pool_factory(master)
    client = store_client_factory(master)
    lookup = build_lookup(FULL_SWA, client, SELECTIVE)
    length = lookup.coord.align_lookup_length(NUM_TOKENS)
    candidates = build_candidates(lookup.groups, lookup.lookup_chunk_hashes(lookup.groups, length, HASHES)).keys
    for key in candidates:
        assert client.put(key, b"kv" * 64) == 0
    return master, client, store_client_factory(master), list(candidates)


def leased(client: Any, keys: list[str]) -> set[str]:
    return {key for key in keys if client.remove(key) == LEASED}


def test_selective_lookup_leases_only_what_the_load_reads(filled_store):
    _, client, _, candidates = filled_store
    worker = build_lookup(FULL_SWA, client, SELECTIVE)
    result = worker.lookup(NUM_TOKENS, HASHES)
    assert result.hit_length > 0
    reads = keys_the_load_reads(worker, HASHES, result)
    assert reads and reads < set(candidates), "a sliding window reads fewer keys than it probes"
    assert leased(client, candidates) == reads  # exactly the load set; the rest was removable


def test_eviction_between_probe_and_lease_gives_a_shorter_fully_leased_hit(filled_store):
    _, client, evictor, candidates = filled_store
    full = build_lookup(FULL_SWA, client, SELECTIVE)
    first_reads = sorted(keys_the_load_reads(full, HASHES, full.lookup(NUM_TOKENS, HASHES)))
    victim = next(key for key in first_reads if "group:0" in key and key.endswith(HASHES[8].hex()))
    for key in candidates:  # drop the first lookup's leases so the second starts clean
        client.remove(key, True)
        client.put(key, b"kv" * 64)

    store = EvictingStore(client, evictor, [{victim}])
    worker = build_lookup(FULL_SWA, store, SELECTIVE)
    result = worker.lookup(NUM_TOKENS, HASHES)
    assert 0 < result.hit_length <= 8 * HASH_BLOCK
    reads = keys_the_load_reads(worker, HASHES, result)
    assert reads <= leased(client, candidates)
    assert result.outcome.miss_reason is None and result.outcome.rounds == 2


def test_continued_eviction_gives_no_hit(filled_store):
    _, client, evictor, candidates = filled_store
    evictions = [{k for k in candidates if k.endswith(HASHES[i].hex())} for i in (12, 6, 2, 0)]
    store = EvictingStore(client, evictor, evictions)
    worker = build_lookup(FULL_SWA, store, SELECTIVE)
    result = worker.lookup(NUM_TOKENS, HASHES)
    assert result.hit_length == 0
    assert result.outcome.miss_reason is MissReason.LEASE_LOST


def test_a_raising_lease_rpc_is_a_miss(filled_store):
    _, client, _, _ = filled_store

    class LeaseFails(EvictingStore):
        def batch_is_exist(self, keys: list[str]) -> list[int]:
            raise RuntimeError("connection reset by master")

    operations = OperationRecorder()
    worker = build_lookup(FULL_SWA, LeaseFails(client, client, []), SELECTIVE, record=operations)
    result = worker.lookup(NUM_TOKENS, HASHES)
    assert result.hit_length == 0
    assert result.outcome.miss_reason is MissReason.STORE_ERROR
    status = {record["operation"]: record["status"] for record in operations.records}
    assert status == {"lookup_probe": "ok", "lookup_lease": "error"}


def test_start_up_refuses_selective_lease_on_a_0_3_13_client(mooncake_master_factory, store_pool_factory,
                                                              store_client_factory):
    master = mooncake_master_factory(version=OLD_VERSION)
    store_pool_factory(master)
    old = store_client_factory(master, version=OLD_VERSION)
    capabilities = detect_capabilities(old)
    problem = missing_capability(LeaseMode.SELECTIVE, capabilities)
    assert problem is not None and "Mooncake >= 0.3.14 on the master and every client" in problem
    assert missing_capability(LeaseMode.LEASE_ALL, capabilities) is None

    closed = []
    with pytest.raises(ConnectorConfigError, match="batch_probe_key"):
        refuse_unsupported_mode(SELECTIVE, capabilities, release=lambda: closed.append(True))
    assert closed == [True], "the store handle is released before start-up fails"
