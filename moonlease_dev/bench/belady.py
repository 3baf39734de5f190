"""Belady's clairvoyant replacement (MIN) for the replay's store. Pure.

The simulated store holds at most `capacity_bytes` of values — the real store's capacity at
its eviction watermark (segment x `eviction_high_watermark_ratio`, the most it holds before
the master evicts), so both are measured in the same bytes of the same stand-in value sizes.
After each request's save, while the store is over capacity it drops the key whose next read
is furthest in the future (never read again: first), which may be the key just written (a
bypass). A key's reads are the keys each request's *ideal* load reads (`next_reads`), known
for the whole trace in advance: that is the clairvoyance.

What it bounds, honestly:
- with equal value sizes, MIN with bypass maximizes the number of key reads that find their
  key (Belady 1966), over every policy, leases or not;
- it is a reference, not a proof, for *prompt-token* hits: a hit is prefix-contiguous and
  needs every key its load reads (a sliding-window tail, a Mamba checkpoint), so the most key
  hits need not be the most token hits, and mixed value sizes (hybrid: Mamba states are 4x
  an attention block) make furthest-next-use a heuristic. The report shows each mode next
  to it; a mode above it would show as such, not be hidden;
- it ignores leases (a leased key cannot be evicted in Mooncake) and evicts exactly down
  to capacity (Mooncake evicts `eviction_ratio` of its objects per pass), both in its favour.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Mapping, Sequence

NEVER = float("inf")


def build_read_index(reads: Sequence[Sequence[str]]) -> dict[str, list[int]]:
    """For each key, the sorted request indices whose (ideal) load reads it."""
    index: dict[str, list[int]] = {}
    for step, keys in enumerate(reads):
        for key in set(keys):
            index.setdefault(key, []).append(step)
    return index


class BeladyStore:
    """A store of bounded bytes that evicts the key read furthest in the future.

    `present` is the set of stored keys: hand it to an in-memory store handle so lookups see
    exactly what MIN kept. Call `admit(keys, step)` after request `step`'s lookup with the
    keys its save writes.
    """

    def __init__(self, capacity_bytes: int, read_index: Mapping[str, list[int]],
                 sizes: Mapping[str, int] | None = None, default_size: int = 1) -> None:
        self.capacity_bytes = capacity_bytes
        self.present: set[str] = set()
        self.used_bytes = 0
        self.evictions = 0
        self._reads = read_index
        self._sizes = sizes or {}
        self._default_size = default_size
        self._next: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []  # (-next read, key); stale entries skipped

    def size_of(self, key: str) -> int:
        return self._sizes.get(key, self._default_size)

    def next_read(self, key: str, after: int) -> float:
        steps = self._reads.get(key, ())
        position = bisect.bisect_right(steps, after)
        return steps[position] if position < len(steps) else NEVER

    def touch(self, keys: Sequence[str], step: int) -> None:
        """Request `step` read these keys: their next read moves past it."""
        for key in keys:
            if key in self.present:
                self._push(key, step)

    def admit(self, keys: Sequence[str], step: int) -> None:
        """Write `keys` (request `step`'s save), then evict down to capacity."""
        for key in keys:
            if key not in self.present:
                self.present.add(key)
                self.used_bytes += self.size_of(key)
            self._push(key, step)
        while self.used_bytes > self.capacity_bytes and self._heap:
            negative_next, key = heapq.heappop(self._heap)
            if key not in self.present or self._next[key] != -negative_next:
                continue  # stale entry
            self.present.discard(key)
            self.used_bytes -= self.size_of(key)
            self.evictions += 1

    def _push(self, key: str, step: int) -> None:
        upcoming = self.next_read(key, step)
        self._next[key] = upcoming
        heapq.heappush(self._heap, (-upcoming, key))


def count_key_hits(reads: Sequence[Sequence[str]], writes: Sequence[Sequence[str]],
                   capacity_bytes: int, sizes: Mapping[str, int] | None = None) -> int:
    """Key reads that find their key under MIN, each request reading then writing (tests)."""
    store = BeladyStore(capacity_bytes, build_read_index(reads), sizes)
    hits = 0
    for step, (read, write) in enumerate(zip(reads, writes, strict=True)):
        hits += sum(1 for key in read if key in store.present)
        store.touch(read, step)
        store.admit([*read, *write], step)
    return hits
