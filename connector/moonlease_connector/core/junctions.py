"""Junction retention (seed 004): shared-prefix junctions found by store lookups, kept by saves.

Pure: no vLLM, no Mooncake. The vLLM adapters supply per-group hits, the request's own boundary
and vLLM's per-group save masks; the decisions about junctions live here.

Why: under sparse retention (vLLM's default ``prefix_cache_retention_interval=0``) a save keeps a
sliding-window group's blocks only at the prompt's own replay boundaries. A sibling prompt that
shares an aligned prefix with a stored one finds every full-attention block of that prefix in
the store, but no sliding-window tail ending at the prefix, so its hit is 0. vLLM's local
coordinator handles the same case by pinning the "shared-prefix junction" — where the longest
single-group hit stops — so the request's own blocks at that position are kept. Here the store
lookup reports the same junction, the request's saves keep the sliding-window tail there, and
the next sibling hits in the store. Only tails at junctions are added: no dense retention.

Rules:
- junction (`find_junctions`): vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit` rule —
  the longest single-group hit when it is longer than the hit every group agrees on
  (``shared_prefix_boundary = hit + num_uncached_common_prefix_tokens``), else none;
- a request's junctions (`merge_junctions`) are core's local boundary plus the store's;
- vLLM 0.32/0.33 keep ONE ``request.shared_prefix_boundary``: it keeps core's value when core
  found one, else takes the deepest store junction (`request_boundary`), so the local cache and
  Mamba chunk stops use store junctions too; the full set travels to the save mask beside it;
- save mask (`add_junction_tails`): a group's junction tails join its mask — never on a
  recurrent (Mamba) group, whose states are stored only through exact boundary hand-offs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: One group's save mask over a run of chunks; None means "every chunk" (vLLM's sentinel).
Mask = list[bool] | None


def find_junctions(hit_length: int, single_group_hits: Iterable[int]) -> tuple[int, ...]:
    """The shared-prefix junction of a lookup: the longest single-group hit, if it is longer.

    `single_group_hits` are the hits vLLM's convergence loop saw group by group (the first
    group evaluated at the lookup's bound dominates: later groups are bounded by it).
    """
    longest = max(single_group_hits, default=0)
    return (longest,) if longest > max(hit_length, 0) else ()


def merge_junctions(local_boundary: int, store_junctions: Iterable[int]) -> tuple[int, ...]:
    """Every junction a request's saves keep tails at: core's own and the store's, sorted."""
    return tuple(sorted({j for j in (local_boundary, *store_junctions) if j > 0}))


def request_boundary(local_boundary: int, store_junctions: Iterable[int]) -> int:
    """The value for vLLM's single ``request.shared_prefix_boundary`` after a store lookup."""
    if local_boundary > 0:
        return local_boundary
    return max((j for j in store_junctions if j > 0), default=0)


@dataclass(frozen=True)
class MaskAddition:
    """Per-group save masks with junction tails added, and which chunks the junctions added.

    `added[g]` holds indices into `masks[g]` (relative to the mask's first chunk).
    """

    masks: tuple[Mask, ...]
    added: tuple[tuple[int, ...], ...]

    @property
    def num_added(self) -> int:
        return sum(len(chunks) for chunks in self.added)


def add_junction_tails(base_masks: Sequence[Mask], junction_masks: Sequence[Mask],
                       recurrent: Sequence[bool]) -> MaskAddition:
    """OR each group's junction tails into its save mask; recurrent groups keep theirs.

    `junction_masks[g]` is what the group's own reachability rule keeps for the junctions
    alone (vLLM's ``reachable_block_mask`` with the junctions as reachable boundaries). A None
    base already saves every chunk, so junctions add nothing to it; a None junction mask (the
    group keeps every block anyway) turns a sparse base dense.
    """
    if not len(base_masks) == len(junction_masks) == len(recurrent):
        raise ValueError("one base mask, junction mask and group kind per group")
    masks: list[Mask] = []
    added: list[tuple[int, ...]] = []
    for base, tails, is_recurrent in zip(base_masks, junction_masks, recurrent, strict=True):
        if is_recurrent or base is None:
            masks.append(base)
            added.append(())
            continue
        if tails is None:
            masks.append(None)
            added.append(tuple(i for i, kept in enumerate(base) if not kept))
            continue
        if len(tails) != len(base):
            raise ValueError(f"junction mask of {len(tails)} chunks for a base of {len(base)}")
        masks.append([kept or tail for kept, tail in zip(base, tails, strict=True)])
        added.append(tuple(i for i, (kept, tail) in enumerate(zip(base, tails, strict=True))
                           if tail and not kept))
    return MaskAddition(tuple(masks), tuple(added))
