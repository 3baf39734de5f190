"""Default-mode lookups against a real Mooncake store lease what upstream leases.

The store itself is the witness: a key under a read lease refuses a non-forced remove (-706)
until the lease expires, so after a lookup we ask the master key by key.
"""

from __future__ import annotations

import random

import pytest

from moonlease_dev.testbed.mooncake import OLD_VERSION
from moonlease_connector.adapters.mooncake_store import detect_capabilities
from moonlease_connector.adapters.vllm_lookup import StoreLookup
from tests.support.lookup_workers import HASH_BLOCK, LAYOUTS, build_lookup

pytestmark = pytest.mark.store

LEASED = -706


def candidate_keys(lookup: StoreLookup, num_tokens: int, hashes: list[bytes]) -> list[str]:
    from moonlease_connector.core.lookup import build_candidates

    length = lookup.coord.align_lookup_length(num_tokens)
    return list(build_candidates(lookup.groups, lookup.lookup_chunk_hashes(lookup.groups, length, hashes)).keys)


@pytest.mark.parametrize("layout", [LAYOUTS[1], LAYOUTS[3], LAYOUTS[5]], ids=lambda layout: layout.name)
def test_default_lookup_leases_every_existing_candidate(layout, mooncake_master_factory,
                                                        store_pool_factory, store_client_factory):
    master = mooncake_master_factory(default_kv_lease_ttl=30_000)
    store_pool_factory(master)
    store = store_client_factory(master)
    hashes = [random.Random(7).randbytes(8) + bytes([i]) for i in range(16)]
    num_tokens = len(hashes) * HASH_BLOCK

    worker = build_lookup(layout, store)
    candidates = candidate_keys(worker, num_tokens, hashes)
    rng = random.Random(layout.name)
    stored = {key for key in candidates if rng.random() < 0.85}
    for key in stored:
        assert store.put(key, b"kv" * 64) == 0
    bystander = f"{candidates[0]}-not-a-candidate"
    store.put(bystander, b"x")

    result = worker.lookup(num_tokens, hashes)

    leased = {key for key in candidates if store.remove(key) == LEASED}
    assert leased == stored, "default mode leases exactly the existing candidates (upstream)"
    assert store.remove(bystander) == 0, "keys outside the lookup keep no lease"
    assert result.outcome.keys_leased == len(stored)
    assert result.outcome.keys_probed == len(candidates)
    assert (result.outcome.miss_reason is None) == (result.hit_length > 0)


def test_capabilities_of_the_current_client(mooncake_master, store_pool, store_client_factory):
    capabilities = detect_capabilities(store_client_factory(mooncake_master))
    assert capabilities.mooncake_version == "0.3.14"
    assert capabilities.batch_probe_key
    assert capabilities.supports("none") and capabilities.supports("LastHitOnly")


def test_capabilities_of_a_client_without_batch_probe_key(mooncake_master, store_pool,
                                                         store_client_factory):
    old = store_client_factory(mooncake_master, version=OLD_VERSION)
    capabilities = detect_capabilities(old)
    assert not capabilities.batch_probe_key
    assert not capabilities.supports("none")
