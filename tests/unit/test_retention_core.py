"""Moonlease retention (issue 21): the save plan, and the resume set by vLLM's own load rule.

`plan_save_retention` is pure and checked case by case; `build_resume_set` runs vLLM's real
`MooncakeStoreCoordinator` over the benchmark's layouts (no engine), and the hand-computed
expectations follow from each layout's block sizes: 16-token hash blocks, a 40-token sliding
window, Mamba states every 64 tokens.
"""

from __future__ import annotations

import pytest

from moonlease_dev.bench.workers import build_layout_parts, layout_by_name
from moonlease_connector.adapters.vllm_retention import build_resume_set, build_shared_set, chunk_kind
from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.retention import (
    ChunkKind,
    ChunkRetention,
    SaveChunk,
    plan_save_retention,
    resume_ends,
)
from moonlease_settings.retention import RetentionSettings

pytestmark = pytest.mark.unit

P, N, S = ChunkRetention.PINNED, ChunkRetention.PLAIN, ChunkRetention.SKIPPED
CHUNKS = [SaveChunk(0, 0, ChunkKind.FULL), SaveChunk(0, 1, ChunkKind.FULL),
          SaveChunk(1, 0, ChunkKind.WINDOW), SaveChunk(1, 1, ChunkKind.WINDOW),
          SaveChunk(2, 0, ChunkKind.RECURRENT), SaveChunk(2, 1, ChunkKind.RECURRENT)]
RESUME = {(0, 0), (0, 1), (1, 1), (2, 1)}  # every full block, the window tail, the last state


SHARED = {(0, 0), (1, 0)}  # a shared prefix of one chunk: its full block and window tail


@pytest.mark.parametrize(("settings", "expected"), [
    (RetentionSettings(), (N, N, N, N, N, N)),  # off: upstream's saves
    (RetentionSettings(pin=True), (P, N, P, N, N, N)),  # only the shared prefix is pinned
    (RetentionSettings(skip=True), (N, N, N, N, S, N)),  # never skips what a shared hit loads
    (RetentionSettings(pin=True, skip=True), (P, N, P, N, S, N)),
])
def test_plan_pins_the_shared_prefix_and_skips_only_what_no_continuation_reads(
        settings: RetentionSettings, expected: tuple[ChunkRetention, ...]) -> None:
    assert plan_save_retention(CHUNKS, RESUME, settings, SHARED).decisions == expected


def test_without_a_shared_prefix_pin_pins_nothing_and_skip_skips_outside_the_resume_set() -> None:
    assert plan_save_retention(CHUNKS, RESUME, RetentionSettings(pin=True, skip=True)).decisions == (
        N, N, S, N, S, N)


def test_with_evict_the_plan_marks_the_shared_prefix_the_connector_must_not_remove() -> None:
    plan = plan_save_retention(CHUNKS, RESUME, RetentionSettings(evict=True), SHARED)
    assert plan.shared == (True, False, True, False, False, False)
    assert plan.decisions == (N,) * 6  # evict alone changes no write
    assert plan_save_retention(CHUNKS, RESUME, RetentionSettings(pin=True), SHARED).shared == ()


def test_full_attention_is_never_skipped_even_outside_the_resume_set() -> None:
    plan = plan_save_retention(CHUNKS, set(), RetentionSettings(pin=True, skip=True))
    assert plan.decisions == (N, N, S, S, S, S)
    assert (plan.count(S), plan.count(N), plan.count(P)) == (4, 2, 0)


def test_shared_set_is_what_a_hit_at_the_shared_prefix_loads() -> None:
    parts = build_layout_parts(layout_by_name("full+swa"), retention_interval=0)
    hashes = [bytes([i + 1]) * 16 for i in range(10)]
    shared = build_shared_set(parts.coordinator, hashes, 64)
    assert shared == {(0, 0), (0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)}
    assert build_shared_set(parts.coordinator, hashes, 0) == frozenset()
    hybrid = build_layout_parts(layout_by_name("full+mamba"))
    # 100 shared tokens align down to the 64-token state: blocks 0..3 and the state at 64.
    assert build_shared_set(hybrid.coordinator, hashes, 100) == {(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)}


def test_resume_set_of_a_sliding_window_prompt_is_every_full_block_and_the_window_tail() -> None:
    parts = build_layout_parts(layout_by_name("full+swa"), retention_interval=0)
    hashes = [bytes([i + 1]) * 16 for i in range(10)]  # 160 tokens
    resume = build_resume_set(parts.coordinator, hashes, 168)  # not block-aligned: end 160
    assert {c for g, c in resume if g == 0} == set(range(10))
    # A 40-token window ending at 160 reads tokens 120..159: blocks 7, 8, 9.
    assert {c for g, c in resume if g == 1} == {7, 8, 9}


