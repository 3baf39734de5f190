"""Junctions from the lookup to the save job, through our real scheduler side (no engine).

`MoonleaseStoreScheduler` is built from a real `VllmConfig` and `KVCacheConfig` and asks over
upstream's real ZMQ lookup channel: upstream's `LookupKeyServer` encodes what our worker's
lookup returns (a lookup-only worker over a store pattern: a sibling of a stored prompt).
Scheduler steps are driven with hand-built `SchedulerOutput`s the way vLLM's scheduler emits
them, with a real `BlockPool` bound for the save-job pins. No servers: unit tier.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import ReqMeta, TailKeyBoundary
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import LookupKeyServer
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.sched.output import (
    CachedRequestData,
    KVConnectorBlockState,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from moonlease_connector.adapters.vllm_lookup_server import stop_upstream_lookup_server
from moonlease_connector.adapters.vllm_save import JunctionStoreMasks
from moonlease_connector.adapters.vllm_scheduler import JunctionReqMeta, MoonleaseStoreScheduler
from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from tests.support.lookup_workers import LAYOUTS, PatternStore, build_lookup

pytestmark = pytest.mark.unit

LAYOUT = LAYOUTS[3]  # full attention + a 40-token sliding window, blocks of 16: 3-block tails
RETENTION = MoonleaseConnectorConfig.for_mode(LeaseMode.LEASE_ALL, junction_retention=True)
PROMPT = 192  # 12 blocks
HASHES = [bytes([7, i]) * 4 for i in range(PROMPT // 16)]
_ports = itertools.count(23400)


def stored_pattern() -> dict[str, int]:
    """A sibling's view of the store: full attention holds 10 shared blocks (160 tokens), the
    window only the 3-block tail ending at 112 (another prompt's replay tail)."""
    answers = {f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h.hex()}": 1 for h in HASHES[:10]}
    answers.update({f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1@{h.hex()}": 1 for h in HASHES[4:7]})
    return answers


@pytest.fixture
def channel(vllm_rpc_base):
    """(make_scheduler, pool): schedulers wired to a lookup server over the stored pattern."""
    opened = []

    def make(*, load_async: bool = True) -> MoonleaseStoreScheduler:
        extra = {"mooncake_junction_retention": True, "lookup_rpc_port": next(_ports),
                 "load_async": load_async}
        config = VllmConfig(cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
                            kv_transfer_config=KVTransferConfig(
                                kv_connector="MooncakeStoreConnector", kv_role="kv_both",
                                kv_connector_extra_config=extra))
        groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(LAYOUT.specs)]
        kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups,
                                        prefix_cache_retention_interval=0)
        lookup = build_lookup(LAYOUT, PatternStore(stored_pattern()), RETENTION)
        # Upstream's lookup server serves whatever has `lookup(num_tokens, hashes)` returning
        # upstream's result: here the lookup object the worker would forward to.
        server = LookupKeyServer(SimpleNamespace(lookup=lambda n, h: lookup.lookup(n, h).result), config)
        scheduler = MoonleaseStoreScheduler(config, kv_cache_config)
        opened.append((scheduler, server))
        pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=16)
        scheduler.bind_gpu_block_pool(pool)
        return scheduler

    yield make
    for scheduler, server in opened:
        scheduler.close()  # its lookup channel; the test's upstream server is stopped here
        assert stop_upstream_lookup_server(server)


def sibling_request() -> Request:
    return Request("E", list(range(PROMPT)), SamplingParams(max_tokens=4), None,
                   block_hasher=lambda request: list(HASHES))


def allocate(scheduler: MoonleaseStoreScheduler) -> tuple[list[int], list[int]]:
    """Block tables as the core allocates them for a 112-token load: the window's blocks
    before its reach are the null block."""
    pool = scheduler._gpu_block_pool
    full = [block.block_id for block in pool.get_new_blocks(12)]
    window = [NULL_BLOCK_ID] * 4 + [block.block_id for block in pool.get_new_blocks(8)]
    return full, window


def output(*, new=(), cached=None, tokens=None, tables=None, finished=()) -> SchedulerOutput:
    tables = tables or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=dict(tokens or {}),
        total_num_scheduled_tokens=sum((tokens or {}).values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(finished), free_encoder_mm_hashes=[],
        kv_connector_block_state=KVConnectorBlockState(
            req_ids=set(tables), resolve_block_ids=lambda req_id: tables[req_id],
            boundary_state_offloads={}))


