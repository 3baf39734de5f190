"""Loads under a deadline: when the deadline applies, and the scheduler's pins on load blocks.

`core.load_deadline` decides (pure); our scheduler role, built from a real `VllmConfig` with a
real `BlockPool` bound, pins every block a load writes when it emits the load and releases them
only when every rank reports the load's store calls returned — through upstream's own
`update_connector_output` ledger. No servers: unit tier.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import vllm.envs
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    LoadSpec,
    MooncakeStoreConnectorMetadata,
    MooncakeStoreWorkerMetadata,
    ReqMeta,
)
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput

from moonlease_connector.adapters.vllm_load import PinnedLoadSpec, pin_loads
from moonlease_connector.adapters.vllm_scheduler import MoonleaseStoreScheduler
from moonlease_settings.config import MoonleaseConnectorConfig
from moonlease_connector.core.load_deadline import LoadPins, load_deadline_s, policy_warning
from tests.support.lookup_workers import LAYOUTS

pytestmark = pytest.mark.unit
LAYOUT = LAYOUTS[3]  # full attention + a sliding window: two block tables per request
_ports = itertools.count(24000)


def test_the_deadline_applies_only_where_vllm_recomputes_a_failed_load():
    assert load_deadline_s(2500, "recompute") == 2.5
    assert load_deadline_s(2500, "fail") is None, "under 'fail' a timeout would fail the request"
    assert load_deadline_s(0, "recompute") is None, "0 turns it off"
    assert MoonleaseConnectorConfig().mooncake_load_timeout_ms == 10_000


def test_only_the_fail_policy_is_warned_about():
    assert policy_warning("recompute") is None
    warning = policy_warning("fail")
    assert warning is not None and '"kv_load_failure_policy": "recompute"' in warning


def test_pins_settle_per_rank_and_are_taken_once():
    pins = LoadPins()
    pins.settle(3)
    pins.settle(3)
    pins.settle(7)
    assert pins.take() == {3: 2, 7: 1}
    assert pins.take() == {}


@pytest.fixture
def make_scheduler(vllm_rpc_base):
    built = []

    def make(policy: str, world_size: int = 1) -> MoonleaseStoreScheduler:
        config = VllmConfig(cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
                            parallel_config=ParallelConfig(tensor_parallel_size=world_size),
                            kv_transfer_config=KVTransferConfig(
                                kv_connector="MooncakeStoreConnector", kv_role="kv_both",
                                kv_load_failure_policy=policy,
                                kv_connector_extra_config={"lookup_rpc_port": next(_ports),
                                                           "mooncake_load_timeout_ms": 1500}))
        groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(LAYOUT.specs)]
        scheduler = MoonleaseStoreScheduler(config, KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                                                                  kv_cache_groups=groups))
        scheduler.bind_gpu_block_pool(BlockPool(num_gpu_blocks=64, enable_caching=True,
                                                hash_block_size=16))
        built.append(scheduler)
        return scheduler

    yield make
    for scheduler in built:
        scheduler.close()
    vllm.envs.disable_envs_cache()


def load_meta(block_ids: tuple[list[int], ...]) -> MooncakeStoreConnectorMetadata:
    meta = MooncakeStoreConnectorMetadata(set(), set())
    meta.requests.append(ReqMeta("r1", 0, block_ids, [], load_spec=LoadSpec(0, 48, True)))
    meta.requests.append(ReqMeta("r2", 0, ([5],), [], load_spec=LoadSpec(0, 16, False)))  # no load
    return meta


def test_a_load_holds_its_blocks_until_its_store_calls_returned(make_scheduler):
    scheduler = make_scheduler("recompute")
    assert scheduler.load_deadline_s == 1.5
    pool = scheduler._gpu_block_pool
    full = [b.block_id for b in pool.get_new_blocks(3)]
    window = [NULL_BLOCK_ID, NULL_BLOCK_ID] + [b.block_id for b in pool.get_new_blocks(1)]
    meta = load_meta((full, window))
    pin_loads(scheduler, meta)
    spec = meta.requests[0].load_spec
    assert isinstance(spec, PinnedLoadSpec) and spec.pin is not None
    assert (spec.kvpool_cached_tokens, spec.can_load) == (48, True), "upstream's fields kept"
    assert not isinstance(meta.requests[1].load_spec, PinnedLoadSpec), "no load, no pin"
    held = full + window[2:]
    assert all(pool.blocks[b].ref_cnt == 2 for b in held), "the request's reference plus the pin"

    pin_loads(scheduler, meta)  # the same metadata again takes nothing more
    assert all(pool.blocks[b].ref_cnt == 2 for b in held)

    # The request is freed (recomputed elsewhere, or finished): the pin alone holds them.
    pool.free_blocks(pool.blocks[b] for b in held)
    assert all(pool.blocks[b].ref_cnt == 1 for b in held)
    assert scheduler.has_pending_push_work(), "the engine keeps stepping for the report"

    scheduler.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=MooncakeStoreWorkerMetadata(completed_saves={spec.pin: 1})))
    assert all(pool.blocks[b].ref_cnt == 0 for b in held)
    assert not scheduler._pinned_saves and not scheduler.has_pending_push_work()


def test_every_rank_must_report_before_the_pin_goes(make_scheduler):
    scheduler = make_scheduler("recompute")
    scheduler._num_workers = 2  # two ranks load into the same block ids
    pool = scheduler._gpu_block_pool
    blocks = [b.block_id for b in pool.get_new_blocks(2)]
    meta = load_meta((blocks, [NULL_BLOCK_ID]))
    pin_loads(scheduler, meta)
    pin = meta.requests[0].load_spec.pin
    report = KVConnectorOutput(kv_connector_worker_meta=MooncakeStoreWorkerMetadata(completed_saves={pin: 1}))
    scheduler.update_connector_output(report)
    assert all(pool.blocks[b].ref_cnt == 2 for b in blocks), "one rank's call may still be out"
    scheduler.update_connector_output(report)
    assert all(pool.blocks[b].ref_cnt == 1 for b in blocks)


def test_under_the_fail_policy_loads_wait_unbounded_and_the_policy_is_warned_about(make_scheduler, caplog):
    logger = logging.getLogger("vllm.moonlease.connector.scheduler")
    logger.addHandler(caplog.handler)  # vLLM's loggers do not propagate to the root
    try:
        with caplog.at_level(logging.WARNING, logger=logger.name):
            scheduler = make_scheduler("fail")
    finally:
        logger.removeHandler(caplog.handler)
    assert scheduler.load_deadline_s is None, "no deadline, so no pins"
    assert any("kv_load_failure_policy is 'fail'" in r.getMessage() for r in caplog.records)
