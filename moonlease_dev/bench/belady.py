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
                 sizes: Mapping[str, int] | None = None, default_size: int = 1, *,
                 compact_above: int = 4096) -> None:
        self.capacity_bytes = capacity_bytes
        self.present: set[str] = set()
        self.used_bytes = 0
        self.evictions = 0
        self._reads = read_index
        self._sizes = sizes or {}
        self._default_size = default_size
        self._next: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []  # (-next read, key); stale entries skipped
        self._compact_above = compact_above  # stale heap entries tolerated beyond 4 per live key

    def size_of(self, key: str) -> int:
        return self._sizes.get(key, self._default_size)

    def next_read(self, key: str, after: int) -> float:
        steps = self._reads.get(key, ())
        position = bisect.bisect_right(steps, after)
        return steps[position] if position < len(steps) else NEVER

    def touch(self, keys: Sequence[str], step: int) -> None:
        """Request `step` read these keys: their next read moves past it."""
        present, reads, upcoming, heap = self.present, self._reads, self._next, self._heap
        for key in keys:
            if key in present:
                # `next_read` and `_push` inlined: this loop runs once per key read of the trace.
                steps = reads.get(key, ())
                position = bisect.bisect_right(steps, step)
                after = steps[position] if position < len(steps) else NEVER
                upcoming[key] = after
                heapq.heappush(heap, (-after, key))
        self._compact()

    def admit(self, keys: Sequence[str], step: int) -> None:
        """Write `keys` (request `step`'s save), then evict down to capacity."""
        present, reads, upcoming, heap = self.present, self._reads, self._next, self._heap
        sizes, default_size = self._sizes, self._default_size
        for key in keys:
            if key not in present:
                present.add(key)
                self.used_bytes += sizes.get(key, default_size)
            steps = reads.get(key, ())
            position = bisect.bisect_right(steps, step)
            after = steps[position] if position < len(steps) else NEVER
            upcoming[key] = after
            heapq.heappush(heap, (-after, key))
        while self.used_bytes > self.capacity_bytes and heap:
            negative_next, key = heapq.heappop(heap)
            if key not in present or upcoming[key] != -negative_next:
                continue  # stale entry
            present.discard(key)
            self.used_bytes -= sizes.get(key, default_size)
            self.evictions += 1
        self._compact()

    def _compact(self) -> None:
        """Drop stale heap entries once they outnumber the live ones (every read pushes one).

        Rebuilt from each present key's current next read, the heap pops the same keys in the
        same order (ties by key) as the lazy one would: only memory and log-size change.
        """
        if len(self._heap) > 4 * len(self.present) + self._compact_above:
            self._heap = [(-self._next[key], key) for key in self.present]
            heapq.heapify(self._heap)


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
