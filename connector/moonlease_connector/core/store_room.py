"""Moonlease retention ``evict`` (issue 21): the connector makes room before the master must.

Pure: no vLLM, no Mooncake, no HTTP. The adapters report which keys saves touched (in prompt
order), the store's usage (the master's metrics) and the bytes a put is about to write; which
keys to remove, and how many bytes, is decided here.

Why. Above ``eviction_high_watermark_ratio`` Mooncake's master evicts in a first pass that walks
its 1,024 metadata shards and takes, per shard, the oldest lease-expired object there: with a
few objects per shard that is close to random across the store, so a conversation loses a block
somewhere in the middle (a *hole*: every token after it misses) long before it is the least
recently used (benchmarks/results/retention_capacity.md: about a fifth of the sliding-window
trace's misses at capacity 0.05). The connector knows what the master does not: which keys its
prompts used together and when. With ``evict`` on, before a save's put would take the store
above the watermark, it removes (`batch_remove`, not forced: keys under lease stay) the keys its
saves touched least recently — a conversation's keys are touched together, its first block
last, so conversations leave whole, oldest first, and the master's near-random pass has
(almost) nothing left to do.

A put that would cross the watermark frees what it needs and `slack` of the capacity beyond
(default none: one removal call per save that needs room). Freeing more keeps the store
emptier than the master would and loses hit rate (sliding-window trace at 0.05, one run each,
benchmarks/results/retention_evict.md: slack 0 and 0.003 62.1 %, 0.01 61.5 %, 0.02 61.3 %; a
first cut freeing down to 70 % with the watermark at 80 %, 57.6 %).

A shared store. The order is this connector's — unless the engines share one through the fleet
order service (`core.fleet_order`, ``mooncake_fleet_order_url``): keys other engines read are
invisible to its own. A prompt's *shared prefix* (the deepest prefix four different continuations followed, as
``pin``'s tracker estimates it: a system prompt, a branch point) is what other engines read
most, while this engine may not have sent it for a while: saves mark those keys and evict
never removes them (the master's own pass, and pin's soft pin, decide). Without that mark, per-engine evict
on a 4 prefill + 1 decode fleet at capacity 0.05 lost 6.2 points against leaseAll on the hybrid
trace; with it, it gains 2.4 and 2.8 in two sessions of three runs
(benchmarks/results/fleet_evict_shared_guard.md, fleet_hybrid_evict_shared_guard.md). On one
engine it also keeps the system prompt of an agent idle for longer than the store's horizon:
+6.1 on the hybrid trace, −2.9 on the sliding-window trace without junction retention
(retention_evict_shared_guard_single.md against retention_evict_before_guard_single.md).

Bounded: the order remembers at most `capacity` keys (the oldest are forgotten: the master
evicts those as before).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

#: Keys remembered by default (about 16 bytes of bookkeeping each beyond the key itself).
DEFAULT_CAPACITY = 1 << 20
#: Share of the store's capacity freed beyond what a put needs, once it must free anything.
DEFAULT_SLACK = 0.0


@dataclass(frozen=True)
class StoreUsage:
    """What the master reports: bytes allocated and the store's total capacity."""

    used_bytes: float
    capacity_bytes: float


def bytes_to_free(usage: StoreUsage, incoming_bytes: int, watermark: float,
                  slack: float = DEFAULT_SLACK) -> int:
    """Bytes to remove so that a put of `incoming_bytes` keeps the store at or below `watermark`.

    0 when it fits (or the usage is unknown: capacity 0); otherwise the overshoot plus `slack`
    of the capacity.
    """
    if not 0 < watermark <= 1 or slack < 0:
        raise ValueError("watermark must be in (0, 1] and slack not negative")
    if usage.capacity_bytes <= 0:
        return 0
    limit = watermark * usage.capacity_bytes
    overshoot = usage.used_bytes + incoming_bytes - limit
    if overshoot <= 0:
        return 0
    return int(overshoot + slack * usage.capacity_bytes)


class KeyOrder(Protocol):
    """What evict needs of an order: `RecencyOrder` (this connector's) or the fleet order
    service's client (one order for every engine of the store, `core.fleet_order`)."""

    #: Whether other engines decide by this order too (their loads must reach it at once).
    shared_by_fleet: bool

    def touch(self, keys: Sequence[str], sizes: Sequence[int | None] | None = None,
              shared: Collection[str] | None = None) -> None: ...

    def refresh(self, keys: Sequence[str]) -> int: ...

    def take_oldest(self, free_bytes: int, protect: Iterable[str] = ()) -> list[tuple[str, int]]: ...

    def keep(self, keys: Iterable[tuple[str, int]]) -> None: ...

    def close(self) -> None: ...


