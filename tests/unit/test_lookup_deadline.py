"""A lookup whose store does not answer misses within the deadline; one whose store answers
error codes is a store_error miss (unit level).

The store here blocks on an Event, standing in for a Mooncake client held by a frozen master;
the real frozen master is in tests/connector/test_lookup_deadline_real_store.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.lookup import MissReason
from tests.support.lookup_workers import HASH_BLOCK, PatternStore, build_lookup, layout_by_name

pytestmark = pytest.mark.unit


class FreezableStore(PatternStore):
    def __init__(self, answer_for):
        super().__init__(answer_for)
        self.thawed = threading.Event()
        self.thawed.set()

    def batch_is_exist(self, keys):
        self.thawed.wait()
        return super().batch_is_exist(keys)


@pytest.mark.parametrize("mode", [LeaseMode.LEASE_ALL, LeaseMode.SELECTIVE])
def test_a_frozen_store_gives_misses_within_the_deadline_and_hits_after_it_thaws(mode) -> None:
    layout = layout_by_name("full")
    hashes = [bytes([i, 7]) * 4 for i in range(8)]
    keys = {f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h.hex()}": 1 for h in hashes}
    store = FreezableStore(keys)
    settings = MoonleaseConnectorConfig.for_mode(mode).model_copy(update={"mooncake_lookup_timeout_ms": 50})
    lookup = build_lookup(layout, store, settings, keep_deadline=True)
    num_tokens = len(hashes) * HASH_BLOCK + 1
    assert lookup.lookup(num_tokens, hashes).hit_length == len(hashes) * HASH_BLOCK

    store.thawed.clear()
    started = time.monotonic()
    timed_out = lookup.lookup(num_tokens, hashes)
    assert timed_out.hit_length == 0 and timed_out.outcome.miss_reason is MissReason.STORE_TIMEOUT
    calls_before = len(store.calls)
    busy = lookup.lookup(num_tokens, hashes)
    assert busy.outcome.miss_reason is MissReason.STORE_TIMEOUT
    assert len(store.calls) == calls_before, "no second call piles up behind the frozen one"
    assert time.monotonic() - started < 30, "bounded waits (generous bound for a loaded machine)"

    store.thawed.set()
    deadline = time.monotonic() + 30
    while lookup.deadline.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lookup.lookup(num_tokens, hashes).hit_length == len(hashes) * HASH_BLOCK


class UnreachableMaster(PatternStore):
    """Answers like a Mooncake client whose master is down: -900 for every key."""

    def batch_is_exist(self, keys):
        self.calls.append(("batch_is_exist", tuple(keys)))
        return [-900] * len(keys)

    def batch_probe_key(self, keys, policy="none", candidate_size=1):
        if keys[0].startswith("moonlease-contract-probe"):
            return super().batch_probe_key(keys, policy, candidate_size)
        return [-900] * len(keys)


@pytest.mark.parametrize(("layout", "mode"), [
    ("full", LeaseMode.LEASE_ALL), ("full", LeaseMode.SELECTIVE),
    ("full+mamba", LeaseMode.LAST_HIT_ONLY)])
def test_an_unreachable_master_is_a_store_error_not_an_empty_store(layout, mode) -> None:
    hashes = [bytes([i, 8]) * 4 for i in range(8)]
    lookup = build_lookup(layout_by_name(layout), UnreachableMaster({}), mode)
    answer = lookup.lookup(len(hashes) * HASH_BLOCK - 1, hashes)
    assert answer.hit_length == 0 and answer.outcome.miss_reason is MissReason.STORE_ERROR


def test_a_zero_timeout_turns_the_deadline_off() -> None:
    """0 runs lookups inline on the caller's thread, as upstream's (no helper thread)."""
    layout = layout_by_name("full")
    hashes = [bytes([i, 6]) * 4 for i in range(4)]
    threads: list[str] = []

    class Witness(PatternStore):
        def batch_is_exist(self, keys):
            threads.append(threading.current_thread().name)
            return super().batch_is_exist(keys)

    settings = MoonleaseConnectorConfig.for_mode(LeaseMode.LEASE_ALL).model_copy(
        update={"mooncake_lookup_timeout_ms": 0})
    lookup = build_lookup(layout, Witness({}), settings, keep_deadline=True)
    assert lookup.deadline is None
    assert lookup.lookup(len(hashes) * HASH_BLOCK, hashes).outcome.miss_reason is MissReason.NOT_FOUND
    assert threads == [threading.current_thread().name]