def test_an_exact_resend_of_a_block_aligned_prompt_keeps_what_its_hit_one_block_lower_loads() -> None:
    """vLLM recomputes the last token: the same 160-token prompt sent again hits at 144, whose
    window reads tokens 104..143 (blocks 6, 7, 8); block 6 is not in the end's window."""
    parts = build_layout_parts(layout_by_name("full+swa"), retention_interval=0)
    hashes = [bytes([i + 1]) * 16 for i in range(10)]
    resume = build_resume_set(parts.coordinator, hashes, 160)
    assert {c for g, c in resume if g == 0} == set(range(10))
    assert {c for g, c in resume if g == 1} == {6, 7, 8, 9}
    hybrid = build_layout_parts(layout_by_name("full+mamba"))
    # 256 tokens, aligned to the 64-token state: a re-send hits at 192, the state there (chunk 2).
    resume = build_resume_set(hybrid.coordinator, [bytes([i + 1]) * 16 for i in range(16)], 256)
    assert {c for g, c in resume if g == 1} == {2, 3}
    assert {c for g, c in resume if g == 0} == set(range(16))


def test_resume_ends() -> None:
    assert resume_ends(168, 16, 160) == (160,), "not aligned: the re-send hits the same end"
    assert resume_ends(160, 16, 144) == (144, 160)
    assert resume_ends(160, 16, 144, junctions=(70, 0, 999)) == (64, 144, 160)
    assert resume_ends(10, 16, 0) == ()


def test_junctions_add_the_window_tail_a_sibling_resumes_from() -> None:
    parts = build_layout_parts(layout_by_name("full+swa"), retention_interval=0)
    hashes = [bytes([i + 1]) * 16 for i in range(10)]
    resume = build_resume_set(parts.coordinator, hashes, 160, junctions=(64,))
    # Blocks 1..3 for the junction at 64; 6..9 for the end and an exact re-send (144).
    assert {c for g, c in resume if g == 1} == {1, 2, 3, 6, 7, 8, 9}


def test_resume_set_of_a_hybrid_prompt_holds_only_the_last_mamba_state() -> None:
    parts = build_layout_parts(layout_by_name("full+mamba"))
    hashes = [bytes([i + 1]) * 16 for i in range(18)]  # 288 tokens: aligned end 256
    resume = build_resume_set(parts.coordinator, hashes, 288)
    assert {c for g, c in resume if g == 0} == set(range(16))  # full attention up to 256
    assert {c for g, c in resume if g == 1} == {3}  # the state at 256 (64-token chunks 0..3)


def test_chunk_kinds_follow_the_specs() -> None:
    specs = layout_by_name("full+swa").specs + layout_by_name("full+mamba").specs[1:]
    assert [chunk_kind(spec) for spec in specs] == [ChunkKind.FULL, ChunkKind.WINDOW, ChunkKind.RECURRENT]


def test_connector_settings_expose_the_pieces_and_render_them_only_when_on() -> None:
    config = MoonleaseConnectorConfig.from_sources({"mooncake_retention_pin": True, "mooncake_retention_skip": True})
    assert config.retention == RetentionSettings(pin=True, skip=True)
    plain = MoonleaseConnectorConfig.for_mode(LeaseMode.SELECTIVE)
    assert "mooncake_retention_pin" not in plain.model_fields_set  # same keys, same hash as before
    on = MoonleaseConnectorConfig.for_mode(LeaseMode.SELECTIVE, retention=RetentionSettings(pin=True))
    assert {"mooncake_retention_pin", "mooncake_retention_skip"} <= on.model_fields_set
    assert on.retention.pin and not on.retention.skip


class RecordingStore:
    """Records the save's store calls (a recorder: the test asserts the calls themselves)."""

    def __init__(self, present: set[str]) -> None:
        self.present = set(present)
        self.calls: list[tuple[str, tuple[str, ...], object]] = []

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.calls.append(("exist", tuple(keys), None))
        return [1 if key in self.present else 0 for key in keys]

    def put_batch(self, keys: list[str], values: list[bytes], config: object = None) -> int:
        self.calls.append(("put", tuple(keys), config))
        self.present.update(keys)
        return 0