def test_lookup_merges_the_store_junction_before_compute(channel):
    scheduler = channel()
    request = sibling_request()
    assert request.shared_prefix_boundary == 0  # core's local lookup found nothing
    assert scheduler.get_num_new_matched_tokens(request, 0) == (112, True)
    assert request.shared_prefix_boundary == 160          # where full attention stops
    assert scheduler.request_junctions == {"E": (160,)}
    # The load spec is upstream's: real tail keys only, no junction entry.
    assert scheduler.load_specs["E"].tail_key_boundaries == (TailKeyBoundary(0, 112),
                                                             TailKeyBoundary(1, 112))


def test_cores_own_boundary_is_kept_and_both_reach_the_save(channel):
    scheduler = channel()
    request = sibling_request()
    request.shared_prefix_boundary = 64
    scheduler.get_num_new_matched_tokens(request, 0)
    assert request.shared_prefix_boundary == 64
    assert scheduler.request_junctions == {"E": (64, 160)}


def test_async_loading_sibling_skips_its_first_save_and_hands_junctions_to_the_next(channel):
    scheduler = channel(load_async=True)
    pool = scheduler._gpu_block_pool
    request = sibling_request()
    assert scheduler.get_num_new_matched_tokens(request, 0) == (112, True)
    full, window = allocate(scheduler)
    scheduler.update_state_after_alloc(
        request, SimpleNamespace(get_block_ids=lambda group_ids: (full, window)), 112)

    # Step 1: the load is issued while the request waits for it; nothing is saved.
    first = scheduler.build_connector_meta(output()).requests
    assert len(first) == 1 and first[0].load_spec.can_load and not first[0].can_save
    assert type(first[0]) is ReqMeta

    # Step 2: the loaded request is scheduled; upstream builds a new tracker and saves 0..192.
    request.num_computed_tokens = 112
    new = NewRequestData.from_request(request, (full, window))
    current_window = [NULL_BLOCK_ID] * 4 + window[4:]
    second = scheduler.build_connector_meta(
        output(new=[new], tokens={"E": 80}, tables={"E": (full, current_window)})).requests
    assert len(second) == 1
    save = second[0]
    assert isinstance(save, JunctionReqMeta) and save.can_save and save.load_spec is None
    assert save.junctions == (160,) and save.token_len_chunk == PROMPT
    # The job pinned every non-null block it may read, the junction's window tail included.
    tail = window[7:10]
    pinned, _ = scheduler._pinned_saves[save.store_job_id]
    assert set(tail) <= set(pinned) and NULL_BLOCK_ID not in pinned
    assert all(pool.blocks[block].ref_cnt == 2 for block in tail)
    # And its save mask keeps that tail (chunks 7..9), besides the replay tail (8..10).
    masks = JunctionStoreMasks(scheduler._store_coord)
    masks.junctions = save.junctions
    window_mask = masks.store_mask(PROMPT, 0, num_prompt_tokens=PROMPT)[1]
    assert {i for i, keep in enumerate(window_mask) if keep} == {7, 8, 9, 10}
    assert masks.added == {1: (7,)}

    # Finished: the record goes with the request.
    scheduler.build_connector_meta(output(finished=["E"]))
    assert scheduler.request_junctions == {}


def test_sync_loading_sibling_saves_with_junctions_on_its_next_chunk(channel):
    scheduler = channel(load_async=False)
    request = sibling_request()
    assert scheduler.get_num_new_matched_tokens(request, 0) == (112, False)
    full, window = allocate(scheduler)
    scheduler.update_state_after_alloc(
        request, SimpleNamespace(get_block_ids=lambda group_ids: (full, window)), 112)

    # Step 1 loads 112 tokens and computes a chunk up to 160: a load, so no save.
    request.num_computed_tokens = 112
    new = NewRequestData.from_request(request, (full, window))
    first = scheduler.build_connector_meta(
        output(new=[new], tokens={"E": 48}, tables={"E": (full, window)})).requests
    assert len(first) == 1 and first[0].load_spec.can_load and not first[0].can_save
    assert type(first[0]) is ReqMeta

    # Step 2 computes the rest; the first save of the request carries the junction.
    cached = CachedRequestData(req_ids=["E"], resumed_req_ids=set(), new_token_ids=[[]],
                               all_token_ids={}, new_block_ids=[None], num_computed_tokens=[160],
                               num_output_tokens=[0])
    second = scheduler.build_connector_meta(
        output(cached=cached, tokens={"E": 32}, tables={"E": (full, window)})).requests
    assert len(second) == 1 and isinstance(second[0], JunctionReqMeta)
    assert second[0].can_save and second[0].junctions == (160,)
    assert second[0].token_len_chunk == PROMPT
