"""The P/D hand-off through our real scheduler side (no engine): a decode request that carries
its prefill engine's promise waits for the promised save; the prefill side makes the promise.

`MoonleaseStoreScheduler` (and, for the promise, the whole connector in its scheduler role) is
built from a real `VllmConfig` and asks over upstream's real ZMQ lookup channel, answered by a
lookup over a store pattern the test fills in the way a prefill engine's save lands. The
clock is the scheduler's own, replaced by a manual one so that waits are exact. No servers:
unit tier.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import LookupKeyServer
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from moonlease_connector.adapters.vllm_connector import MooncakeStoreConnector
from moonlease_connector.adapters.vllm_lookup_server import stop_upstream_lookup_server
from moonlease_connector.adapters.vllm_scheduler import MoonleaseStoreScheduler
from moonlease_connector.core.handoff import POLL_INTERVAL_S, SAVED_TOKENS_PARAM
from moonlease_settings.config import MoonleaseConnectorConfig
from tests.support.lookup_workers import LAYOUTS, PatternStore, build_lookup

pytestmark = pytest.mark.unit

LAYOUT = LAYOUTS[0]  # full attention, blocks of 16
PROMPT = 100  # 6 whole blocks: a decode engine loads 96 tokens
HASHES = [bytes([9, i]) * 4 for i in range(PROMPT // 16)]
_ports = itertools.count(23500)


def key(block: int) -> str:
    return f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HASHES[block].hex()}"


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def vllm_config(role: str, extra: dict[str, Any]) -> VllmConfig:
    return VllmConfig(cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
                      kv_transfer_config=KVTransferConfig(
                          kv_connector="MooncakeStoreConnector", kv_role=role,
                          kv_connector_extra_config=extra))


def kv_cache_config() -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(LAYOUT.specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups,
                         prefix_cache_retention_interval=0)


@pytest.fixture
def decode(vllm_rpc_base):
    """(scheduler, store pattern, clock) of a decode engine (kv_consumer) with the given timeout."""
    opened = []

    def make(*, timeout_ms: int = 1000) -> tuple[MoonleaseStoreScheduler, PatternStore, ManualClock]:
        extra = {"lookup_rpc_port": next(_ports), "mooncake_handoff_timeout_ms": timeout_ms,
                 "load_async": False}
        config = vllm_config("kv_consumer", extra)
        store = PatternStore({})
        lookup = build_lookup(LAYOUT, store, MoonleaseConnectorConfig())
        server = LookupKeyServer(SimpleNamespace(lookup=lambda n, h: lookup.lookup(n, h).result), config)
        scheduler = MoonleaseStoreScheduler(config, kv_cache_config())
        clock = ManualClock()
        scheduler._clock = clock
        opened.append((scheduler, server))
        return scheduler, store, clock

    yield make
    for scheduler, server in opened:
        scheduler.close()
        assert stop_upstream_lookup_server(server)


def decode_request(params: dict[str, Any] | None, request_id: str = "D") -> Request:
    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params else None)
    return Request(request_id, list(range(PROMPT)), sampling, None,
                   block_hasher=lambda request: list(HASHES))


def lands(store: PatternStore, blocks: range) -> None:
    for block in blocks:
        store.answer_for[key(block)] = 1


def handoff_records(scheduler: MoonleaseStoreScheduler) -> list[dict[str, Any]]:
    stats = scheduler.take_lookup_stats()
    return [] if stats is None else stats.data.get("__moonlease_handoff__", [])


def test_a_promised_request_waits_until_the_save_lands_then_loads_all_of_it(decode):
    scheduler, store, clock = decode()
    request = decode_request({SAVED_TOKENS_PARAM: PROMPT})
    lands(store, range(2))  # the prefill's save is under way: two blocks so far
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    assert "D" not in scheduler.load_specs  # nothing half-planned while it waits
    lookups = len(store.calls)
    # Asked again before the poll interval: no lookup reaches the store.
    clock.now += POLL_INTERVAL_S / 2
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    assert len(store.calls) == lookups
    clock.now += POLL_INTERVAL_S
    lands(store, range(2, 6))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (96, False)
    assert scheduler.load_specs["D"].kvpool_cached_tokens == 96
    assert [r["outcome"] for r in handoff_records(scheduler)] == ["complete"]
    assert scheduler._handoff_waits == {}


def test_past_the_deadline_it_loads_what_the_store_holds(decode):
    scheduler, store, clock = decode(timeout_ms=200)
    request = decode_request({SAVED_TOKENS_PARAM: PROMPT})
    lands(store, range(3))  # the rest was refused by a full store, say
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    clock.now += 0.1
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    clock.now += 0.1
    assert scheduler.get_num_new_matched_tokens(request, 0) == (48, False)
    records = handoff_records(scheduler)
    assert [r["outcome"] for r in records] == ["timed_out"]
    assert records[0]["waited_s"] == pytest.approx(0.2)


def test_a_request_without_a_promise_is_looked_up_once_as_upstreams(decode):
    scheduler, store, _ = decode()
    lands(store, range(2))
    assert scheduler.get_num_new_matched_tokens(decode_request(None), 0) == (32, False)
    assert scheduler.get_num_new_matched_tokens(decode_request({"do_remote_prefill": False}, "E"), 0) \
        == (32, False)
    assert handoff_records(scheduler) == [] and scheduler._handoff_waits == {}


@pytest.mark.parametrize("promise", [-1, "96", True, 1.5])
def test_a_malformed_promise_never_holds_a_request(decode, promise):
    scheduler, store, _ = decode()
    assert scheduler.get_num_new_matched_tokens(decode_request({SAVED_TOKENS_PARAM: promise}), 0) == (0, False)


def test_timeout_zero_turns_the_wait_off(decode):
    scheduler, store, _ = decode(timeout_ms=0)
    lands(store, range(1))
    assert scheduler.get_num_new_matched_tokens(decode_request({SAVED_TOKENS_PARAM: PROMPT}), 0) == (16, False)


def test_what_vllm_holds_locally_counts_toward_the_promise(decode):
    scheduler, store, _ = decode()
    # The decode engine's own prefix cache holds all 96 loadable tokens: nothing to wait for.
    assert scheduler.get_num_new_matched_tokens(decode_request({SAVED_TOKENS_PARAM: PROMPT}), 96) == (0, False)
    assert [r["outcome"] for r in handoff_records(scheduler)] == ["complete"]


def test_a_request_aborted_while_waiting_leaves_no_wait_behind(decode):
    from tests.connector.test_junctions_scheduler import output
    scheduler, store, _ = decode()
    assert scheduler.get_num_new_matched_tokens(decode_request({SAVED_TOKENS_PARAM: PROMPT}), 0) == (None, False)
    assert set(scheduler._handoff_waits) == {"D"}
    scheduler.build_connector_meta(output(finished=("D",)))
    assert scheduler._handoff_waits == {}


@pytest.mark.parametrize(("role", "params", "expected"), [
    ("kv_producer", {"do_remote_decode": True}, {SAVED_TOKENS_PARAM: PROMPT}),
    ("kv_both", {"do_remote_decode": True}, {SAVED_TOKENS_PARAM: PROMPT}),
    ("kv_both", None, None),  # no router asked: the response stays upstream's
    ("kv_producer", {"do_remote_decode": False}, None),
    ("kv_consumer", {"do_remote_decode": True}, None),  # a consumer saves nothing to promise
])
def test_a_saving_engine_promises_its_prompt_when_a_router_asks(vllm_rpc_base, role, params, expected):
    config = vllm_config(role, {"lookup_rpc_port": next(_ports)})
    connector = MooncakeStoreConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        request = decode_request(params)
        assert connector.request_finished_all_groups(request, ([1, 2],)) == (False, expected)
        assert connector.request_finished(request, [1, 2]) == (False, expected)
    finally:
        connector.shutdown()
