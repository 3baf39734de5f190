"""The store lookup: one object per lease mode behind a single `lookup(num_tokens, block_hashes)`.

I/O adapter: vLLM's coordinator decides hits, the store calls go through `StoreCalls`, every
other decision comes from `moonlease_connector.core`. A lookup object is built from explicit
inputs (`LookupInputs`: the store's groups, the coordinator, the store calls, the settings and
the client's capabilities) — no worker needed — so the worker, the tests and the benchmarks
build the same object with `build_store_lookup`.

One strategy per lease mode (`LeaseAllLookup`, `SelectiveLookup`, `LastHitOnlyLookup`);
junction reporting (seed 004) is orthogonal: a `JunctionFinder` any strategy consults when
junction retention is on.

A lookup object never changes after construction. To change the lease mode or a setting, the
owner builds a new one and replaces its reference in one assignment: a lookup already running
finishes on the object it started with, the next one uses the new object, and no lookup ever
sees half of each.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
    ExternalCachedBlockPool,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    BlobBlockHashes,
    MooncakeLookupResult,
    TailKeyBoundary,
)
from vllm.v1.core.kv_cache_utils import BlockHashListWithBlockSize, eagle_proof_margin
from vllm.v1.kv_cache_interface import MambaSpec

from moonlease_connector.adapters.mooncake_store import ProbeContractDetector, StoreCalls
from moonlease_connector.adapters.store_deadline import BoundedCaller, CallStatus
from moonlease_connector.adapters.vllm_specs import is_recurrent
from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.capabilities import StoreCapabilities
from moonlease_connector.core.junctions import find_junctions
from moonlease_connector.core.last_hit import legal_checkpoints
from moonlease_connector.core.lookup import (
    GroupNamespaces,
    LookupOutcome,
    MissReason,
    TailKey,
    Unit,
    build_candidates,
    build_tail_keys,
    miss_reason_of,
    present_units,
    resolve_hit,
)
from moonlease_connector.core.lookup_protocol import LookupResponse, build_wire_entries
from moonlease_connector.core.selective import LoadPlan, build_load_plan, lease_selectively

logger = logging.getLogger("vllm.moonlease.connector.lookup")

#: Distinct (hit, prompt length) pairs whose load masks, lookup lengths whose lookup masks, and
#: (step, bound, lookup length) triples whose legal checkpoints a lookup object remembers.
LOAD_MASK_MEMO_SIZE = 1024

#: A hit rule: the hit vLLM's coordinator reports when exactly these units are present.
HitRule = Callable[[frozenset[Unit]], int]


@dataclass(frozen=True)
class LookupInputs:
    """Everything a lookup reads, stated explicitly (the worker gathers it once)."""

    #: The prefix-cacheable groups, with the rank namespaces a load reads.
    groups: tuple[GroupNamespaces, ...]
    #: vLLM's `MooncakeStoreCoordinator`: lookup masks, chunk hashes and the hit rule.
    coordinator: Any
    hash_block_size: int
    store_calls: StoreCalls
    settings: MoonleaseConnectorConfig
    capabilities: StoreCapabilities
    #: True when every lookup comes through the scheduler's lookup client, which bounds the wait
    #: (`BoundedLookupClient`): the lookup then runs inline, with no deadline of its own.
    served_by_client: bool = False
    #: The deadline an in-process lookup (no client in front) runs under, shared by the lookup
    #: objects of one worker so at most one abandoned store call exists; None builds one from
    #: the settings (`lookup_deadline_for`).
    deadline: BoundedCaller | None = None
    #: Last-hit-only (required there): reads LastHitOnly answers under the store's detected
    #: response contract (the worker's detector, kept across lookup objects).
    probe_contract: ProbeContractDetector | None = None


@dataclass(frozen=True)
class LookupAnswer:
    """What one lookup answers (upstream's type, junctions as sentinel entries) and did."""

    result: MooncakeLookupResult
    outcome: LookupOutcome

    @property
    def hit_length(self) -> int:
        return int(self.result.hit_length)

    @property
    def tail_key_boundaries(self) -> tuple[TailKeyBoundary, ...]:
        return tuple(self.result.tail_key_boundaries)


def store_groups_of(kv_cache_groups: Sequence[Any], block_sizes: Sequence[int],
                    key_prefixes: Sequence[Sequence[str]]) -> tuple[GroupNamespaces, ...]:
    """The prefix-cacheable groups with their block sizes and the rank namespaces a load reads
    (upstream's worker skips the other groups in lookups, saves and loads)."""
    return tuple(
        GroupNamespaces(group_id, block_sizes[group_id], tuple(key_prefixes[group_id]),
                        is_recurrent=is_recurrent(group.kv_cache_spec))
        for group_id, group in enumerate(kv_cache_groups)
        if group.kv_cache_spec.prefix_cacheable)


class PresentPool(ExternalCachedBlockPool):
    """Upstream's pool of present `(group, hash)` units, asked the same questions faster.

    Same answers as `ExternalCachedBlockPool` (a hash is cached for a group when the unit is
    present). The coordinator asks once per block and group in every pass; this skips
    upstream's per-question generator and bytes copy, and shares the caller's frozen set
    instead of copying it.
    """

    def __init__(self, hash_block_size: int, present: frozenset[Unit]) -> None:
        super().__init__(hash_block_size, present)  # type: ignore[arg-type]  # read-only use

    def get_cached_block(self, block_hash: Any, group_ids: list[int]) -> list[Any] | None:
        chunk_hash = block_hash if type(block_hash) is bytes else bytes(block_hash)
        present = self._exists
        for group_id in group_ids:
            if (group_id, chunk_hash) not in present:  # type: ignore[operator]
                return None
        return [self._present_block] * len(group_ids)


def _first_chunk_hashes(group_hashes: Sequence[Any], chunks: int) -> list[bytes]:
    """The first `chunks` chunk hashes of vLLM's per-group view, as `bytes`, read in one slice.

    vLLM's chunk view (`chunk_hashes_for_block_size`: a `BlockHashListWithBlockSize`) keys
    chunk `c` by hash `(c + 1) * scale_factor - 1` of the hash-block list it wraps; a stepped
    slice of that list reads the same hashes without a Python call per chunk. The lookup
    server's hashes (`BlobBlockHashes`, one flat buffer) are cut from one copy of the buffer
    instead of one memoryview and one `bytes` per hash; a list of `bytes` (vLLM's request
    hashes) is used as it is. Any other view is read through its own indexing.
    """
    source: Sequence[Any]
    if isinstance(group_hashes, BlockHashListWithBlockSize):
        scale = group_hashes.scale_factor
        source, start, stop, step = group_hashes.block_hashes, scale - 1, chunks * scale, scale
    else:
        source, start, stop, step = group_hashes, 0, chunks, 1
    if type(source) is BlobBlockHashes:
        width = source._hash_len
        data = bytes(source._blob)
        stop = min(stop, len(source))
        return [data[index * width:(index + 1) * width] for index in range(start, stop, step)]
    sliced = source[start:stop:step]
    if type(sliced) is list and (not sliced or type(sliced[0]) is bytes):
        return cast(list[bytes], sliced)  # vLLM's block hashes are all of one type
    return list(map(bytes, sliced))


def _miss(reason: MissReason, **counts: int) -> tuple[MooncakeLookupResult, LookupOutcome]:
    return MooncakeLookupResult(0), LookupOutcome.miss(reason, **counts)


class JunctionFinder:
    """Seed 004: where the longest single-group hit stops, by vLLM's local rule."""

    def __init__(self, coordinator: Any, hash_block_size: int) -> None:
        self.coord = coordinator
        self.hash_block_size = hash_block_size

    def longest_single_group_hit(self, block_hashes: Sequence[Any], max_length: int,
                                 pool: ExternalCachedBlockPool) -> int:
        """The hit of the group vLLM's convergence loop evaluates first, at `max_length`.

        Mirrors the first step of `MooncakeStoreCoordinator._find_hit_blocks` (and of core's
        `HybridKVCacheCoordinator.find_longest_cache_hit`, whose ``longest_hit_length`` it is:
        every later step is bounded by the hit before it). With one spec group there is no
        lagging group, so no junction: 0.
        """
        coord = self.coord
        if len(coord.attention_groups) < 2:
            return 0
        spec, group_ids, manager_cls, group_eagle = coord.attention_groups[0]
        fine_grained = coord.enable_partial_hash_hits
        length = max_length
        if group_eagle and not isinstance(spec, MambaSpec):
            margin = eagle_proof_margin(spec.block_size, coord.hash_block_size,
                                        fine_grained and manager_cls.supports_fine_grained_hash_lookup)
            length = min(max_length + margin, len(block_hashes) * coord.hash_block_size)
        _, hit = manager_cls.find_longest_cache_hit(
            block_hashes=block_hashes, max_length=length, kv_cache_group_ids=group_ids,
            block_pool=pool, kv_cache_spec=spec, drop_eagle_block=group_eagle,
            alignment_tokens=coord.hash_block_size if fine_grained else coord.lcm_block_size)
        return int(hit)

    def junctions(self, num_tokens: int, block_hashes: Sequence[Any], hit_length: int,
                  present: frozenset[Unit]) -> tuple[int, ...]:
        """Bounded like core's local lookup (``num_tokens - 1``: the last token is recomputed),
        so the store and the local cache agree on where a shared prefix ends."""
        if num_tokens <= 1:
            return ()
        bound = min(num_tokens - 1, len(block_hashes) * self.hash_block_size)
        pool = PresentPool(self.hash_block_size, present)
        try:
            longest = self.longest_single_group_hit(block_hashes, bound, pool)
        except Exception:
            # A junction only helps later siblings: failing to find one must not cost this hit.
            logger.exception("Moonlease junction search failed; returning the hit without one")
            return ()
        return find_junctions(hit_length, (longest,))


def lookup_deadline_for(settings: MoonleaseConnectorConfig, *,
                        served_by_client: bool) -> BoundedCaller | None:
    """Where a lookup's deadline lives, decided once: the deadline the lookup itself runs under,
    or None when it runs inline.

    Inline when `mooncake_lookup_timeout_ms` is 0 (off: upstream's wait) or when the lookup is
    served to the scheduler's lookup client, which bounds the wait where it happens
    (`BoundedLookupClient`: past the deadline a miss, and misses at once while the worker is
    stuck) — no thread hand-off on the worker's path. A lookup called in-process with no client
    in front runs on a helper thread under the deadline (`BoundedCaller`).
    """
    timeout_ms = settings.mooncake_lookup_timeout_ms
    if not timeout_ms or served_by_client:
        return None
    return BoundedCaller(timeout_ms / 1000, name="moonlease-lookup")


class StoreLookup(ABC):
    """One lease mode's lookup. `lookup` never raises: a bug is logged and reported as a miss."""

    mode: ClassVar[LeaseMode]

    def __init__(self, inputs: LookupInputs) -> None:
        self.inputs = inputs
        self.settings = inputs.settings
        self.coord = inputs.coordinator
        self.hash_block_size = inputs.hash_block_size
        self.store_calls = inputs.store_calls
        self.capabilities = inputs.capabilities
        self.probe_contract = inputs.probe_contract
        self.groups = inputs.groups
        self._specs = {group.group_id: self.coord.kv_cache_groups[group.group_id].kv_cache_spec
                       for group in inputs.groups}
        self.junction_finder = (JunctionFinder(self.coord, self.hash_block_size)
                                if inputs.settings.finds_junctions else None)
        self.deadline = inputs.deadline if inputs.deadline is not None else lookup_deadline_for(
            inputs.settings, served_by_client=inputs.served_by_client)
        self._load_mask_memo: dict[tuple[int, int], tuple[Sequence[bool], ...]] = {}
        self._lookup_mask_memo: dict[int, tuple[tuple[bool, ...] | None, ...]] = {}

    def lookup(self, num_tokens: int, block_hashes: Sequence[Any]) -> LookupAnswer:
        """Upstream's contract: how many prefix tokens the store can load, within the deadline.

        Served to the scheduler's client, the lookup runs inline (the client bounds the wait).
        Otherwise it runs on the deadline's helper thread (Mooncake's calls block without a
        deadline of their own); past `mooncake_lookup_timeout_ms` it is a miss and the
        abandoned lookup's answer is dropped when it comes (`store_deadline`).
        """
        if self.deadline is None or not self.settings.mooncake_lookup_timeout_ms:
            return self._lookup_now(num_tokens, block_hashes)  # deadline off: upstream's wait
        timeout_s = self.settings.mooncake_lookup_timeout_ms / 1000
        call = self.deadline.call(lambda: self._lookup_now(num_tokens, block_hashes), timeout_s)
        if call.ok:
            return call.value
        if call.status is CallStatus.RAISED:  # _lookup_now catches everything; defensive only
            logger.error("Moonlease lookup failed: %r; reporting a miss", call.error)
            return LookupAnswer(*_miss(MissReason.INTERNAL_ERROR))
        if call.status is CallStatus.TIMED_OUT:
            logger.warning("Mooncake store did not answer a lookup within %d ms; reporting a miss "
                           "(later lookups miss at once until it answers)",
                           self.settings.mooncake_lookup_timeout_ms)
        return LookupAnswer(*_miss(MissReason.STORE_TIMEOUT))

    def _lookup_now(self, num_tokens: int, block_hashes: Sequence[Any]) -> LookupAnswer:
        """The lookup itself, on the calling thread. Never raises."""
        try:
            lookup_length = self.coord.align_lookup_length(num_tokens)
            if not block_hashes or lookup_length <= 0:
                result, outcome = _miss(MissReason.NO_CANDIDATES)
            else:
                result, outcome = self._lookup(num_tokens, lookup_length, block_hashes)
        except Exception:
            logger.exception("Moonlease lookup failed; reporting a miss")
            result, outcome = _miss(MissReason.INTERNAL_ERROR)
        return LookupAnswer(result, outcome)

    @abstractmethod
    def _lookup(self, num_tokens: int, lookup_length: int, block_hashes: Sequence[Any]
                ) -> tuple[MooncakeLookupResult, LookupOutcome]:
        """The mode's lookup over a non-empty, aligned prefix."""

    # Shared steps, one definition each.

    def lookup_chunk_hashes(self, groups: Sequence[GroupNamespaces], lookup_length: int,
                            block_hashes: Sequence[Any], masks: Sequence[Any] | None = None
                            ) -> dict[int, list[bytes]]:
        """Per group, the chunk hashes vLLM's lookup masks say may end a hit (upstream's).

        `masks`: `lookup_masks(lookup_length)` when the caller has it already."""
        if self.coord.enable_partial_hash_hits:
            units = min(len(block_hashes), lookup_length // self.hash_block_size)
            every = [bytes(block_hashes[i]) for i in range(units)]
            return {group.group_id: every for group in groups}
        if masks is None:
            masks = self.lookup_masks(lookup_length)
        chunk_hashes: dict[int, list[bytes]] = {}
        for group in groups:
            group_hashes = self.coord.block_hashes_for_spec(block_hashes, self._specs[group.group_id])
            chunks = min(len(group_hashes), -(-lookup_length // group.block_size))
            mask = masks[group.group_id]
            if mask is None:
                chunk_hashes[group.group_id] = _first_chunk_hashes(group_hashes, chunks)
            else:  # only the chunks the mask keeps are read (upstream's lookup reads no other hash)
                chunk_hashes[group.group_id] = [bytes(group_hashes[c]) for c in
                                                itertools.compress(range(chunks), mask)]
        return chunk_hashes

    def hit_rule(self, num_tokens: int, lookup_length: int, block_hashes: Sequence[Any]) -> HitRule:
        """vLLM's hit for a set of present units, final-token recomputation included."""
        coord = self.coord
        hash_block_size = self.hash_block_size

        def hit_for(present: frozenset[Unit]) -> int:
            pool = PresentPool(hash_block_size, present)
            return resolve_hit(num_tokens, lookup_length,
                               lambda length: coord.find_longest_cache_hit(block_hashes, length, pool)[1],
                               coord.align_lookup_length)

        return hit_for

    def longest_hit_rule(self, block_hashes: Sequence[Any]) -> Callable[[frozenset[Unit], int], int]:
        """vLLM's longest hit for a set of present units at one length: one coordinator pass
        per distinct question within a lookup (a repeated question is answered from memory)."""
        coord = self.coord
        hash_block_size = self.hash_block_size
        answered: dict[tuple[frozenset[Unit], int], int] = {}

        def longest_hit(present: frozenset[Unit], length: int) -> int:
            question = (present, length)
            hit = answered.get(question)
            if hit is None:
                hit = coord.find_longest_cache_hit(block_hashes, length,
                                                   PresentPool(hash_block_size, present))[1]
                answered[question] = hit
            return hit

        return longest_hit

    def lookup_masks(self, lookup_length: int) -> tuple[tuple[bool, ...] | None, ...]:
        """vLLM's per-group lookup masks (`coord.lookup_mask`), remembered per lookup length.

        They depend on the length and the coordinator's fixed layout only (no hash, no request),
        so a length seen before is answered from memory. Bounded; one thread at a time (as
        `load_masks`).
        """
        masks = self._lookup_mask_memo.get(lookup_length)
        if masks is None:
            masks = tuple(None if mask is None else tuple(mask)
                          for mask in self.coord.lookup_mask(lookup_length))
            if len(self._lookup_mask_memo) >= LOAD_MASK_MEMO_SIZE:
                self._lookup_mask_memo.clear()
            self._lookup_mask_memo[lookup_length] = masks
        return masks

    def load_masks(self, block_hashes: Sequence[Any], hit: int) -> tuple[Sequence[bool], ...]:
        """vLLM's per-group load masks for a hit (`coord.load_mask`), remembered per lengths.

        `load_mask` runs the hit rule over a pool where every block is present, so it reads
        no hash's value: its answer depends on `hit` and the number of hashes only, and a
        lookup object sees few distinct pairs (hits are block multiples). Bounded; a lookup
        object is used by one thread at a time (the lookup server's, or the deadline's helper).
        """
        key = (hit, len(block_hashes))
        masks = self._load_mask_memo.get(key)
        if masks is None:
            masks = tuple(tuple(mask) for mask in self.coord.load_mask(block_hashes, hit))
            if len(self._load_mask_memo) >= LOAD_MASK_MEMO_SIZE:
                self._load_mask_memo.clear()
            self._load_mask_memo[key] = masks
        return masks

    def store_junctions(self, num_tokens: int, block_hashes: Sequence[Any], hit_length: int,
                        present: frozenset[Unit]) -> tuple[int, ...]:
        """Junctions to return with a lookup (none unless junction retention is on)."""
        if self.junction_finder is None:
            return ()
        return self.junction_finder.junctions(num_tokens, block_hashes, hit_length, present)

    def _respond(self, hit: int, tails: Sequence[TailKey], junctions: tuple[int, ...],
                 outcome: LookupOutcome) -> tuple[MooncakeLookupResult, LookupOutcome]:
        """Upstream's result type; junctions ride in it as sentinel tail entries."""
        entries = build_wire_entries(LookupResponse(hit, tuple(tails), junctions))
        result = MooncakeLookupResult(hit, tuple(TailKeyBoundary(g, n) for g, n in entries))
        if junctions:
            outcome = dataclasses.replace(outcome, junctions=len(junctions))
        return result, outcome


class LeaseAllLookup(StoreLookup):
    """Upstream's lookup: one `batch_is_exist`, which leases every candidate it finds."""

    mode = LeaseMode.LEASE_ALL

    def _lookup(self, num_tokens: int, lookup_length: int, block_hashes: Sequence[Any]
                ) -> tuple[MooncakeLookupResult, LookupOutcome]:
        groups = self.groups
        candidates = build_candidates(groups, self.lookup_chunk_hashes(groups, lookup_length,
                                                                              block_hashes))
        if not candidates.keys:
            return _miss(MissReason.NO_CANDIDATES)
        answers = self.store_calls.exists_with_lease(candidates.keys)
        if answers is None:
            return _miss(MissReason.STORE_ERROR, rounds=1, keys_probed=len(candidates))
        present = present_units(candidates, answers)
        leased = answers.count(1)
        hit = self.hit_rule(num_tokens, lookup_length, block_hashes)(present)
        junctions = self.store_junctions(num_tokens, block_hashes, max(hit, 0), present)
        if hit <= 0:
            return self._respond(0, (), junctions, LookupOutcome.miss(
                miss_reason_of(answers), rounds=1, keys_probed=len(candidates), keys_leased=leased))
        tails = build_tail_keys(groups, block_hashes, self.hash_block_size, hit,
                                lambda group_id, chunk_hash: (group_id, chunk_hash) in present)
        return self._respond(hit, tails, junctions,
                             LookupOutcome(hit, None, 1, len(candidates), leased))


class SelectiveLookup(StoreLookup):
    """Seed 002: probe without a lease, decide the hit, lease only what loading it reads."""

    mode = LeaseMode.SELECTIVE

    def chunk_aligned_groups(self, lookup_masks: Sequence[Any]) -> frozenset[int]:
        """Groups whose candidates `lookup_chunk_hashes` reads as chunks 0, 1, ... in order,
        chunk `c` keyed by the hash at its end (no lookup mask, no partial-hash hits, the
        store's block size the spec's): a load plan slices their keys off the probe's."""
        if self.coord.enable_partial_hash_hits:
            return frozenset()
        return frozenset(group.group_id for group in self.groups
                         if lookup_masks[group.group_id] is None
                         and group.block_size == self._specs[group.group_id].block_size)

    def _lookup(self, num_tokens: int, lookup_length: int, block_hashes: Sequence[Any]
                ) -> tuple[MooncakeLookupResult, LookupOutcome]:
        groups = self.groups
        lookup_masks = self.lookup_masks(lookup_length)
        candidates = build_candidates(groups, self.lookup_chunk_hashes(
            groups, lookup_length, block_hashes, lookup_masks))
        if not candidates.keys:
            return _miss(MissReason.NO_CANDIDATES)
        chunk_aligned = self.chunk_aligned_groups(lookup_masks)

        def plan_for(hit: int, present: frozenset[Unit]) -> LoadPlan:
            masks = self.load_masks(block_hashes, hit)
            return build_load_plan(groups, {g.group_id: masks[g.group_id] for g in groups},
                                   block_hashes, self.hash_block_size, hit, present,
                                   candidates=candidates, chunk_aligned=chunk_aligned)

        store = self.store_calls
        selective = lease_selectively(
            candidates, probe=store.probe,
            lease=lambda keys: store.exists_with_lease(keys, operation="lookup_lease"),
            hit_for=self.hit_rule(num_tokens, lookup_length, block_hashes), plan_for=plan_for,
            max_rounds=self.settings.mooncake_max_lease_rounds)
        junctions = self.store_junctions(num_tokens, block_hashes, selective.hit_length,
                                         selective.present)
        tails = selective.plan.tails if selective.plan is not None else ()
        return self._respond(selective.hit_length, tails, junctions, selective.outcome)


class LastHitOnlyLookup(StoreLookup):
    """Seed 000: KV keys as upstream, recurrent states through one LastHitOnly probe."""

    mode = LeaseMode.LAST_HIT_ONLY

    def __init__(self, inputs: LookupInputs) -> None:
        if inputs.probe_contract is None:
            raise ValueError("last-hit-only needs a ProbeContractDetector (LookupInputs.probe_contract)")
        super().__init__(inputs)
        from moonlease_connector.adapters.vllm_last_hit import (
            check_last_hit_only_layout,
            rule_reads_off_existence,
        )

        # The layout gate again where the lookup is built (benchmarks and tests build it
        # without a worker): a model it cannot serve is refused, never a miss per lookup.
        check_last_hit_only_layout(self.coord.kv_cache_groups, {})

        #: Whole-block layouts without EAGLE: the checkpoint bound is read off the KV answers.
        self.rule_reads_off_existence = rule_reads_off_existence(self.coord)
        self._legal_memo: dict[tuple[int, int, int], tuple[int, ...]] = {}

    def legal_positions(self, step: int, bound: int, lookup_length: int,
                        recurrent_masks: Sequence[Sequence[bool]]) -> tuple[int, ...]:
        """`core.last_hit.legal_checkpoints`, remembered per (step, bound, lookup length):
        `recurrent_masks` must be the recurrent groups' `lookup_masks(lookup_length)`, which
        depend on the length alone."""
        key = (step, bound, lookup_length)
        positions = self._legal_memo.get(key)
        if positions is None:
            positions = legal_checkpoints(step, bound, recurrent_masks)
            if len(self._legal_memo) >= LOAD_MASK_MEMO_SIZE:
                self._legal_memo.clear()
            self._legal_memo[key] = positions
        return positions

    def _lookup(self, num_tokens: int, lookup_length: int, block_hashes: Sequence[Any]
                ) -> tuple[MooncakeLookupResult, LookupOutcome]:
        from moonlease_connector.adapters.vllm_last_hit import lookup_last_hit_only

        return lookup_last_hit_only(self, num_tokens, lookup_length, block_hashes, self.groups,
                                    self.longest_hit_rule(block_hashes))


#: The strategy of each lease mode.
LOOKUP_STRATEGIES: dict[LeaseMode, type[StoreLookup]] = {
    strategy.mode: strategy for strategy in (LeaseAllLookup, SelectiveLookup, LastHitOnlyLookup)
}


def build_store_lookup(inputs: LookupInputs) -> StoreLookup:
    """The lookup of `inputs.settings`' lease mode."""
    return LOOKUP_STRATEGIES[inputs.settings.lease_mode](inputs)
