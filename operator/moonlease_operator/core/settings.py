"""What a policy's settings are, rendered once from the spec, and which owned slots of each
workload they fill. Pure.

`build_connector_settings` renders `spec.connector` through the connector's own config model
(the lease-mode enum is the connector's, shared by the CRD) into the keys of the connector's
settings file (`core.connector_delivery`); `build_master_settings` renders
`spec.master` into Mooncake's flag names. The `build_*_desired` functions say, per workload,
what each owned slot (see `core.slots`) should hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moonlease_settings.config import LEASE_MODE_KEY, MoonleaseConnectorConfig
from moonlease_settings.retention import RetentionSettings
from moonlease_operator.api import ConnectorSpec, MasterConfigMapSpec, MasterSpec, build_master_flags
from moonlease_operator.api.policy import MASTER_FLAGS
from moonlease_operator.core.changes import Wrapped
from moonlease_operator.core.config_hash import build_config_hash
from moonlease_operator.core.connector_delivery import build_adoption_desired, script_loads_settings
from moonlease_operator.core.workload_args import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    find_container,
    is_our_module,
    kv_doc,
)

#: The connector settings `spec.connector` decides, written whether on or off.
MANAGED_SWITCHES = frozenset({LEASE_MODE_KEY, "mooncake_junction_retention",
                              "mooncake_retention_pin", "mooncake_retention_skip", "mooncake_retention_retry",
                              "mooncake_retention_evict"})
DEFAULT_KV_ROLE = "kv_both"


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector configuration every target gets, rendered once from `spec.connector`."""

    file: Mapping[str, Any]
    """The keys of each target's settings file: exactly those the spec decides (the others
    keep the workload's own start-up defaults)."""
    config_hash: str


def build_connector_settings(connector: ConnectorSpec,
                             master_watermark: float | None = None) -> ConnectorSettings:
    """Render `spec.connector` through the connector's own config model (decide once).

    `for_mode` sets the switches the policy decides; only those keys are owned, so settings the
    policy does not expose (e.g. `mooncake_max_lease_rounds`) stay as the user wrote them. Every
    switch the policy manages is written, `false` included (`MANAGED_SWITCHES`): a key left out
    would fall back to the workload's start-up settings, so turning a piece off (or leaving it
    off while a chart's start-up config turns it on) would never reach the pods.
    """
    config = MoonleaseConnectorConfig.for_mode(connector.lease_mode,
                                               junction_retention=connector.junction_retention,
                                               retention=RetentionSettings(pin=connector.retention_pin,
                                                                           skip=connector.retention_skip,
                                                                           retry=connector.retention_retry,
                                                                           evict=connector.retention_evict,
                                                                           **_evict_watermark(master_watermark)))
    rendered = config.to_extra_config()
    file = {k: v for k, v in rendered.items() if k in config.model_fields_set or k in MANAGED_SWITCHES}
    digest = build_config_hash({"connector": CONNECTOR_CLASS, "file": file})
    return ConnectorSettings(file=file, config_hash=digest)


def _evict_watermark(master_watermark: float | None) -> dict[str, float]:
    """Retention `evict` keeps the store under the master's watermark (the spec's; the CRD
    requires it declared when evict is on)."""
    return {} if master_watermark is None else {"evict_watermark": master_watermark}


@dataclass(frozen=True)
class MasterSettings:
    """The master settings the policy declares, rendered once from `spec.master`."""

    values: Mapping[str, bool | int | float]
    """Flag name -> typed value (what a config file gets)."""
    flags: Mapping[str, str]
    """Flag name -> gflags spelling of the value (what the args get)."""
    config_map: MasterConfigMapSpec | None
    config_hash: str


def build_master_settings(master: MasterSpec) -> MasterSettings:
    values = {flag: getattr(master, name) for name, flag in MASTER_FLAGS.items() if getattr(master, name) is not None}
    flags = build_master_flags(master)
    config_map = master.config_map
    digest = build_config_hash({"flags": flags,
                                "configMap": None if config_map is None else config_map.model_dump()})
    return MasterSettings(values=values, flags=flags, config_map=config_map, config_hash=digest)


def build_target_desired(obj: Mapping[str, Any], container: str | None, config_map: str) -> dict[str, Wrapped]:
    """The owned slots of a vLLM workload: our connector loaded, and its settings file mounted
    from `config_map` (adoption; the settings themselves live in the ConfigMap).

    The connector keys are set only where the user has not set them (`evaluate_target` refuses
    a workload that names another connector); a module path of ours that the user chose, and
    any `kv_role` already there, are kept.
    """
    found = find_container(obj, container) or {}
    if script_loads_settings(found) is not None:
        # A shell script loads the connector itself (`evaluate_target` checked that it does):
        # only the volume and the mount can be added.
        return build_adoption_desired(config_map, in_args=False)
    doc = kv_doc(found) or {}
    module = doc.get("kv_connector_module_path")
    desired: dict[str, Wrapped] = {
        "kv:kv_connector": {"v": CONNECTOR_CLASS},
        "kv:kv_connector_module_path": {"v": module if is_our_module(module) else CONNECTOR_MODULE},
        "kv:kv_role": {"v": doc["kv_role"] if doc.get("kv_role") is not None else DEFAULT_KV_ROLE},
    }
    desired.update(build_adoption_desired(config_map))
    return desired


def build_master_desired(settings: MasterSettings) -> dict[str, Wrapped]:
    """The master's owned slots: its flags in the container args (`--name=value`)."""
    return {f"flag:{name}": {"v": [f"--{name}={value}"]} for name, value in settings.flags.items()}


def build_config_map_desired(settings: MasterSettings) -> dict[str, Wrapped]:
    """The owned keys of the master's config file (typed values, Mooncake's flag names)."""
    return {f"doc:{name}": {"v": value} for name, value in settings.values.items()}