def test_the_replay_save_carries_out_the_plan_call_by_call() -> None:
    from moonlease_dev.bench.saves import ChunkKeys, ValueSizes, apply_save
    from moonlease_connector.core.retention import SaveRetentionPlan

    chunks = [ChunkKeys(0, 0, 16, ("f0",), False), ChunkKeys(0, 1, 32, ("f1",), False),
              ChunkKeys(1, 0, 64, ("m0a", "m0b"), True), ChunkKeys(1, 1, 128, ("m1a", "m1b"), True)]
    plan = SaveRetentionPlan((P, P, S, P))
    pin = object()
    store = RecordingStore(present={"f0"})
    result = apply_save(store, chunks, ValueSizes(), plan, pin)
    # Skipped chunks are neither re-checked nor written; missing pinned keys go out with the pin.
    assert store.calls == [("exist", ("f0", "f1", "m1a", "m1b"), None),
                           ("put", ("f1", "m1a", "m1b"), pin)]
    assert (result.keys_checked, result.keys_put, result.keys_pinned, result.keys_skipped) == (4, 3, 3, 2)


def test_the_replay_save_without_a_plan_is_upstreams() -> None:
    from moonlease_dev.bench.saves import ChunkKeys, ValueSizes, apply_save

    store = RecordingStore(present=set())
    apply_save(store, [ChunkKeys(0, 0, 16, ("f0",), False)], ValueSizes())
    assert store.calls == [("exist", ("f0",), None), ("put", ("f0",), None)]


def test_the_operator_renders_every_retention_key_off_included() -> None:
    from moonlease_operator.api.policy import ConnectorSpec
    from moonlease_operator.core.settings import build_connector_settings

    plain = build_connector_settings(ConnectorSpec())
    skip = build_connector_settings(ConnectorSpec(retention_skip=True))
    assert plain.file["mooncake_retention_skip"] is False  # off reaches pods that start with it on
    assert skip.file["mooncake_retention_skip"] is True
    assert skip.file["mooncake_retention_pin"] is False
    assert skip.config_hash != plain.config_hash  # turning it on rolls the targets
    config = MoonleaseConnectorConfig.from_sources(skip.file, {})
    assert config.retention == RetentionSettings(skip=True) and config.finds_junctions


class PinRecordingStore:
    """The never-evicting `DictStore`, recording which keys each put soft-pinned (no Mooncake)."""

    def __init__(self) -> None:
        from moonlease_dev.bench.stores import DictStore

        self.inner = DictStore()
        self.pinned: set[str] = set()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def put_batch(self, keys, values, config=None) -> int:
        if config is not None:
            self.pinned.update(keys)
        return self.inner.put_batch(keys, values)


@pytest.mark.parametrize("workload", ["agentic-swa", "hot-prompts-docs"])
def test_replay_pin_pins_only_the_system_prompts_four_sessions_continue(workload: str) -> None:
    """The benchmark runs the connector's plan: over a generated trace, `pin` soft-pins only keys
    of the agents' system prompts (full-attention blocks; for a hybrid model also the state at
    the prompt's end), and only those first written after four sessions continued them."""
    from moonlease_dev.bench.replay import MODES, build_ideal_replay, replay_requests
    from moonlease_dev.bench.saves import ValueSizes
    from moonlease_dev.bench.workload import WORKLOADS, build_named_trace

    trace = build_named_trace(workload, seed=1, duration_s=900.0)
    knobs = WORKLOADS[workload]
    system_hashes = {bytes.fromhex(h) for r in trace.requests for h in r.block_hashes[:knobs.system_blocks]}
    sizes = ValueSizes()
    ideal = build_ideal_replay(trace, junction_retention=False, sizes=sizes)
    store = PinRecordingStore()
    run = replay_requests(trace, store, MODES["leaseAll+pin"], ideal, sizes, pin_config=object())
    assert run.keys_pinned == len(store.pinned) == 0  # a store that never evicts: written before shared

    # The same trace against a store that forgets everything before each request: every save
    # writes its prompt again, so the tracker's verdict shows in what is pinned.
    forgetful = PinRecordingStore()
    run = replay_requests(trace, forgetful, MODES["leaseAll+pin"], ideal, sizes, pin_config=object(),
                          before_request=lambda _: forgetful.inner.keys.clear())
    assert run.keys_pinned > 0
    pinned_hashes = {key.rsplit("@", 1)[1] for key in forgetful.pinned}
    assert pinned_hashes <= {h.hex() for h in system_hashes}
    assert run.keys_pinned < run.keys_put / 2
