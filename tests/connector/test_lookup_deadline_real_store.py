"""The lookup deadline against a real Mooncake master frozen with SIGSTOP.

A real 0.3.14 client in this process, a real master and store pool on loopback. Freezing the
master holds the client's RPC (Mooncake's calls have no deadline of their own); our lookup must
miss within `mooncake_lookup_timeout_ms`, later lookups must miss at once without piling more
calls on the frozen connection, and once the master thaws lookups hit again.
"""

from __future__ import annotations

import time

import pytest

from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.lookup import MissReason
from tests.support.freeze import frozen
from tests.support.lookup_workers import HASH_BLOCK, build_lookup, layout_by_name

pytestmark = pytest.mark.store

TIMEOUT_MS = 300


@pytest.mark.parametrize("mode", [LeaseMode.LEASE_ALL, LeaseMode.SELECTIVE])
def test_a_frozen_master_gives_timely_misses_and_hits_again_after_it_thaws(
        mode, mooncake_master, store_pool, store_client_factory):
    hashes = [bytes([i, 3]) * 4 for i in range(8)]
    writer = store_client_factory(mooncake_master)
    for h in hashes:
        assert writer.put(f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h.hex()}", b"kv" * 32) == 0
    client = store_client_factory(mooncake_master)
    settings = MoonleaseConnectorConfig.for_mode(mode).model_copy(
        update={"mooncake_lookup_timeout_ms": TIMEOUT_MS})
    lookup = build_lookup(layout_by_name("full"), client, settings, keep_deadline=True)
    num_tokens = len(hashes) * HASH_BLOCK + 1
    assert lookup.lookup(num_tokens, hashes).hit_length == len(hashes) * HASH_BLOCK

    with frozen(mooncake_master.process.pid):
        started = time.monotonic()
        missed = lookup.lookup(num_tokens, hashes)
        waited = time.monotonic() - started
        assert missed.hit_length == 0 and missed.outcome.miss_reason is MissReason.STORE_TIMEOUT
        started = time.monotonic()
        again = lookup.lookup(num_tokens, hashes)
        assert again.outcome.miss_reason is MissReason.STORE_TIMEOUT
        assert time.monotonic() - started < waited + 5, "a second lookup does not wait a deadline more"
        assert lookup.deadline.busy, "the frozen call is still out (and the only one)"
    deadline = time.monotonic() + 60
    hit = 0
    while time.monotonic() < deadline:
        hit = lookup.lookup(num_tokens, hashes).hit_length
        if hit:
            break
        time.sleep(0.1)
    assert hit == len(hashes) * HASH_BLOCK, "lookups hit again once the master answers"
