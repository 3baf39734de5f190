"""Lookups built around vLLM's real coordinator, without an engine.

`build_lookup(layout, store, mode)` builds our lookup object (`vllm_lookup.StoreLookup`) from
explicit inputs, exactly as `MoonleaseStoreWorker` does; `build_upstream_lookup(layout, store)`
gives upstream's own `MooncakeStoreWorker.lookup`, the reference. The store is an in-memory
store, a recorder in unit tests, or a real Mooncake client in store tests and the benchmarks.
Product code of `moonlease bench`; the tests import it from here
(`tests/support/lookup_workers.py` adds test-only recorders).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
    MooncakeStoreCoordinator,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import (
    MooncakeStoreConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker

from moonlease_connector.adapters.mooncake_store import (
    ProbeContractDetector,
    RecordOperation,
    StoreCalls,
)
from moonlease_connector.adapters.vllm_lookup import (
    LookupInputs,
    StoreLookup,
    build_store_lookup,
    store_groups_of,
)
from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.capabilities import StoreCapabilities
from moonlease_settings.lease_modes import LAST_HIT_ONLY_POLICY
from moonlease_connector.core.lookup import GroupNamespaces

HASH_BLOCK = 16


def full_attention(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float16)


def sliding_window(window: int, block_size: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=32,
                             dtype=torch.float16, sliding_window=window)


def mamba_align(block_size: int) -> MambaSpec:
    return MambaSpec(block_size=block_size, shapes=((4,),), dtypes=(torch.float16,),
                     mamba_cache_mode="align")


@dataclass(frozen=True)
class Layout:
    """A model's KV-cache groups as the store sees them (16-token hash blocks)."""

    name: str
    specs: tuple[Any, ...]
    scheduler_block: int
    namespaces: tuple[int, ...]  # rank namespaces per group
    partial_hits: bool = False
    eagle: bool = False


LAYOUTS = [
    Layout("full", (full_attention(),), 16, (1,)),
    Layout("full-2ranks", (full_attention(),), 16, (2,)),
    Layout("full-partial", (full_attention(64),), 64, (1,), partial_hits=True),
    Layout("full+swa", (full_attention(), sliding_window(40)), 16, (1, 1)),
    Layout("full+swa-ranks", (full_attention(), sliding_window(24)), 16, (2, 1)),
    Layout("full+mamba", (full_attention(), mamba_align(64)), 64, (1, 2)),
    Layout("full+mamba-eagle", (full_attention(), mamba_align(64)), 64, (1, 1), eagle=True),
    # Tensor parallel 8 (seed 002's prefill workers): every block and state stored once per
    # rank, so a trace stores 8x the keys: production object counts in the replay.
    Layout("full+swa-tp8", (full_attention(), sliding_window(40)), 16, (8, 8)),
    Layout("full+mamba-tp8", (full_attention(), mamba_align(64)), 64, (8, 8)),
]


@dataclass(frozen=True)
class LayoutParts:
    """What a lookup over a layout reads, built once: vLLM's real coordinator and the store's
    view of the groups (rank namespaces named like upstream's keys, model "tiny")."""

    layout: Layout
    coordinator: MooncakeStoreCoordinator
    groups: tuple[GroupNamespaces, ...]
    key_prefixes: tuple[tuple[str, ...], ...]
    hash_block_size: int = HASH_BLOCK


def build_layout_parts(layout: Layout, *, retention_interval: int | None = None) -> LayoutParts:
    """`retention_interval` only matters to saves (an engine's default is 0: sparse)."""
    groups = [KVCacheGroupSpec(layer_names=[f"layer{i}"], kv_cache_spec=spec)
              for i, spec in enumerate(layout.specs)]
    coord = MooncakeStoreCoordinator(groups, layout.scheduler_block, HASH_BLOCK,
                                     use_eagle=layout.eagle,
                                     retention_interval=retention_interval,
                                     enable_partial_hash_hits=layout.partial_hits)
    prefixes = tuple(
        tuple(f"tiny@tp_rank:{rank}@pcp0@dcp0@pp_rank:0@group:{group}" for rank in range(count))
        for group, count in enumerate(layout.namespaces))
    store_groups = store_groups_of(coord.kv_cache_groups, [spec.block_size for spec in layout.specs],
                                   prefixes)
    return LayoutParts(layout, coord, store_groups, prefixes)


#: A Mooncake 0.3.14 client (per-key `LastHitOnly` answers); the in-memory stores answer alike.
CLIENT_0_3_14 = StoreCapabilities("0.3.14", True, ("none", LAST_HIT_ONLY_POLICY))


def _ignore_operation(operation: str, duration_seconds: float, num_keys: int, **_: Any) -> None:
    """Store-call records nobody reads (benchmarks count RPCs with `CountingStore`)."""


