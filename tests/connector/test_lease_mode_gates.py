"""A lease mode the model's layout cannot serve is refused wherever its objects are built.

Last-hit-only needs a recurrent (align-mode Mamba) group beside full attention. Built directly
— not through the connector — for a model without one, the worker, the scheduler and the
lookup object each refuse at construction with the gate's message (a worker built without our
constructor, as upstream's suites build theirs, at its first lookup, which builds the lookup
object); before the gate, the worker started and every lookup logged an `IndexError` and
missed. The worker refuses before it
connects to the store, so no store is needed here; the scheduler before it opens its lookup
channel. Real `VllmConfig`s and `KVCacheConfig`s; no servers: unit tier.
"""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace

import pytest
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

from moonlease_connector.adapters.vllm_metrics import MoonleaseConnectorStats
from moonlease_connector.adapters.vllm_scheduler import MoonleaseStoreScheduler
from moonlease_connector.adapters.vllm_worker import MoonleaseStoreWorker
from moonlease_settings.config import (
    LEASE_MODE_KEY,
    ConnectorConfigError,
    DeprecatedSettingWarning,
    LeaseMode,
    MoonleaseConnectorConfig,
)
from moonlease_connector.core.last_hit import ProbeContract
from moonlease_settings.lease_modes import strategy_of
from tests.support.lookup_workers import (
    HASH_BLOCK,
    LAYOUTS,
    PatternStore,
    build_layout_parts,
    build_lookup,
    every_possible_key,
)

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


LAST_HIT_ONLY = {LEASE_MODE_KEY: "lastHitOnly"}


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
    with pytest.raises(ConnectorConfigError, match="mooncake_lease_mode=lastHitOnly cannot run"):
        build_lookup(layout, PatternStore({}), LeaseMode.LAST_HIT_ONLY)


def test_the_lookup_object_is_built_for_full_attention_and_align_mamba():
    lookup = build_lookup(FULL_MAMBA, PatternStore({}), LeaseMode.LAST_HIT_ONLY)
    assert lookup.mode is LeaseMode.LAST_HIT_ONLY


@pytest.mark.parametrize("mode", list(LeaseMode), ids=[m.value for m in LeaseMode])
def test_the_layout_gate_refuses_a_non_hybrid_model_exactly_for_modes_that_need_one(mode):
    """Mode by mode, as its strategy says (`moonlease_settings.lease_modes`): built for a sliding-window model,
    a scheduler refuses a mode that needs a hybrid model and builds for any other."""
    config, kv_cache_config = configs(FULL_SWA, {LEASE_MODE_KEY: mode.value})
    if strategy_of(mode).needs_hybrid_model:
        with pytest.raises(ConnectorConfigError, match=f"{LEASE_MODE_KEY}={mode.value} cannot run"):
            MoonleaseStoreScheduler(config, kv_cache_config)
        return
    scheduler = MoonleaseStoreScheduler(config, kv_cache_config)
    try:
        assert scheduler.moonlease_config.lease_mode is mode
    finally:
        scheduler.close()


def test_the_deprecated_switch_still_gates_the_same_way():
    config, kv_cache_config = configs(FULL, {"mooncake_kda_last_hit_only": True})
    with pytest.warns(DeprecatedSettingWarning, match='"mooncake_lease_mode": "lastHitOnly"'), \
            pytest.raises(ConnectorConfigError, match="no recurrent \\(Mamba\\) group"):
        MoonleaseStoreScheduler(config, kv_cache_config)


class LastHitOnlyByDefault(MoonleaseStoreWorker):
    """A worker class whose default mode is last-hit-only (what the compat tier's forced mode
    makes of ours)."""

    moonlease_config = MoonleaseConnectorConfig.for_mode(LeaseMode.LAST_HIT_ONLY)


def built_without_our_constructor(layout, store) -> MoonleaseStoreWorker:
    """As code written for upstream's worker builds one (upstream's own suites): `__new__`, then
    only upstream's attributes."""
    parts = build_layout_parts(layout)
    worker = LastHitOnlyByDefault.__new__(LastHitOnlyByDefault)
    worker.store, worker.coord, worker.hash_block_size = store, parts.coordinator, parts.hash_block_size
    worker._kv_cache_groups = parts.coordinator.kv_cache_groups
    worker.token_dbs = [SimpleNamespace(block_size=spec.block_size) for spec in layout.specs]
    worker._lookup_key_prefixes = parts.key_prefixes
    worker._capacity_only = False
    worker._record_kv_connector_operation = lambda *args, **kwargs: None
    worker._kv_connector_stats_lock = threading.Lock()
    worker.kv_connector_stats = MoonleaseConnectorStats()
    return worker


def test_a_worker_built_without_our_constructor_looks_up_last_hit_only_under_the_detected_contract():
    """Every KV block stored, the recurrent state of the last checkpoint missing: the one-call
    path cannot prove the hit, the checkpoints are probed and their answers read under the
    contract detected from this store (before, such a worker had no detector: ValueError)."""
    hashes = [bytes([7, i]) * 4 for i in range(16)]
    answers = dict.fromkeys(every_possible_key(FULL_MAMBA, hashes), 1)
    for key in [key for key in answers if "@group:1@" in key and key.endswith(hashes[-1].hex())]:
        del answers[key]
    store = PatternStore(dict(answers))
    worker = built_without_our_constructor(FULL_MAMBA, store)
    num_tokens = len(hashes) * HASH_BLOCK + 1
    expected = build_lookup(FULL_MAMBA, PatternStore(dict(answers)), LeaseMode.LAST_HIT_ONLY)
    hit = worker.lookup(num_tokens, hashes).hit_length
    assert 0 < hit < len(hashes) * HASH_BLOCK and hit == expected.lookup(num_tokens, hashes).hit_length
    detector = worker.probe_contract
    assert detector.contract is ProbeContract.PER_KEY_EXISTENCE, "detected from this store"
    assert worker.lookup(num_tokens, hashes).hit_length == hit and worker.probe_contract is detector


def test_a_worker_built_without_our_constructor_refuses_last_hit_only_for_a_model_without_a_mamba_group():
    worker = built_without_our_constructor(FULL, PatternStore({}))
    with pytest.raises(ConnectorConfigError, match="no recurrent \\(Mamba\\) group"):
        worker.lookup(65, [bytes([7, i]) * 4 for i in range(4)])