class RecencyOrder:
    """The keys this connector's saves touched and its loads read, least recently used first,
    with their sizes."""

    shared_by_fleet = False

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._order: OrderedDict[str, int] = OrderedDict()
        self._shared: set[str] = set()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def size_of(self, key: str) -> int | None:
        return self._order.get(key)

    def touch(self, keys: Sequence[str], sizes: Sequence[int | None] | None = None,
              shared: Collection[str] | None = None) -> None:
        """Mark `keys` (in prompt order) used now: the first key ends most recent.

        So when eviction reaches a conversation it removes its last blocks first, and a prefix
        the conversation shares with others (touched by them too) last. A size of None keeps
        the size already known (or the mean of the known ones, for a key never put here).
        `shared`: those of `keys` in the prompt's shared prefix; `take_oldest` leaves them to
        the master until a touch no longer names them shared (None: a read that does not
        know, each key stays as it was).
        """
        if shared is not None and not isinstance(shared, (set, frozenset)):
            shared = set(shared)
        for index in range(len(keys) - 1, -1, -1):
            key = keys[index]
            size = sizes[index] if sizes is not None else None
            known = self._order.pop(key, None)
            self._order[key] = size if size is not None else (known if known is not None else self._mean())
            if shared is None:
                continue
            if key in shared:
                self._shared.add(key)
            else:
                self._shared.discard(key)
        while len(self._order) > self.capacity:
            key, _ = self._order.popitem(last=False)
            self._shared.discard(key)

    def refresh(self, keys: Sequence[str]) -> int:
        """Mark those of `keys` (prompt order) this order already holds used now, as `touch`
        would; others are left out (a load reading another engine's keys does not make them
        this connector's to remove). Shared marks stay. Returns how many were refreshed."""
        refreshed = 0
        for index in range(len(keys) - 1, -1, -1):
            if keys[index] in self._order:
                self._order.move_to_end(keys[index])
                refreshed += 1
        return refreshed

    def is_shared(self, key: str) -> bool:
        return key in self._shared

    @property
    def shared_count(self) -> int:
        return len(self._shared)

    def _mean(self) -> int:
        if not self._order:
            return 0
        # The sizes of the few most recent keys: cheap, and a store's values are of few sizes.
        recent = [size for _, size in zip(range(64), reversed(self._order.values()))]
        return sum(recent) // len(recent)

    def take_oldest(self, free_bytes: int, protect: Iterable[str] = ()) -> list[tuple[str, int]]:
        """Remove from the order, oldest first, keys worth at least `free_bytes`.

        Never `protect` nor a shared-prefix key: on a store several engines share, a prefix
        other prompts follow is read by engines whose reads this order never sees (oldest here,
        in use there). The caller removes the keys taken from the store and gives back (`keep`)
        those the store refused.
        """
        protected = set(protect)
        taken: list[tuple[str, int]] = []
        freed = 0
        for key, size in self._order.items():
            if freed >= free_bytes:
                break
            if key in protected or key in self._shared:
                continue
            taken.append((key, size))
            freed += max(size, 1)
        for key, _ in taken:
            del self._order[key]
        return taken

    def keep(self, keys: Iterable[tuple[str, int]]) -> None:
        """Keys a removal refused (under lease: in use right now): most recent again."""
        for key, size in keys:
            self._order[key] = size
            self._order.move_to_end(key)

    def close(self) -> None:
        """Nothing to let go (the fleet's client sends what it holds)."""

    def forget(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._order.pop(key, None)
            self._shared.discard(key)


@dataclass(frozen=True)
class RemovalOutcome:
    """How a removal went, per key: removed, refused (leased: kept) or already gone."""

    removed: tuple[str, ...]
    kept: tuple[tuple[str, int], ...]
    gone: tuple[str, ...]
    freed_bytes: int


#: What Mooncake's `remove` answers for an object under lease (being read): not removed
#: (../shared/NOTES.md §3).
OBJECT_HAS_LEASE = -706


def classify_removal(victims: Sequence[tuple[str, int]], answers: Sequence[int]) -> RemovalOutcome:
    """Sort `batch_remove`'s per-key answers: leased keys stay (they are in use), others are done."""
    removed, kept, gone = [], [], []
    freed = 0
    for (key, size), answer in zip(victims, answers, strict=True):
        if answer == 0:
            removed.append(key)
            freed += size
        elif answer == OBJECT_HAS_LEASE:
            kept.append((key, size))
        else:  # not found (the master evicted it) or another error: nothing to keep track of
            gone.append(key)
    return RemovalOutcome(tuple(removed), tuple(kept), tuple(gone), freed)
