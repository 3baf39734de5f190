"""Shared bits of the engine tests: our connector's kv-transfer-config, and engine counters."""

from __future__ import annotations

from typing import Any


def moonlease_transfer_config(**extra_config: Any) -> dict[str, Any]:
    """`--kv-transfer-config` loading our connector, with Moonlease keys in the extra config."""
    config: dict[str, Any] = {"kv_connector": "MooncakeStoreConnector",
                              "kv_connector_module_path": "moonlease_connector", "kv_role": "kv_both"}
    if extra_config:
        config["kv_connector_extra_config"] = dict(extra_config)
    return config


def engine_counter(llm: Any, name: str, **labels: str) -> float:
    """A counter of the engine's Prometheus registry (name without `_total`), summed over the
    labels not given."""
    return sum(float(metric.value) for metric in llm.get_metrics()
               if metric.name == name and all(metric.labels.get(k) == v for k, v in labels.items()))
