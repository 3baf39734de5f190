"""vLLM binding: upstream's MooncakeStoreConnector with Moonlease's configuration and modes.

I/O adapter. Loaded by vLLM through `kv_connector_module_path: moonlease_connector`; keeps
upstream's class name because parts of vLLM (config/vllm.py) check the connector by name.
"""

from __future__ import annotations

import logging
import os

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector as UpstreamMooncakeStoreConnector,
)
from vllm.v1.kv_cache_interface import KVCacheConfig

from moonlease_connector.config import ConnectorConfigError, LeaseMode, MoonleaseConnectorConfig

logger = logging.getLogger("moonlease.connector")


class MooncakeStoreConnector(UpstreamMooncakeStoreConnector):
    """Drop-in replacement for upstream's connector; identical while every mode is off."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        assert vllm_config.kv_transfer_config is not None
        self.moonlease_config = MoonleaseConnectorConfig.from_sources(
            vllm_config.kv_transfer_config.kv_connector_extra_config, os.environ)
        if self.moonlease_config.lease_mode is not LeaseMode.LEASE_ALL or \
                self.moonlease_config.mooncake_junction_retention:
            raise ConnectorConfigError(
                f"lease mode {self.moonlease_config.lease_mode.value!r} / junction retention is "
                "not available in this Moonlease build yet: remove the mooncake_* mode keys")
        super().__init__(vllm_config, role, kv_cache_config)
        logger.info("Moonlease MooncakeStoreConnector (%s): lease mode %s",
                    role.name.lower(), self.moonlease_config.lease_mode.value)
