"""Retention `retry` (issue 21): the pure decision, the replay's save and the engine's store handle.

The decision (`core.put_retry.plan_put_retry`) is tested exhaustively on hand-made answers; the
replay's `apply_save` and the send thread's `_RetentionStore` against recorders that refuse puts
the way Mooncake does (NO_AVAILABLE_HANDLE = -200 until the master has evicted): a recorder
because the point is the exact sequence of store calls; the real store is exercised by the
replay benchmark and tests/connector/test_retention_engine.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from moonlease_connector.core.put_retry import (
    DEFAULT_PUT_RETRY,
    NO_AVAILABLE_HANDLE,
    PutRetryPolicy,
    plan_put_retry,
)
from moonlease_settings.retention import RetentionSettings

NO_SPACE = NO_AVAILABLE_HANDLE

pytestmark = pytest.mark.unit


def test_only_keys_refused_for_lack_of_space_are_put_again() -> None:
    # stored, no space, object exists (-704), no space, bad argument (-600)
    assert plan_put_retry([0, NO_SPACE, -704, NO_SPACE, -600], 0) == (1, 3)
    assert plan_put_retry([0, 0], 0) == ()
    assert plan_put_retry([], 0) == ()


def test_attempts_are_bounded() -> None:
    policy = PutRetryPolicy(attempts=2, delay_s=0.0)
    assert plan_put_retry([NO_SPACE], 0, policy) == (0,)
    assert plan_put_retry([NO_SPACE], 1, policy) == (0,)
    assert plan_put_retry([NO_SPACE], 2, policy) == ()
    assert plan_put_retry([NO_SPACE], 0, PutRetryPolicy(attempts=0)) == ()
    with pytest.raises(ValueError):
        PutRetryPolicy(attempts=-1)


def test_the_default_waits_for_two_eviction_passes() -> None:
    # Mooncake's eviction thread runs every 10 ms: 20 ms between attempts, 3 attempts.
    assert DEFAULT_PUT_RETRY == PutRetryPolicy(attempts=3, delay_s=0.02)


def test_retry_is_a_piece_of_its_own() -> None:
    assert RetentionSettings(retry=True).active
    assert not RetentionSettings(retry=True).plans_saves
    assert RetentionSettings(pin=True).plans_saves and RetentionSettings(skip=True).plans_saves


def test_the_connector_renders_the_retry_key_only_when_on() -> None:
    from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig

    config = MoonleaseConnectorConfig.from_sources({"mooncake_retention_retry": True})
    assert config.retention == RetentionSettings(retry=True)
    assert not config.finds_junctions  # retry alone changes no lookup
    pin = MoonleaseConnectorConfig.for_mode(LeaseMode.LEASE_ALL, retention=RetentionSettings(pin=True))
    assert "mooncake_retention_retry" not in pin.model_fields_set  # pin's hash is unchanged
    retry = MoonleaseConnectorConfig.for_mode(LeaseMode.LEASE_ALL, retention=RetentionSettings(retry=True))
    assert retry.model_fields_set >= {"mooncake_retention_retry"}
    assert "mooncake_retention_pin" not in retry.model_fields_set


def test_the_operator_renders_retention_retry() -> None:
    from moonlease_operator.api.policy import ConnectorSpec
    from moonlease_operator.core.settings import build_connector_settings

    plain = build_connector_settings(ConnectorSpec())
    retry = build_connector_settings(ConnectorSpec(retention_retry=True))
    assert plain.file["mooncake_retention_retry"] is False  # off is written, as off
    assert retry.file["mooncake_retention_retry"] is True
    assert retry.config_hash != plain.config_hash
    assert ConnectorSpec.model_validate({"retentionRetry": True}).retention_retry


class RefusingStore:
    """Refuses puts with NO_AVAILABLE_HANDLE until `free` keys fit; records every call."""

    def __init__(self, room: list[int]) -> None:
        self.room = room  # keys that fit, per put call (the master evicts between calls)
        self.present: set[str] = set()
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.calls.append(("exist", tuple(keys)))
        return [1 if key in self.present else 0 for key in keys]

    def batch_probe_key(self, keys: list[str], policy: str = "none", candidate_size: int = 1) -> list[int]:
        self.calls.append(("probe", tuple(keys)))
        return [1 if key in self.present else 0 for key in keys]

    def _admit(self, keys: list[str]) -> list[int]:
        room = self.room.pop(0) if self.room else 0
        answers = []
        for key in keys:
            if room > 0:
                self.present.add(key)
                room -= 1
                answers.append(0)
            else:
                answers.append(NO_SPACE)
        return answers

    def put_batch(self, keys: list[str], values: list[bytes], config: Any = None) -> int:
        self.calls.append(("put", tuple(keys)))
        answers = self._admit(keys)
        return 0 if all(a == 0 for a in answers) else NO_SPACE

    def batch_put_from_multi_buffers(self, keys: list[str], addrs: list[Any], sizes: list[Any],
                                     config: Any = None) -> list[int]:
        self.calls.append(("put", tuple(keys)))
        return self._admit(keys)


def test_the_replay_save_puts_the_refused_keys_again() -> None:
    from moonlease_dev.bench.saves import ChunkKeys, ValueSizes, apply_save

    chunks = [ChunkKeys(0, i, 16 * (i + 1), (f"f{i}",), False) for i in range(4)]
    store = RefusingStore(room=[1, 2, 5])
    waits: list[float] = []
    result = apply_save(store, chunks, ValueSizes(), retry=PutRetryPolicy(3, 0.02), sleep=waits.append)
    assert store.present == {"f0", "f1", "f2", "f3"}
    # exist, put (1 fits), probe which landed, wait, put the 3 refused (2 fit), probe, wait, put
    # the last (accepted whole: nothing to probe)
    assert [call for call, _ in store.calls] == ["exist", "put", "probe", "put", "probe", "put"]
    assert store.calls[3] == ("put", ("f1", "f2", "f3")) and store.calls[5] == ("put", ("f3",))
    assert waits == [0.02, 0.02]
    assert (result.put_failures, result.keys_failed, result.keys_retried) == (1, 0, 3)


def test_the_replay_save_gives_up_after_the_last_attempt_and_counts_what_is_lost() -> None:
    from moonlease_dev.bench.saves import ChunkKeys, ValueSizes, apply_save

    chunks = [ChunkKeys(0, i, 16 * (i + 1), (f"f{i}",), False) for i in range(3)]
    store = RefusingStore(room=[1, 0, 0])
    result = apply_save(store, chunks, ValueSizes(), retry=PutRetryPolicy(2, 0.0), sleep=lambda _: None)
    assert store.present == {"f0"}
    assert (result.put_failures, result.keys_failed, result.keys_retried) == (1, 2, 0)
    plain = RefusingStore(room=[1])
    upstream = apply_save(plain, chunks, ValueSizes())
    # Without retry: upstream's save (the probe only counts what the refused call did not store).
    assert [call for call, _ in plain.calls] == ["exist", "put", "probe"]
    assert plain.present == {"f0"}
    assert (upstream.put_failures, upstream.keys_failed, upstream.keys_retried) == (1, 2, 0)


def test_the_engine_store_handle_retries_and_reports_what_it_stored() -> None:
    from moonlease_connector.adapters.vllm_retention import _RetentionStore

    inner = RefusingStore(room=[1, 5])
    events: list[tuple[str, int]] = []
    waits: list[float] = []
    store = _RetentionStore(inner, lambda key: False, lambda decision, keys: events.append((decision, keys)),
                            retry=lambda: PutRetryPolicy(3, 0.02), sleep=waits.append)
    answers = store.batch_put_from_multi_buffers(["a", "b", "c"], [1, 2, 3], [8, 8, 8], None)
    assert answers == [0, 0, 0]
    assert inner.calls == [("put", ("a", "b", "c")), ("put", ("b", "c"))]
    assert waits == [0.02] and events == [("retried", 2)]
    # Retry off and nothing pinned: one untouched call, answers as the store gave them.
    off = RefusingStore(room=[1])
    handle = _RetentionStore(off, lambda key: False, lambda decision, keys: None)
    assert handle.batch_put_from_multi_buffers(["a", "b"], [1, 2], [8, 8], None) == [0, NO_SPACE]
    assert off.calls == [("put", ("a", "b"))]


def test_only_what_a_continuation_reads_is_put_again() -> None:
    from moonlease_connector.core.retention import ChunkKind, SaveChunk, plan_save_retention

    assert plan_put_retry([NO_SPACE, NO_SPACE, 0], 0, retryable=[True, False, True]) == (0,)
    chunks = [SaveChunk(0, 0, ChunkKind.FULL), SaveChunk(1, 0, ChunkKind.RECURRENT),
              SaveChunk(1, 1, ChunkKind.RECURRENT), SaveChunk(2, 0, ChunkKind.WINDOW),
              SaveChunk(2, 1, ChunkKind.WINDOW)]
    resume = {(1, 1), (2, 1)}  # the state and the window tail at the prompt's end
    plan = plan_save_retention(chunks, resume, RetentionSettings(retry=True))
    # Full-attention and window blocks always (a sparse save's tails end at the replay
    # boundary, outside the resume set); an intermediate Mamba state (dense retention's) not.
    assert plan.retried == (True, False, True, True, True)
    assert plan_save_retention(chunks, resume, RetentionSettings(pin=True)).retried == ()


def test_the_replay_save_does_not_put_again_what_the_plan_leaves_out() -> None:
    from moonlease_dev.bench.saves import ChunkKeys, ValueSizes, apply_save
    from moonlease_connector.core.retention import ChunkRetention, SaveRetentionPlan

    chunks = [ChunkKeys(0, 0, 64, ("f0",), False), ChunkKeys(1, 0, 64, ("m0",), True)]
    plan = SaveRetentionPlan((ChunkRetention.PLAIN, ChunkRetention.PLAIN), retried=(True, False))
    store = RefusingStore(room=[0, 5])
    result = apply_save(store, chunks, ValueSizes(), plan, retry=PutRetryPolicy(3, 0.0), sleep=lambda _: None)
    assert store.present == {"f0"}  # the refused Mamba state stays out
    assert (result.keys_retried, result.keys_failed) == (1, 1)


def test_a_refused_key_retry_leaves_out_does_not_read_as_store_pressure_to_upstream() -> None:
    from moonlease_connector.adapters.vllm_retention import _RetentionStore
    from moonlease_connector.core.put_retry import LEFT_OUT, answers_for_upstream

    assert answers_for_upstream([0, NO_SPACE, NO_SPACE, -704], [True, True, False, False]) == \
        [0, NO_SPACE, LEFT_OUT, -704]
    assert answers_for_upstream([NO_SPACE], None) == [NO_SPACE]
    inner = RefusingStore(room=[0, 5])
    store = _RetentionStore(inner, lambda key: False, lambda decision, keys: None,
                            retry=lambda: PutRetryPolicy(3, 0.0), sleep=lambda _: None,
                            retryable=lambda key: key != "state@128")
    assert store.batch_put_from_multi_buffers(["block", "state@128"], [1, 2], [8, 8], None) == [0, LEFT_OUT]
    assert inner.calls == [("put", ("block", "state@128")), ("put", ("block",))]
