"""Selective lease against upstream's own lookup, over thousands of random patterns.

For every group layout (full attention; + sliding window; + align-mode Mamba; partial-hash hits;
several rank namespaces) and random existence pattern with no eviction:
- the selective hit (and its tail keys) equals upstream's;
- probing leases nothing and leasing only touches probed keys (leased ⊆ probed);
- the leased keys are exactly what the load reads (so leased ⊇ reads, with nothing extra);
- default mode still leases every probed candidate that exists.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from tests.support.lookup_workers import (
    HASH_BLOCK,
    LAYOUTS,
    Layout,
    PatternStore,
    RecordingStore,
    build_lookup,
    build_upstream_lookup,
    every_possible_key,
    keys_the_load_reads,
)

pytestmark = pytest.mark.compat

SELECTIVE = MoonleaseConnectorConfig.for_mode(LeaseMode.SELECTIVE)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Layout, int, list[bytes], dict[str, int]]:
    layout = draw(st.sampled_from(LAYOUTS))
    num_hashes = draw(st.integers(min_value=1, max_value=24))
    hashes = [bytes([index, 7]) * 4 for index in range(num_hashes)]
    num_tokens = draw(st.integers(min_value=1, max_value=num_hashes * HASH_BLOCK))
    rng = random.Random(draw(st.integers(min_value=0, max_value=2**32 - 1)))
    density = draw(st.sampled_from([1.0, 1.0, 0.97, 0.85, 0.6]))
    pattern = {key: int(rng.random() < density) for key in every_possible_key(layout, hashes)}
    return layout, num_tokens, hashes, pattern


@settings(max_examples=2500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_selective_hit_equals_upstream_and_leases_exactly_the_load(case) -> None:
    layout, num_tokens, hashes, pattern = case
    upstream_store = RecordingStore(pattern)
    upstream = build_upstream_lookup(layout, upstream_store)(num_tokens, hashes)

    store = PatternStore(pattern)
    lookup = build_lookup(layout, store, SELECTIVE)
    ours = lookup.lookup(num_tokens, hashes)

    event(f"{layout.name}: {'hit' if ours.hit_length else 'miss'}")
    assert (ours.hit_length, ours.tail_key_boundaries) == (upstream.hit_length, upstream.tail_key_boundaries)
    assert all(name in ("batch_probe_key:none:1", "batch_is_exist") for name, _ in store.calls)
    leased = store.leased_keys()
    assert leased <= store.probed_keys()
    assert leased == keys_the_load_reads(lookup, hashes, ours)
    if upstream.hit_length == 0:
        assert not any(name == "batch_is_exist" for name, _ in store.calls) or leased == set()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_default_mode_leases_every_probed_candidate(case) -> None:
    layout, num_tokens, hashes, pattern = case
    store = PatternStore(pattern)
    build_lookup(layout, store).lookup(num_tokens, hashes)
    lease_calls = [keys for name, keys in store.calls if name == "batch_is_exist"]
    assert not store.probed_keys()
    assert len(lease_calls) <= 1
    if lease_calls:
        assert store.leased_keys() == {key for key in lease_calls[0] if pattern.get(key) == 1}


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_load_plan_sliced_from_the_probe_equals_the_plan_built_key_by_key(case) -> None:
    """The lease's keys cut from the probe's candidates (`chunk_aligned` groups) are the same
    keys, units and tails, in the same order, as building every key string again."""
    from moonlease_connector.core.lookup import build_candidates, present_units
    from moonlease_connector.core.selective import build_load_plan

    layout, num_tokens, hashes, pattern = case
    lookup = build_lookup(layout, PatternStore(pattern), SELECTIVE)
    lookup_length = lookup.coord.align_lookup_length(num_tokens)
    if lookup_length <= 0:
        return
    masks = lookup.lookup_masks(lookup_length)
    candidates = build_candidates(lookup.groups, lookup.lookup_chunk_hashes(
        lookup.groups, lookup_length, hashes, masks))
    present = present_units(candidates, [pattern.get(key, 0) for key in candidates.keys])
    hit = lookup.hit_rule(num_tokens, lookup_length, hashes)(present)
    if hit <= 0:
        return
    load_masks = lookup.load_masks(hashes, hit)
    by_group = {group.group_id: load_masks[group.group_id] for group in lookup.groups}
    aligned = lookup.chunk_aligned_groups(masks)
    event(f"{layout.name}: {len(aligned)} chunk-aligned group(s)")
    built = build_load_plan(lookup.groups, by_group, hashes, HASH_BLOCK, hit, present)
    sliced = build_load_plan(lookup.groups, by_group, hashes, HASH_BLOCK, hit, present,
                             candidates=candidates, chunk_aligned=aligned)
    assert sliced == built
