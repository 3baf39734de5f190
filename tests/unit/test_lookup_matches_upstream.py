"""Default-mode lookup is upstream's lookup: same store calls, same hit, same tail keys.

Property test over random existence patterns and group layouts, run against upstream's own
`MooncakeStoreWorker.lookup` from the installed vLLM. Both lookups are built around the same
real `MooncakeStoreCoordinator`; the store is a recorder that answers from the drawn pattern
(no server is involved: this compares two pieces of lookup logic, call for call).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moonlease_connector.core.lookup import MissReason
from tests.support.lookup_workers import (
    HASH_BLOCK,
    LAYOUTS,
    Layout,
    RecordingStore,
    OperationRecorder,
    build_lookup,
    build_upstream_lookup,
    every_possible_key,
)

pytestmark = pytest.mark.compat


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
    pattern = existence_pattern(every_possible_key(layout, hashes), knobs["density"], seed)

    upstream_store, our_store = RecordingStore(pattern), RecordingStore(pattern)
    upstream = build_upstream_lookup(layout, upstream_store)(num_tokens, hashes)
    ours = build_lookup(layout, our_store).lookup(num_tokens, hashes)

    assert our_store.calls == upstream_store.calls
    assert ours.hit_length == upstream.hit_length
    assert ours.tail_key_boundaries == upstream.tail_key_boundaries


def test_a_raising_store_is_a_miss_with_a_reason() -> None:
    class Broken(RecordingStore):
        def batch_is_exist(self, keys: list[str]) -> list[int]:
            raise RuntimeError("master unreachable")

    operations = OperationRecorder()
    lookup = build_lookup(LAYOUTS[0], Broken({}), record=operations)
    hashes = [bytes([i]) * 8 for i in range(4)]
    answer = lookup.lookup(64, hashes)
    assert answer.hit_length == 0
    assert answer.outcome.miss_reason is MissReason.STORE_ERROR
    assert operations.records[-1]["operation"] == "lookup_exists"
    assert operations.records[-1]["status"] == "error"


def test_an_unexpected_bug_is_a_miss_not_a_dead_lookup_server() -> None:
    lookup = build_lookup(LAYOUTS[0], RecordingStore({}))
    lookup.coord = None  # any exception inside the lookup
    answer = lookup.lookup(64, [b"x" * 8] * 4)
    assert answer.hit_length == 0
    assert answer.outcome.miss_reason is MissReason.INTERNAL_ERROR
