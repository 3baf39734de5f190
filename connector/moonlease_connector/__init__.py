"""Moonlease's MooncakeStoreConnector for vLLM: lease modes for a shared Mooncake KV store.

Load it into any vLLM with
    --kv-transfer-config '{"kv_connector": "MooncakeStoreConnector",
                           "kv_connector_module_path": "moonlease_connector",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

The class keeps upstream's name because parts of vLLM check the connector by name. It is
imported lazily (PEP 562) so that the pure `core` stays importable without vLLM or torch. The
settings the connector reads (its typed configuration, the settings file, the lease modes) are
the `moonlease-settings` distribution's (`moonlease_settings`), which the operator shares.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MooncakeStoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "MooncakeStoreConnector":
        from moonlease_connector.adapters.vllm_connector import MooncakeStoreConnector

        return MooncakeStoreConnector
    raise AttributeError(f"module 'moonlease_connector' has no attribute {name!r}")
