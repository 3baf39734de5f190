"""Live connector settings: the settings file's format, its validation, and the settings hash.

Pure (pydantic and the standard library only), imported by both sides so they agree byte for
byte: the operator renders the file into a ConfigMap with `render_settings_file` and expects
`settings_hash` back from every pod; the connector parses the mounted file with
`parse_settings_file` and exports `settings_hash` of what it runs.

Precedence (decided here, once): the settings file, when the connector has one and it is valid
and servable, wins over the start-up defaults (`kv_connector_extra_config` and the deprecated
`VLLM_MOONCAKE_STORE_SELECTIVE_LEASE`); a key the file leaves out keeps its start-up default. A
file may still say the lease mode with the deprecated booleans (an operator of an earlier
release writes them): read as `mooncake_lease_mode`, with a warning.
A file the connector refuses leaves the settings it runs unchanged.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from moonlease_settings.config import (
    DELIVERY_EXTRA_CONFIG_KEYS,
    ConnectorConfigError,
    MoonleaseConnectorConfig,
    warn_deprecated,
)
from moonlease_settings.lease_modes import (
    ALIAS_KEYS,
    LEASE_MODE_KEY,
    LeaseModeError,
    choose_lease_mode,
)

#: `kv_connector_extra_config` key naming the settings file (what the operator mounts there).
SETTINGS_FILE_KEY = "mooncake_settings_file"
#: Environment variable naming the settings file (used when the extra config does not).
SETTINGS_FILE_ENV = "MOONLEASE_SETTINGS_FILE"
#: `kv_connector_extra_config` key: port of the connector's own settings metrics endpoint.
SETTINGS_METRICS_PORT_KEY = "mooncake_settings_metrics_port"
#: Environment variable for the same port.
SETTINGS_METRICS_PORT_ENV = "MOONLEASE_SETTINGS_METRICS_PORT"
assert DELIVERY_EXTRA_CONFIG_KEYS == {SETTINGS_FILE_KEY, SETTINGS_METRICS_PORT_KEY}

#: Name of the file inside the mounted ConfigMap (its data key).
SETTINGS_FILE_NAME = "connector-settings.json"
#: Where the operator mounts the ConfigMap in vLLM containers, and the file path that gives.
SETTINGS_MOUNT_DIR = "/etc/moonlease/connector"
SETTINGS_FILE_PATH = f"{SETTINGS_MOUNT_DIR}/{SETTINGS_FILE_NAME}"
#: Default port of the connector's settings metrics endpoint (served by TP rank 0; 0 = any free
#: port, logged).
DEFAULT_SETTINGS_METRICS_PORT = 9410

#: Metric families of the settings endpoint (Prometheus naming: `_info` gauge, `_total` counters).
SETTINGS_INFO_METRIC = "moonlease_connector_settings_info"
SETTINGS_REFUSED_METRIC = "moonlease_connector_settings_refused_info"
SETTINGS_REFUSALS_METRIC = "moonlease_connector_settings_refusals_total"
SETTINGS_SWITCHES_METRIC = "moonlease_connector_settings_switches_total"


def canonical_settings(config: MoonleaseConnectorConfig) -> str:
    """The settings that differ from their defaults, serialized one way only (sorted keys, no
    whitespace).

    Defaults are left out so that a setting added in a later release, at its default, does not
    change the hash: an operator one release ahead of the connector images it rolls out to still
    computes the hash those connectors report. For the same reason the lease mode is spelled
    here as it was before `mooncake_lease_mode` existed (its strategy's alias switched on): a
    connector that reads the new key reports the hash an operator writing the old keys expects.
    """
    data = config.model_dump(mode="json", exclude_defaults=True)
    mode = data.pop(LEASE_MODE_KEY, None)
    if mode is not None:
        alias = config.strategy.alias_key
        data.update({alias: True} if alias is not None else {LEASE_MODE_KEY: mode})
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def settings_hash(config: MoonleaseConnectorConfig) -> str:
    """The hash a running connector exports and the operator expects (16 hex digits)."""
    return hashlib.sha256(canonical_settings(config).encode()).hexdigest()[:16]


def render_settings_file(config: MoonleaseConnectorConfig) -> str:
    """The settings file's text: every setting, so the result does not depend on defaults."""
    return json.dumps(config.model_dump(mode="json"), sort_keys=True, indent=2) + "\n"


def parse_settings_file(text: str, defaults: MoonleaseConnectorConfig) -> MoonleaseConnectorConfig:
    """The settings a file asks for: its keys over `defaults`, validated by the config model.

    Raises `ConnectorConfigError` saying what is wrong (not JSON, not an object, an unknown key
    with a suggestion, a bad value, lease-mode settings that contradict each other).
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConnectorConfigError(f"settings file is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise ConnectorConfigError(
            f"settings file must hold a JSON object of connector settings, not {type(data).__name__}")
    fields = list(MoonleaseConnectorConfig.model_fields)
    unknown = sorted(k for k in data if k not in MoonleaseConnectorConfig.model_fields and k not in ALIAS_KEYS)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, fields, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConnectorConfigError(f"unknown key(s) in the settings file: {', '.join(hints)}. "
                                   f"Known keys: {', '.join(sorted(fields))}.")
    try:
        choice = choose_lease_mode(data)
    except LeaseModeError as error:
        raise ConnectorConfigError(f"invalid settings file: {error}") from None
    data = {k: v for k, v in data.items() if k not in ALIAS_KEYS}
    if choice.mode is not None or choice.excluded:
        data[LEASE_MODE_KEY] = choice.over(defaults.lease_mode)
    warn_deprecated(choice, "the settings file")
    merged = {**defaults.model_dump(), **data}
    try:
        return MoonleaseConnectorConfig(**merged)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}"
                             for e in error.errors())
        raise ConnectorConfigError(f"invalid settings file: {problems}") from None


@dataclass(frozen=True)
class SettingsDelivery:
    """Where a connector reads live settings from, and where it reports them.

    `settings_file` None: no live settings, the start-up defaults are final (upstream's way).
    `metrics_port` None: no settings endpoint of the connector's own (the settings still show
    on vLLM's /metrics, after the next engine step).
    """

    settings_file: str | None
    metrics_port: int | None


def delivery_from_sources(extra_config: Mapping[str, Any] | None,
                          environ: Mapping[str, str] | None = None) -> SettingsDelivery:
    """The delivery keys of `kv_connector_extra_config`, else the environment. Pure."""
    extra = dict(extra_config or {})
    env = environ or {}
    path = extra.get(SETTINGS_FILE_KEY, env.get(SETTINGS_FILE_ENV) or None)
    if path is not None and (not isinstance(path, str) or not path.strip()):
        raise ConnectorConfigError(f"{SETTINGS_FILE_KEY} must be a file path, got {path!r}")
    raw_port = extra.get(SETTINGS_METRICS_PORT_KEY, env.get(SETTINGS_METRICS_PORT_ENV) or None)
    port: int | None
    if raw_port is None:
        port = DEFAULT_SETTINGS_METRICS_PORT if path is not None else None
    else:
        try:
            port = int(raw_port)
        except (TypeError, ValueError):
            raise ConnectorConfigError(
                f"{SETTINGS_METRICS_PORT_KEY} must be a port number, got {raw_port!r}") from None
        if not 0 <= port <= 65535:
            raise ConnectorConfigError(f"{SETTINGS_METRICS_PORT_KEY}={port} is not a port (0-65535)")
    return SettingsDelivery(path, port)
