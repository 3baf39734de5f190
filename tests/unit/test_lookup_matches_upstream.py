"""Default-mode lookup is upstream's lookup: same store calls, same hit, same tail keys.

Property test over random existence patterns and group layouts, run against upstream's own
`MooncakeStoreWorker.lookup` from the installed vLLM. Both workers are built around the same
real `MooncakeStoreCoordinator`; the store is a recorder that answers from the drawn pattern
(no server is involved: this compares two pieces of lookup logic, call for call).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
    MooncakeStoreCoordinator,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from moonlease_connector.adapters.mooncake_store import StoreCalls
from moonlease_connector.adapters.vllm_metrics import MoonleaseConnectorStats
from moonlease_connector.adapters.vllm_worker import MoonleaseStoreWorker
from moonlease_connector.core.lookup import MissReason

pytestmark = pytest.mark.unit

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


class RecordingStore:
    """Answers batch_is_exist from a fixed pattern and records every call."""

    def __init__(self, answer_for: dict[str, int]) -> None:
        self.answer_for = answer_for
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.calls.append(("batch_is_exist", tuple(keys)))
        return [self.answer_for.get(key, 0) for key in keys]


def build_worker(cls: type, layout: Layout, store: RecordingStore) -> Any:
    groups = [KVCacheGroupSpec(layer_names=[f"layer{i}"], kv_cache_spec=spec)
              for i, spec in enumerate(layout.specs)]
    coord = MooncakeStoreCoordinator(groups, layout.scheduler_block, HASH_BLOCK,
                                     use_eagle=layout.eagle,
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
        worker.store_calls = StoreCalls(store, worker._record_kv_connector_operation)
    return worker


@st.composite
def lookups(draw: st.DrawFn) -> tuple[Layout, int, list[bytes], dict[str, int], int]:
    layout = draw(st.sampled_from(LAYOUTS))
    num_hashes = draw(st.integers(min_value=0, max_value=24))
    hashes = [bytes([index]) * 8 for index in range(num_hashes)]
    num_tokens = draw(st.integers(min_value=1, max_value=num_hashes * HASH_BLOCK + HASH_BLOCK))
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    # A dense prefix makes long hits likely; random holes and error codes make them end early.
    density = draw(st.sampled_from([1.0, 0.95, 0.8, 0.5]))
    return layout, num_tokens, hashes, {"density": density}, seed  # type: ignore[return-value]


def existence_pattern(keys: set[str], density: float, seed: int) -> dict[str, int]:
    import random

    rng = random.Random(seed)
    answers = {}
    for key in sorted(keys):
        roll = rng.random()
        answers[key] = 1 if roll < density else (-1 if roll > 0.98 else 0)
    return answers


def every_possible_key(worker: Any, hashes: list[bytes]) -> set[str]:
    keys = set()
    for group, prefixes in enumerate(worker._lookup_key_prefixes):
        spec = worker._kv_cache_groups[group].kv_cache_spec
        group_hashes = worker.coord.block_hashes_for_spec(hashes, spec)
        candidates = list(hashes) + [group_hashes[i] for i in range(len(group_hashes))]
        for prefix in prefixes:
            keys.update(f"{prefix}@{bytes(h).hex()}" for h in candidates)
    return keys


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lookups())
def test_default_lookup_equals_upstream(case: tuple[Layout, int, list[bytes], dict[str, float], int]) -> None:
    layout, num_tokens, hashes, knobs, seed = case
    probe = build_worker(MooncakeStoreWorker, layout, RecordingStore({}))
    pattern = existence_pattern(every_possible_key(probe, hashes), knobs["density"], seed)

    upstream_store, our_store = RecordingStore(pattern), RecordingStore(pattern)
    upstream = build_worker(MooncakeStoreWorker, layout, upstream_store).lookup(num_tokens, hashes)
    ours = build_worker(MoonleaseStoreWorker, layout, our_store).lookup(num_tokens, hashes)

    assert our_store.calls == upstream_store.calls
    assert ours.hit_length == upstream.hit_length
    assert ours.tail_key_boundaries == upstream.tail_key_boundaries


def test_a_raising_store_is_a_miss_with_a_reason() -> None:
    class Broken(RecordingStore):
        def batch_is_exist(self, keys: list[str]) -> list[int]:
            raise RuntimeError("master unreachable")

    worker = build_worker(MoonleaseStoreWorker, LAYOUTS[0], Broken({}))
    hashes = [bytes([i]) * 8 for i in range(4)]
    assert worker.lookup(64, hashes).hit_length == 0
    stats = worker.get_kv_connector_stats()
    assert stats.data["__moonlease_lookups__"][-1]["reason"] == MissReason.STORE_ERROR.value
    assert stats.data["lookup_exists"][-1]["status"] == "error"


def test_an_unexpected_bug_is_a_miss_not_a_dead_lookup_server() -> None:
    worker = build_worker(MoonleaseStoreWorker, LAYOUTS[0], RecordingStore({}))
    worker.coord = None  # any exception inside the lookup
    assert worker.lookup(64, [b"x" * 8] * 4).hit_length == 0
    stats = worker.get_kv_connector_stats()
    assert stats.data["__moonlease_lookups__"][-1]["reason"] == MissReason.INTERNAL_ERROR.value
