"""A lease mode the model's layout cannot serve is refused wherever its objects are built.

Last-hit-only needs a recurrent (align-mode Mamba) group beside full attention. Built directly
— not through the connector — for a model without one, the worker, the scheduler and the
lookup object each refuse at construction with the gate's message; before the gate, the worker
started and every lookup logged an `IndexError` and missed. The worker refuses before it
connects to the store, so no store is needed here; the scheduler before it opens its lookup
channel. Real `VllmConfig`s and `KVCacheConfig`s; no servers: unit tier.
"""

from __future__ import annotations

import itertools

import pytest
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

from moonlease_connector.adapters.vllm_scheduler import MoonleaseStoreScheduler
from moonlease_connector.adapters.vllm_worker import MoonleaseStoreWorker
from moonlease_connector.config import ConnectorConfigError, LeaseMode
from tests.support.lookup_workers import LAYOUTS, PatternStore, build_lookup

pytestmark = pytest.mark.unit

FULL = next(layout for layout in LAYOUTS if layout.name == "full")
FULL_SWA = next(layout for layout in LAYOUTS if layout.name == "full+swa")
FULL_MAMBA = next(layout for layout in LAYOUTS if layout.name == "full+mamba")
_ports = itertools.count(23900)


def configs(layout, extra: dict) -> tuple[VllmConfig, KVCacheConfig]:
    config = VllmConfig(cache_config=CacheConfig(block_size=layout.specs[0].block_size,
                                                 enable_prefix_caching=True),
                        kv_transfer_config=KVTransferConfig(
                            kv_connector="MooncakeStoreConnector", kv_role="kv_both",
                            kv_connector_extra_config={"lookup_rpc_port": next(_ports), **extra}))
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(layout.specs)]
    return config, KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.fixture(autouse=True)
def rpc_base(vllm_rpc_base):
    """Every test's schedulers put their lookup sockets in a short folder of its own."""


LAST_HIT_ONLY = {"mooncake_kda_last_hit_only": True}


def test_a_worker_built_directly_refuses_a_model_without_a_mamba_group():
    config, kv_cache_config = configs(FULL, LAST_HIT_ONLY)
    with pytest.raises(ConnectorConfigError, match="no recurrent \\(Mamba\\) group"):
        MoonleaseStoreWorker(config, kv_cache_config)


def test_a_worker_built_directly_refuses_a_sliding_window_group_and_group_leases_at_once():
    config, kv_cache_config = configs(FULL_SWA, {**LAST_HIT_ONLY, "enable_group_semantics": True})
    with pytest.raises(ConnectorConfigError) as refused:
        MoonleaseStoreWorker(config, kv_cache_config)
    message = str(refused.value)
    assert "SlidingWindowSpec is served by SlidingWindowManager" in message
    assert "enable_group_semantics=true" in message and "no recurrent" in message


def test_a_scheduler_built_directly_refuses_before_opening_its_lookup_channel(tmp_path):
    config, kv_cache_config = configs(FULL, LAST_HIT_ONLY)
    with pytest.raises(ConnectorConfigError, match="no recurrent \\(Mamba\\) group"):
        MoonleaseStoreScheduler(config, kv_cache_config)


def test_a_scheduler_for_a_layout_the_mode_serves_is_built():
    config, kv_cache_config = configs(FULL_MAMBA, LAST_HIT_ONLY)
    scheduler = MoonleaseStoreScheduler(config, kv_cache_config)
    try:
        assert scheduler.moonlease_config.lease_mode is LeaseMode.LAST_HIT_ONLY
    finally:
        scheduler.close()


@pytest.mark.parametrize("layout", [FULL, FULL_SWA], ids=lambda layout: layout.name)
def test_the_lookup_object_refuses_a_layout_last_hit_only_cannot_serve(layout):
    with pytest.raises(ConnectorConfigError, match="mooncake_kda_last_hit_only cannot run"):
        build_lookup(layout, PatternStore({}), LeaseMode.LAST_HIT_ONLY)


def test_the_lookup_object_is_built_for_full_attention_and_align_mamba():
    lookup = build_lookup(FULL_MAMBA, PatternStore({}), LeaseMode.LAST_HIT_ONLY)
    assert lookup.mode is LeaseMode.LAST_HIT_ONLY


@pytest.mark.parametrize("mode", [{}, {"mooncake_selective_lease": True}], ids=["leaseAll", "selective"])
def test_modes_that_do_not_depend_on_the_layout_build_on_any_layout(mode):
    config, kv_cache_config = configs(FULL_SWA, mode)
    scheduler = MoonleaseStoreScheduler(config, kv_cache_config)
    scheduler.close()
