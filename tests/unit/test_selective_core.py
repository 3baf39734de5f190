"""Selective lease's pure protocol on hand-computed scenarios (seed 002's list)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from moonlease_connector.core.lookup import GroupNamespaces, MissReason, TailKey, build_candidates
from moonlease_connector.core.selective import LoadPlan, build_load_plan, lease_selectively

pytestmark = pytest.mark.unit

H = [bytes([i]) * 4 for i in range(12)]
FULL = GroupNamespaces(0, 16, ("f",))
SWA = GroupNamespaces(1, 16, ("w",))


def key(prefix: str, index: int) -> str:
    return f"{prefix}@{H[index].hex()}"


class Store:
    """Keys that exist, a probe that leases nothing, a lease that can lose keys on the way."""

    def __init__(self, existing: set[str], evict_before_lease: Sequence[set[str]] = ()) -> None:
        self.existing = set(existing)
        self.evictions = list(evict_before_lease)
        self.leased: set[str] = set()
        self.probes: list[list[str]] = []
        self.leases: list[list[str]] = []

    def probe(self, keys: Sequence[str]) -> list[int]:
        self.probes.append(list(keys))
        return [1 if k in self.existing else 0 for k in keys]

    def lease(self, keys: Sequence[str]) -> list[int]:
        if self.evictions:
            self.existing -= self.evictions.pop(0)
        self.leases.append(list(keys))
        answers = [1 if k in self.existing else 0 for k in keys]
        self.leased.update(k for k, a in zip(keys, answers) if a == 1)
        return answers


def full_attention_prefix_hit(present: frozenset) -> int:
    """The hit rule of a lone full-attention group: the longest present prefix, in tokens."""
    length = 0
    while length < len(H) and (0, H[length]) in present:
        length += 1
    return length * 16


def plan_full(hit: int, present: frozenset) -> LoadPlan:
    chunks = hit // 16
    return build_load_plan([FULL], {0: [True] * chunks}, H, 16, hit, present)


def run(store: Store, chunks: int = 8, max_rounds: int = 3):
    candidates = build_candidates([FULL], {0: H[:chunks]})
    return lease_selectively(candidates, probe=store.probe, lease=store.lease,
                             hit_for=full_attention_prefix_hit, plan_for=plan_full,
                             max_rounds=max_rounds)


def test_without_eviction_one_round_leases_exactly_the_load_set() -> None:
    store = Store({key("f", i) for i in range(6)})
    result = run(store)
    assert result.hit_length == 96
    assert store.leased == {key("f", i) for i in range(6)}
    assert len(store.probes) == 1 and len(store.leases) == 1
    assert result.outcome.rounds == 1 and result.outcome.keys_leased == 6
    assert result.outcome.keys_probed == 8


def test_eviction_between_probe_and_lease_gives_a_shorter_fully_leased_hit() -> None:
    store = Store({key("f", i) for i in range(6)}, evict_before_lease=[{key("f", 3)}])
    result = run(store)
    assert result.hit_length == 48
    assert result.outcome.rounds == 2
    assert {key("f", i) for i in range(3)} <= store.leased
    assert store.leases[-1] == [key("f", i) for i in range(3)]


def test_continued_eviction_gives_no_hit() -> None:
    store = Store({key("f", i) for i in range(6)},
                  evict_before_lease=[{key("f", 5)}, {key("f", 2)}, {key("f", 0)}])
    result = run(store, max_rounds=3)
    assert result.plan is None and result.hit_length == 0
    assert result.outcome.miss_reason is MissReason.LEASE_LOST


def test_rounds_are_bounded() -> None:
    store = Store({key("f", i) for i in range(6)},
                  evict_before_lease=[{key("f", 5)}, {key("f", 4)}, {key("f", 3)}])
    result = run(store, max_rounds=2)
    assert result.outcome.miss_reason is MissReason.LEASE_LOST and len(store.leases) == 2


def test_nothing_in_the_store_is_a_plain_miss_without_a_lease() -> None:
    store = Store(set())
    result = run(store)
    assert result.outcome.miss_reason is MissReason.NOT_FOUND and store.leases == []


@pytest.mark.parametrize("failure", ["probe-raises", "probe-error-code", "lease-raises", "lease-error-code"])
def test_errors_are_misses(failure: str) -> None:
    store = Store({key("f", i) for i in range(6)})
    probe, lease = store.probe, store.lease
    if failure == "probe-raises":
        probe = lambda keys: None  # noqa: E731 - StoreCalls turns a raising RPC into None
    elif failure == "probe-error-code":
        probe = lambda keys: [1, -600] + [1] * (len(keys) - 2)  # noqa: E731
    elif failure == "lease-raises":
        lease = lambda keys: None  # noqa: E731
    else:
        lease = lambda keys: [-706] + [1] * (len(keys) - 1)  # noqa: E731
    candidates = build_candidates([FULL], {0: H[:8]})
    result = lease_selectively(candidates, probe=probe, lease=lease,
                               hit_for=full_attention_prefix_hit, plan_for=plan_full, max_rounds=3)
    assert result.plan is None and result.outcome.miss_reason is MissReason.STORE_ERROR


def test_load_plan_reads_only_the_masked_chunks_of_each_group() -> None:
    present = frozenset({(0, H[i]) for i in range(4)} | {(1, H[i]) for i in range(4)})
    # A 32-token window at a 64-token hit keeps the last two sliding-window chunks.
    plan = build_load_plan([FULL, SWA], {0: [True] * 4, 1: [False, False, True, True]}, H, 16, 64,
                           present)
    assert list(plan.keys) == [key("f", 0), key("f", 1), key("f", 2), key("f", 3),
                                          key("w", 2), key("w", 3)]
    assert plan.tails == (TailKey(0, 64), TailKey(1, 64))


def test_load_plan_reads_the_tail_block_under_its_stored_hash() -> None:
    big = GroupNamespaces(0, 64, ("p", "q"))  # 64-token blocks stored under the block's last hash
    present = frozenset({(0, H[3])})
    plan = build_load_plan([big], {0: [True]}, H, 16, 32, present)
    assert list(plan.keys) == [key("p", 3), key("q", 3)]
    assert plan.tails == (TailKey(0, 64),)


def test_max_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        run(Store(set()), max_rounds=0)
