"""An exact least-recently-used store for the replay: the ceiling of any recency order. Pure.

Retention ``evict`` and its fleet-order design study approximate least-recently-used eviction
through a real master, which also evicts on its own (a near-random first pass at a few objects
per metadata shard), honours leases and evicts a share of its objects per pass. This store has
none of that: after each save it drops exactly the least recently used keys until the bytes fit,
with one recency order for the whole fleet (every prefill load, save and decode load touches
it: `replay.build_recency_replay`). What it measures is how far *any* recency order could go on a trace — against Belady
(`belady.py`), which knows the future — so that a gap to Belady can be split into what a better
order could win and what needs knowledge of which conversations come back.

Options, each a design question:
- ``keep_shared``: keys of a prompt's shared prefix (the deepest prefix four continuations
  followed, `core.shared_prefix`, as ``pin`` and ``evict`` estimate it) leave only once no other
  key is left — what pin's soft pin and evict's guard aim at;
- ``free_share``: the share of the capacity kept free (evicting down to capacity x (1 - share)
  after each save) — the room an evictor that cannot act just before each put (one that runs
  after a load, on another engine) must keep for the next save.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence


class RecencyStore:
    """Bytes-bounded store evicting the least recently used key (the shared prefix last, if kept).

    `present` is the set of stored keys: hand it to an in-memory store handle so lookups see
    exactly what the store kept. Keys are touched in prompt order: the first ends most recent,
    so a conversation leaves tail first.
    """

    def __init__(self, capacity_bytes: int, sizes: Mapping[str, int], default_size: int = 1, *,
                 keep_shared: bool = False, free_share: float = 0.0) -> None:
        if not 0 <= free_share < 1:
            raise ValueError("free_share must be in [0, 1)")
        self.limit_bytes = int(capacity_bytes * (1 - free_share))
        self.keep_shared = keep_shared
        self.present: set[str] = set()
        self.used_bytes = 0
        self.evictions = 0
        self._sizes = sizes
        self._default_size = default_size
        self._plain: OrderedDict[str, None] = OrderedDict()
        self._shared: OrderedDict[str, None] = OrderedDict()

    def size_of(self, key: str) -> int:
        return self._sizes.get(key, self._default_size)

    def touch(self, keys: Sequence[str]) -> None:
        """A load read `keys` (prompt order): the stored ones are used now."""
        for key in reversed(keys):
            for order in (self._plain, self._shared):
                if key in order:
                    order.move_to_end(key)
                    break

    def admit(self, keys: Sequence[str], shared: Collection[str] = frozenset()) -> None:
        """A save wrote `keys` (prompt order; `shared`: those in the prompt's shared prefix),
        then the store evicts down to its limit."""
        for key in reversed(keys):
            if key not in self.present:
                self.present.add(key)
                self.used_bytes += self.size_of(key)
            self._plain.pop(key, None)
            self._shared.pop(key, None)
            (self._shared if self.keep_shared and key in shared else self._plain)[key] = None
        while self.used_bytes > self.limit_bytes and (self._plain or self._shared):
            key, _ = (self._plain or self._shared).popitem(last=False)
            self.present.discard(key)
            self.used_bytes -= self.size_of(key)
            self.evictions += 1

