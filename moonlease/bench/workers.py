"""Lookup workers built around vLLM's real coordinator, without an engine.

`build_worker(cls, layout, store)` gives an upstream `MooncakeStoreWorker` or our
`MoonleaseStoreWorker` with only what `lookup` reads: the coordinator of the named group
layout, rank namespaces, and a store handle (an in-memory store, a recorder in unit tests, a
real Mooncake client in store tests and `moonlease bench replay`). Product code of the replay
benchmark; the tests import it from here (`tests/support/lookup_workers.py` adds test-only
recorders).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

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

from moonlease_connector.adapters.mooncake_store import ProbeContractDetector, StoreCalls
from moonlease_connector.adapters.vllm_metrics import LOOKUPS_KEY, MoonleaseConnectorStats
from moonlease_connector.adapters.vllm_worker import MoonleaseStoreWorker
from moonlease_connector.config import LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.capabilities import StoreCapabilities
from moonlease_connector.core.last_hit import LAST_HIT_ONLY_POLICY

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
]


def build_worker(cls: type, layout: Layout, store: Any,
                 config: MoonleaseConnectorConfig | None = None, *,
                 retention_interval: int | None = None) -> Any:
    """`retention_interval` only matters to saves (an engine's default is 0: sparse)."""
    groups = [KVCacheGroupSpec(layer_names=[f"layer{i}"], kv_cache_spec=spec)
              for i, spec in enumerate(layout.specs)]
    coord = MooncakeStoreCoordinator(groups, layout.scheduler_block, HASH_BLOCK,
                                     use_eagle=layout.eagle,
                                     retention_interval=retention_interval,
                                     enable_partial_hash_hits=layout.partial_hits)
    worker = object.__new__(cls)
    worker._capacity_only = False
    worker.coord = coord
    worker._kv_cache_groups = coord.kv_cache_groups
    worker.token_dbs = [SimpleNamespace(block_size=spec.block_size) for spec in layout.specs]
    worker._lookup_key_prefixes = tuple(
        tuple(f"tiny@tp_rank:{rank}@pcp0@dcp0@pp_rank:0@group:{group}" for rank in range(count))
        for group, count in enumerate(layout.namespaces))
    worker.hash_block_size = HASH_BLOCK
    worker.store = store
    worker._kv_connector_stats_lock = threading.Lock()
    worker.kv_connector_stats = MoonleaseConnectorStats()
    if cls is MoonleaseStoreWorker:
        worker.moonlease_config = config or MoonleaseConnectorConfig()
        worker.store_calls = StoreCalls(store, worker._record_kv_connector_operation)
        worker.probe_contract = ProbeContractDetector(store)  # detects on first use
    return worker


def keys_the_load_reads(worker: Any, block_hashes: list[bytes], result: Any) -> set[str]:
    """Every key the receiver reads to load `result`, across all rank namespaces.

    An independent reading of upstream's receive path (KVCacheStoreRecvingThread): chunks from
    upstream's `ChunkedTokenDatabase.process_tokens`, kept by `coord.load_mask`, the chunk that
    ends the hit keyed at its tail boundary.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import ChunkedTokenDatabase

    hit = result.hit_length
    if hit <= 0:
        return set()
    masks = worker.coord.load_mask(block_hashes, hit)
    tails = {boundary.group_id: boundary.num_tokens for boundary in result.tail_key_boundaries}
    keys: set[str] = set()
    for group, db in enumerate(worker.token_dbs):
        if not worker._kv_cache_groups[group].kv_cache_spec.prefix_cacheable:
            continue
        database = SimpleNamespace(block_size=db.block_size, hash_block_size=worker.hash_block_size)
        for start, end, chunk_hash in ChunkedTokenDatabase.process_tokens(database, hit, block_hashes):
            chunk = start // db.block_size
            if chunk >= len(masks[group]) or not masks[group][chunk]:
                continue
            if end == hit and group in tails:
                chunk_hash = block_hashes[tails[group] // worker.hash_block_size - 1]
            keys.update(f"{prefix}@{bytes(chunk_hash).hex()}" for prefix in worker._lookup_key_prefixes[group])
    return keys


def layout_by_name(name: str) -> Layout:
    for layout in LAYOUTS:
        if layout.name == name:
            return layout
    raise ValueError(f"unknown layout {name!r}; known: {', '.join(l.name for l in LAYOUTS)}")


def build_mode_worker(layout: Layout, store: Any, lease_mode: LeaseMode, *,
                      junction_retention: bool = False,
                      retention_interval: int | None = None) -> MoonleaseStoreWorker:
    """Our worker in one lease mode over `store`, as `MoonleaseStoreWorker.__init__` would set it.

    Capabilities are those of a Mooncake 0.3.14 client; the `LastHitOnly` response contract is
    detected from the store as the worker does (the in-memory stores answer per key). `retention_interval` is read only by saves (store
    masks); lookups always ask about every boundary (upstream).
    """
    config = MoonleaseConnectorConfig.for_mode(lease_mode, junction_retention=junction_retention)
    worker: MoonleaseStoreWorker = build_worker(MoonleaseStoreWorker, layout, store, config,
                                                retention_interval=retention_interval)
    worker.capabilities = StoreCapabilities("0.3.14", True, ("none", LAST_HIT_ONLY_POLICY))
    if lease_mode is LeaseMode.LAST_HIT_ONLY:
        worker.probe_contract.detect()
    return worker


def last_outcome(worker: MoonleaseStoreWorker) -> dict[str, Any]:
    """The lookup record our stats keep (and drain them, so they never pile up)."""
    stats = worker.get_kv_connector_stats()
    assert stats is not None, "every lookup records an outcome"
    return stats.data[LOOKUPS_KEY][-1]
