"""The connector's settings as vLLM hands them over: one derivation for every role.

I/O adapter (reads the process environment). The connector, the worker and the scheduler each
take upstream's constructor arguments and derive Moonlease's settings here, so code that builds
upstream's classes with upstream's signature builds ours the same way and they always agree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from vllm.config import VllmConfig

from moonlease_settings.config import MoonleaseConnectorConfig
from moonlease_settings.settings_file import SettingsDelivery, delivery_from_sources


def connector_settings(vllm_config: VllmConfig,
                       environ: Mapping[str, str] | None = None) -> MoonleaseConnectorConfig:
    """Moonlease's keys in `kv_connector_extra_config` plus the environment, validated."""
    transfer = vllm_config.kv_transfer_config
    extra_config = transfer.kv_connector_extra_config if transfer is not None else {}
    return MoonleaseConnectorConfig.from_sources(extra_config,
                                                 os.environ if environ is None else environ)


def settings_delivery(vllm_config: VllmConfig, environ: Mapping[str, str] | None = None) -> SettingsDelivery:
    """Where live settings come from (`mooncake_settings_file`, `MOONLEASE_SETTINGS_FILE`) and the
    settings endpoint's port; no file: the start-up settings are final."""
    transfer = vllm_config.kv_transfer_config
    extra_config = transfer.kv_connector_extra_config if transfer is not None else {}
    return delivery_from_sources(extra_config, os.environ if environ is None else environ)
