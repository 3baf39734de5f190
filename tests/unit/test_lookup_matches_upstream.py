"""Default-mode lookup is upstream's lookup: same store calls, same hit, same tail keys.

Property test over random existence patterns and group layouts, run against upstream's own
`MooncakeStoreWorker.lookup` from the installed vLLM. Both workers are built around the same
real `MooncakeStoreCoordinator`; the store is a recorder that answers from the drawn pattern
(no server is involved: this compares two pieces of lookup logic, call for call).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker

from moonlease_connector.adapters.vllm_worker import MoonleaseStoreWorker
from moonlease_connector.core.lookup import MissReason
from tests.support.lookup_workers import (
    HASH_BLOCK,
    LAYOUTS,
    Layout,
    RecordingStore,
    build_worker,
    every_possible_key,
)

pytestmark = pytest.mark.unit


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
    rng = random.Random(seed)
    answers = {}
    for key in sorted(keys):
        roll = rng.random()
        answers[key] = 1 if roll < density else (-1 if roll > 0.98 else 0)
    return answers


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