def build_lookup(layout: Layout | LayoutParts, store: Any,
                 settings: MoonleaseConnectorConfig | LeaseMode | None = None, *,
                 junction_retention: bool = False, capabilities: StoreCapabilities = CLIENT_0_3_14,
                 record: RecordOperation | None = None,
                 retention_interval: int | None = None,
                 served_by_client: bool = False) -> StoreLookup:
    """Our lookup object over `store`, built the way `MoonleaseStoreWorker` builds it.

    `settings` is a full config or just a lease mode (with `junction_retention`); `record`
    receives every store call (upstream's `_record_kv_connector_operation` signature);
    `served_by_client`: the lookup runs inline, as the worker's served through its lookup server
    (the scheduler's client holds the deadline), instead of under a deadline of its own. In
    last-hit-only mode the store's `LastHitOnly` response contract is detected from the store
    first, as the worker does (the in-memory stores answer per key, like Mooncake 0.3.14).
    """
    parts = layout if isinstance(layout, LayoutParts) else build_layout_parts(
        layout, retention_interval=retention_interval)
    if not isinstance(settings, MoonleaseConnectorConfig):
        settings = MoonleaseConnectorConfig.for_mode(settings or LeaseMode.LEASE_ALL,
                                                     junction_retention=junction_retention)
    probe_contract = ProbeContractDetector(store)
    if settings.strategy.detects_probe_contract:
        probe_contract.detect()
    return build_store_lookup(LookupInputs(
        groups=parts.groups, coordinator=parts.coordinator, hash_block_size=parts.hash_block_size,
        store_calls=StoreCalls(store, record or _ignore_operation), settings=settings,
        capabilities=capabilities, probe_contract=probe_contract,
        served_by_client=served_by_client))


def build_upstream_lookup(layout: Layout | LayoutParts, store: Any) -> Callable[[int, Any], Any]:
    """Upstream's own `MooncakeStoreWorker.lookup` over `store`: the reference lease-all.

    Upstream's worker has no constructor that skips connecting to a store, so the reference is
    assembled around its real coordinator with exactly the attributes its `lookup` (and
    `_tail_key_boundaries`) reads; the method that runs is upstream's, unchanged.
    """
    parts = layout if isinstance(layout, LayoutParts) else build_layout_parts(layout)
    reference = object.__new__(MooncakeStoreWorker)
    reference._capacity_only = False
    reference.coord = parts.coordinator
    reference._kv_cache_groups = parts.coordinator.kv_cache_groups
    reference.token_dbs = [cast(Any, SimpleNamespace(block_size=spec.block_size)) for spec in parts.layout.specs]
    reference._lookup_key_prefixes = parts.key_prefixes
    reference.hash_block_size = parts.hash_block_size
    reference.store = store
    reference._kv_connector_stats_lock = threading.Lock()
    reference.kv_connector_stats = MooncakeStoreConnectorStats()
    return reference.lookup


def keys_the_load_reads(lookup: StoreLookup | LayoutParts, block_hashes: list[Any],
                        result: Any) -> set[str]:
    """Every key the receiver reads to load `result`, across all rank namespaces.

    An independent reading of upstream's receive path (KVCacheStoreRecvingThread): chunks from
    upstream's `ChunkedTokenDatabase.process_tokens`, kept by `coord.load_mask`, the chunk that
    ends the hit keyed at its tail boundary.
    """
    return set(keys_the_load_reads_in_order(lookup, block_hashes, result))


def keys_the_load_reads_in_order(lookup: StoreLookup | LayoutParts, block_hashes: list[Any],
                                 result: Any) -> list[str]:
    """`keys_the_load_reads` in prompt order (chunk by chunk, the groups of a chunk in layout
    order): the order retention ``evict`` learns a load in, its first block ending most recent."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import ChunkedTokenDatabase

    coord = lookup.coordinator if isinstance(lookup, LayoutParts) else lookup.coord
    hit = result.hit_length
    if hit <= 0:
        return []
    masks = coord.load_mask(block_hashes, hit)
    tails = {boundary.group_id: boundary.num_tokens for boundary in result.tail_key_boundaries}
    placed: list[tuple[int, int, list[str]]] = []
    for order, group in enumerate(lookup.groups):
        database: Any = SimpleNamespace(block_size=group.block_size, hash_block_size=lookup.hash_block_size)
        mask = masks[group.group_id]
        for start, end, chunk_hash in ChunkedTokenDatabase.process_tokens(database, hit, block_hashes):
            chunk = start // group.block_size
            if chunk >= len(mask) or not mask[chunk]:
                continue
            if end == hit and group.group_id in tails:
                chunk_hash = block_hashes[tails[group.group_id] // lookup.hash_block_size - 1]
            placed.append((start, order, list(group.keys_for(bytes(chunk_hash)))))
    placed.sort(key=lambda entry: (entry[0], entry[1]))
    return list(dict.fromkeys(key for _, _, keys in placed for key in keys))  # once each, in order


def layout_by_name(name: str) -> Layout:
    for layout in LAYOUTS:
        if layout.name == name:
            return layout
    raise ValueError(f"unknown layout {name!r}; known: {', '.join(layout.name for layout in LAYOUTS)}")


