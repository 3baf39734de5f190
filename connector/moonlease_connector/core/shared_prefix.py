"""Which prefix of a prompt other prompts share: the per-prefix reuse estimate retention pins.

Pure: no vLLM, no Mooncake. The connector hands in each prompt's block hashes (vLLM's chained
block hashes: one hash names one whole prefix); the tracker remembers, per prefix, which
blocks have followed it, up to `min_continuations` (four by default).

Why. A prefix that several different continuations have followed — a system prompt many sessions
start with, the turn a sibling branch forks at — is read again by every new prompt over it,
whichever session sends it. A session's own history has one continuation (each turn extends
the previous prompt), and whether it is read again depends on that one session. So the
deepest prefix with four continuations is what retention's ``pin`` keeps through eviction,
and what ``evict`` never removes itself (`core.retention`): the store's most-shared bytes, not the bulk of every conversation — pinning
everything turns the master's eviction into strict LRU, which loses under pressure
(benchmarks/results/retention.md). Two continuations are not enough: one branch makes a
whole conversation "shared", and pinning those took room from every other (development runs
on the sliding-window trace at capacity 0.05: 38.3% against 48.0% with four, 55.4% against
59.3% beside junction retention). The estimate is local to one connector, bounded (`capacity`
prefixes, least recently seen forgotten first) and ages: a prefix nobody sends again is
forgotten, and its pins expire with the master's ``default_kv_soft_pin_ttl``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

#: Prefixes remembered by default: a few hundred thousand blocks of tracked prompts.
DEFAULT_CAPACITY = 262_144
#: Distinct continuations that make a prefix shared.
DEFAULT_MIN_CONTINUATIONS = 4


class SharedPrefixTracker:
    """Per prefix (its last block hash), the continuations seen after it (up to `min_continuations`)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY,
                 min_continuations: int = DEFAULT_MIN_CONTINUATIONS) -> None:
        if capacity < 1 or min_continuations < 2:
            raise ValueError("capacity must be at least 1 and min_continuations at least 2")
        self.capacity = capacity
        self.min_continuations = min_continuations
        self._next: OrderedDict[Hashable, tuple[Hashable, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def observe(self, block_hashes: Sequence[Hashable]) -> None:
        """Record one prompt: each of its prefixes was followed by the prompt's next block."""
        for prefix, following in zip(block_hashes, block_hashes[1:]):
            seen = self._next.pop(prefix, ())
            if following not in seen and len(seen) < self.min_continuations:
                seen = (*seen, following)
            self._next[prefix] = seen
        if block_hashes:
            self._next.setdefault(block_hashes[-1], ())
            self._next.move_to_end(block_hashes[-1])
        while len(self._next) > self.capacity:
            self._next.popitem(last=False)

    def shared_blocks(self, block_hashes: Sequence[Hashable]) -> int:
        """How many leading blocks of this prompt other prompts share: 0 when none.

        The deepest prefix of `block_hashes` after which `min_continuations` different blocks
        were seen (this prompt's own, once observed, counts as one of them).
        """
        depth = 0
        for index, prefix in enumerate(block_hashes):
            seen = self._next.get(prefix)
            if seen is None:
                break  # nothing deeper was observed along this path
            if len(seen) >= self.min_continuations:
                depth = index + 1
        return depth

    def observe_and_share(self, block_hashes: Sequence[Hashable]) -> int:
        """`observe`, then `shared_blocks`: what a save of this prompt pins."""
        self.observe(block_hashes)
        return self.shared_blocks(block_hashes)
