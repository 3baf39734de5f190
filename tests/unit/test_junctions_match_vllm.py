"""The store lookup's junction is the one vLLM's local coordinator would pin.

Property test over random existence patterns and hybrid group layouts. For the same present
`(group, hash)` units, vLLM's real `HybridKVCacheCoordinator` (the local prefix cache's) finds
``shared_prefix_boundary = hit + num_uncached_common_prefix_tokens``; our worker's lookup, with
junction retention on, must return exactly that junction — in both lease modes — for the units
its lookup asked the store about, and, with it off, nothing beyond upstream's response.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
    ExternalCachedBlockPool,
)
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

from moonlease_connector.adapters.vllm_metrics import MoonleaseConnectorStats
from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.lookup_protocol import JUNCTION_GROUP_ID, parse_wire_entries
from tests.support.lookup_workers import (
    HASH_BLOCK,
    LAYOUTS,
    Layout,
    PatternStore,
    build_layout_parts,
    build_lookup,
    full_attention,
    mamba_align,
    sliding_window,
)

pytestmark = pytest.mark.compat

HYBRID = [layout for layout in LAYOUTS if len(layout.specs) > 1] + [
    Layout("full+swa+mamba", (full_attention(), sliding_window(40), mamba_align(64)), 64, (1, 1, 1)),
    Layout("swa+mamba", (sliding_window(24), mamba_align(32)), 32, (1, 1)),
]


def local_junction(layout: Layout, present: set[tuple[int, bytes]], hashes: list[bytes],
                   num_tokens: int) -> int:
    """What core's `get_computed_blocks` sets as ``request.shared_prefix_boundary``."""
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(layout.specs)]
    coordinator = HybridKVCacheCoordinator(
        KVCacheConfig(num_blocks=256, kv_cache_tensors=[], kv_cache_groups=groups,
                      prefix_cache_retention_interval=0),
        max_model_len=4096, max_in_flight_tokens=4096, use_eagle=layout.eagle,
        enable_caching=True, enable_kv_cache_events=False, dcp_world_size=1, pcp_world_size=1,
        scheduler_block_size=layout.scheduler_block, hash_block_size=HASH_BLOCK,
        allow_partial_hash_hits=layout.partial_hits)
    pool = ExternalCachedBlockPool(HASH_BLOCK, present)
    for manager in coordinator.single_type_managers:
        manager.block_pool = pool  # the store's duck-typed pool, as the store coordinator uses
    _, hit, uncached = coordinator.find_longest_cache_hit(hashes, num_tokens - 1)
    return hit + uncached if uncached else 0


@st.composite
def cases(draw: st.DrawFn):
    layout = draw(st.sampled_from(HYBRID))
    num_hashes = draw(st.integers(min_value=1, max_value=20))
    hashes = [bytes([index]) * 8 for index in range(num_hashes)]
    # As in vLLM: one hash per full block of the prompt.
    num_tokens = draw(st.integers(min_value=max(2, num_hashes * HASH_BLOCK),
                                  max_value=num_hashes * HASH_BLOCK + HASH_BLOCK - 1))
    # Per group, a stored prefix with holes: siblings typically find the full-attention prefix
    # and a window tail somewhere before it (or none).
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    density = draw(st.sampled_from([1.0, 0.9, 0.6, 0.3]))
    mode = draw(st.sampled_from([LeaseMode.LEASE_ALL, LeaseMode.SELECTIVE]))
    return layout, hashes, num_tokens, seed, density, mode


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_store_junction_equals_the_local_coordinators(case):
    layout, hashes, num_tokens, seed, density, mode = case
    rng = random.Random(seed)
    config = MoonleaseConnectorConfig.for_mode(mode, junction_retention=True)
    parts = build_layout_parts(layout)
    present: set[tuple[int, bytes]] = set()
    answers: dict[str, int] = {}
    for group, prefixes in enumerate(parts.key_prefixes):
        spec = parts.coordinator.kv_cache_groups[group].kv_cache_spec
        group_hashes = parts.coordinator.block_hashes_for_spec(hashes, spec)
        count = len(group_hashes)
        # A stored prefix with holes (what dense saves leave), or a few short runs (what
        # sparse retention leaves: tails at other prompts' boundaries).
        if rng.random() < 0.5:
            stored_upto = rng.randint(0, count)
            indices = {i for i in range(stored_upto) if rng.random() < density}
        else:
            indices = set()
            for _ in range(rng.randint(0, 3) if count else 0):
                start = rng.randrange(count)
                indices.update(range(start, min(count, start + rng.randint(1, 4))))
        for index in indices:
            present.add((group, bytes(group_hashes[index])))
            for prefix in prefixes:
                answers[f"{prefix}@{bytes(group_hashes[index]).hex()}"] = 1

    worker = build_lookup(parts, PatternStore(answers), config)
    result = worker.lookup(num_tokens, hashes)
    response = parse_wire_entries(result.hit_length,
                                  [(b.group_id, b.num_tokens) for b in result.tail_key_boundaries])
    # The store knows only what its lookup asked about: the candidates up to the aligned
    # lookup length (as for its own hit, an EAGLE peek past that length is not probed).
    groups = worker.groups
    length = worker.coord.align_lookup_length(num_tokens)
    asked = {(group, chunk_hash) for group, chunk_hashes
             in worker.lookup_chunk_hashes(groups, length, hashes).items() for chunk_hash in chunk_hashes}
    expected = local_junction(layout, present & asked, hashes, num_tokens)
    assert response.junctions == ((expected,) if expected else ()), (layout.name, result)
    assert all(j > response.hit_length for j in response.junctions)

    off = build_lookup(parts, PatternStore(answers), MoonleaseConnectorConfig.for_mode(mode))
    plain = off.lookup(num_tokens, hashes)
    assert plain.hit_length == result.hit_length
    assert plain.tail_key_boundaries == response_tails(result)
    assert all(b.group_id != JUNCTION_GROUP_ID for b in plain.tail_key_boundaries)


def response_tails(result):
    return tuple(b for b in result.tail_key_boundaries if b.group_id != JUNCTION_GROUP_ID)


def test_a_sibling_of_a_stored_prompt_gets_a_junction_and_no_hit():
    """Full attention holds the shared prefix; the window's only tail is at the other prompt's end."""
    layout = LAYOUTS[3]  # full attention + a 40-token window (3 blocks of 16)
    config = MoonleaseConnectorConfig.for_mode(LeaseMode.LEASE_ALL, junction_retention=True)
    stored = [bytes([i]) * 8 for i in range(12)]           # prompt A, 192 tokens
    sibling = stored[:8] + [bytes([100 + i]) * 8 for i in range(4)]  # shares 128 tokens
    answers = {f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h.hex()}": 1 for h in stored}
    answers.update({f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1@{h.hex()}": 1 for h in stored[8:11]})
    worker = build_lookup(layout, PatternStore(answers), config)
    result = worker.lookup(len(sibling) * HASH_BLOCK, sibling)
    assert result.hit_length == 0
    assert parse_wire_entries(0, [(b.group_id, b.num_tokens) for b in result.tail_key_boundaries]) \
        .junctions == (128,)
    assert result.outcome.junctions == 1
    stats = MoonleaseConnectorStats()
    stats.record_lookup(result.outcome)
    assert stats.reduce()["lookup_junctions"] == 1
