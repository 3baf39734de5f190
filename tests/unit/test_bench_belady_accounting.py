"""Belady's MIN (pure) and the replay's miss-age accounting (pure)."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moonlease_dev.bench.accounting import (
    LookupCosts,
    RequestAccount,
    age_bucket,
    state_age,
    summarize_hits,
)
from moonlease_dev.bench.belady import BeladyStore, build_read_index, count_key_hits
from moonlease_dev.bench.stats import percentile

pytestmark = pytest.mark.unit


def one_read_per_step(sequence: str) -> tuple[list[list[str]], list[list[str]]]:
    return [[key] for key in sequence], [[] for _ in sequence]


def test_textbook_min_on_three_frames_with_bypass():
    # Silberschatz's reference string with 3 frames: OPT (which must load every missed page)
    # faults 9 times in 20. MIN with bypass faults 8: at the 8th reference, 4 is never read
    # again, so it is not kept (OPT evicts 0 for it, and faults on 0 later).
    reads, writes = one_read_per_step("70120304230321201701")
    assert count_key_hits(reads, writes, capacity_bytes=3) == 20 - 8


def test_keys_never_read_again_go_first_even_the_one_just_written():
    store = BeladyStore(2, build_read_index([["a"], [], ["a"], ["b"]]))
    store.admit(["a", "b"], 0)
    store.admit(["c"], 1)  # c is never read: bypassed, a and b stay
    assert store.present == {"a", "b"}
    assert store.evictions == 1


def test_sizes_count_in_bytes():
    store = BeladyStore(10, build_read_index([[], ["big"], ["small"]]), sizes={"big": 8, "small": 4})
    store.admit(["big", "small"], 0)
    # 12 bytes > 10: drop the one read later (small, step 2).
    assert store.present == {"big"} and store.used_bytes == 8


def lru_hits(reads: list[list[str]], capacity: int) -> int:
    cache: OrderedDict[str, None] = OrderedDict()
    hits = 0
    for keys in reads:
        for key in keys:
            if key in cache:
                hits += 1
                cache.move_to_end(key)
            else:
                cache[key] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=60), st.integers(1, 6))
def test_min_never_has_fewer_key_hits_than_lru(sequence, capacity):
    reads = [[str(key)] for key in sequence]
    writes: list[list[str]] = [[] for _ in sequence]
    assert count_key_hits(reads, writes, capacity) >= lru_hits(reads, capacity)


def test_min_beats_lru_on_a_scan():
    reads = [[str(k)] for k in list(range(5)) * 4]
    assert lru_hits(reads, 4) == 0 < count_key_hits(reads, [[] for _ in reads], 4)


def test_capacity_is_never_exceeded_after_a_save():
    rng = random.Random(4)
    reads = [[str(rng.randrange(30)) for _ in range(3)] for _ in range(200)]
    store = BeladyStore(40, build_read_index(reads), default_size=3)
    for step, keys in enumerate(reads):
        store.touch(keys, step)
        store.admit(keys, step)
        assert store.used_bytes <= 40
        assert store.used_bytes == 3 * len(store.present)


def run_min(reads: list[list[str]], writes: list[list[str]], sizes: dict[str, int], capacity: int,
            compact_above: int) -> tuple[list[frozenset[str]], int, int]:
    """MIN over a trace: what it holds after each step, its evictions and its largest heap."""
    store = BeladyStore(capacity, build_read_index(reads), sizes, compact_above=compact_above)
    held, largest = [], 0
    for step, (read, write) in enumerate(zip(reads, writes, strict=True)):
        store.touch(read, step)
        largest = max(largest, len(store._heap))
        store.admit(write, step)
        largest = max(largest, len(store._heap))
        held.append(frozenset(store.present))
    return held, store.evictions, largest


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 15), max_size=5), st.lists(st.integers(0, 15), max_size=5)),
                min_size=1, max_size=80),
       st.integers(1, 12), st.integers(0, 3))
def test_compacting_the_heap_keeps_every_decision(steps, capacity, seed):
    # Dropping stale heap entries (rebuilt from each present key's next read) must evict the
    # same keys at the same steps as the lazy heap that never drops them.
    rng = random.Random(seed)
    sizes = {str(key): rng.choice((1, 2, 4)) for key in range(16)}
    reads = [[str(key) for key in read] for read, _ in steps]
    writes = [[str(key) for key in write] for _, write in steps]
    lazy = run_min(reads, writes, sizes, capacity, compact_above=10**9)
    eager = run_min(reads, writes, sizes, capacity, compact_above=0)
    assert eager[:2] == lazy[:2]


def test_the_heap_stays_bounded_by_the_keys_held():
    # Every read pushes an entry: without compaction the heap grows with the trace's reads,
    # with it at most ~4 entries per key held (plus the allowance) survive a step.
    reads = [["a", "b", "c"] for _ in range(500)]
    writes = [["a", "b", "c"] for _ in range(500)]
    *_, lazy_largest = run_min(reads, writes, {}, 3, compact_above=10**9)
    *_, eager_largest = run_min(reads, writes, {}, 3, compact_above=0)
    assert lazy_largest > 2000 and eager_largest <= 4 * 3 + 3


@pytest.mark.parametrize("age, bucket", [
    (0.0, "< 2 min"), (119.999, "< 2 min"), (120.0, "2-10 min"), (599.9, "2-10 min"),
    (600.0, "> 10 min"), (86400.0, "> 10 min")])
def test_age_buckets_are_seed_002s(age, bucket):
    assert age_bucket(age) == bucket


def test_negative_age_is_a_bug():
    with pytest.raises(ValueError):
        age_bucket(-1.0)


def test_state_age_is_that_of_its_stalest_key():
    last_use = {"a": 100.0, "b": 40.0, "c": 900.0}
    assert state_age(["a", "b"], last_use, 1000.0) == 960.0
    assert state_age(["c"], last_use, 1000.0) == 100.0
    assert state_age([], last_use, 1000.0) is None


def test_summary_adds_up_and_clamps_hits_above_ideal():
    accounts = [RequestAccount(100, 80, 80, 10.0), RequestAccount(100, 80, 20, 200.0),
                RequestAccount(200, 150, 0, 4000.0), RequestAccount(50, 0, 0, None),
                RequestAccount(50, 10, 20, 5.0)]
    summary = summarize_hits(accounts)
    assert (summary.prompt_tokens, summary.hit_tokens, summary.ideal_tokens) == (500, 120, 320)
    assert summary.missed_by_age == {"< 2 min": 0, "2-10 min": 60, "> 10 min": 150}
    assert summary.missed_points() == {"< 2 min": 0.0, "2-10 min": 12.0, "> 10 min": 30.0}
    assert summary.above_ideal == 1
    assert summary.hit_rate == pytest.approx(0.24) and summary.ideal_rate == pytest.approx(0.64)


def test_lookup_costs_summary():
    costs = LookupCosts()
    for leased, latency in ((2, 100.0), (4, 300.0), (6, 200.0)):
        costs.add(keys_leased=leased, rpcs=2, latency_us=latency)
    summary = costs.summary()
    assert summary["keys_leased_per_lookup"] == 4 and summary["rpcs_per_lookup"] == 2
    assert summary["latency_p50_us"] == 200.0 and summary["latency_p95_us"] == pytest.approx(290.0)
    assert percentile([], 50) != percentile([], 50)  # NaN when empty
