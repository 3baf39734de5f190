"""Whether a running connector takes new settings from its settings file, decided once. Pure.

Called by the settings watcher (`adapters.settings_watcher`) each time the file's content
changes. A change the running connector cannot serve — a lease mode its Mooncake client lacks
the calls for, last-hit-only on a model without an align-mode recurrent group — is refused:
the connector keeps what it runs and reports the refusal with its reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from moonlease_settings.config import ConnectorConfigError, LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.capabilities import StoreCapabilities, missing_capability
from moonlease_settings.settings_file import parse_settings_file, settings_hash


class SettingsSource(str, Enum):
    """Where the settings a connector runs came from."""

    STARTUP = "startup"  # kv_connector_extra_config and the environment
    FILE = "file"  # the settings file


class RefusalReason(str, Enum):
    """Why a settings file was not applied (the `reason` label of the refusals metric)."""

    UNREADABLE = "unreadable"  # missing or unreadable file
    INVALID = "invalid"  # not JSON, unknown key, bad value, two lease modes
    CLIENT_UNSUPPORTED = "client_unsupported"  # the Mooncake client lacks the mode's calls
    MODEL_UNSUPPORTED = "model_unsupported"  # the model's KV layout cannot run the mode


@dataclass(frozen=True)
class ActiveSettings:
    """What a connector runs: the settings, where they came from, and their hash."""

    config: MoonleaseConnectorConfig
    source: SettingsSource

    @property
    def hash(self) -> str:
        return settings_hash(self.config)


@dataclass(frozen=True)
class SwitchDecision:
    """The outcome of reading one version of the settings file.

    `active` is what runs afterwards (the old settings when refused or unchanged); `refusal`
    is None unless the file was refused; `refused_hash` is the hash of the refused settings
    when they parsed (None for unreadable or invalid files); `message` says what happened.
    """

    active: ActiveSettings
    switched: bool
    refusal: RefusalReason | None
    refused_hash: str | None
    message: str


#: The model-layout check: None when the model can run `mode`, else why not.
LayoutCheck = Callable[[LeaseMode], "str | None"]


def refuse(current: ActiveSettings, reason: RefusalReason, message: str,
           refused_hash: str | None = None) -> SwitchDecision:
    """Keep `current`; say why the file was not applied."""
    return SwitchDecision(current, False, reason, refused_hash,
                          f"settings file refused ({reason.value}): {message}; keeping lease mode "
                          f"{current.config.lease_mode.value} (settings {current.hash})")


def decide_switch(current: ActiveSettings, text: str, *, defaults: MoonleaseConnectorConfig,
                  capabilities: StoreCapabilities, layout_problem: LayoutCheck) -> SwitchDecision:
    """Apply the file's settings if they are valid and this connector can serve them."""
    try:
        proposed = parse_settings_file(text, defaults)
    except ConnectorConfigError as error:
        return refuse(current, RefusalReason.INVALID, str(error))
    if proposed == current.config:
        return SwitchDecision(ActiveSettings(proposed, SettingsSource.FILE), False, None, None,
                              f"settings file unchanged in effect (settings {current.hash})")
    mode = proposed.lease_mode
    if mode != current.config.lease_mode:
        problem = missing_capability(mode, capabilities)
        if problem is not None:
            return refuse(current, RefusalReason.CLIENT_UNSUPPORTED, problem, settings_hash(proposed))
        problem = layout_problem(mode)
        if problem is not None:
            return refuse(current, RefusalReason.MODEL_UNSUPPORTED, problem, settings_hash(proposed))
    active = ActiveSettings(proposed, SettingsSource.FILE)
    return SwitchDecision(active, True, None, None,
                          f"settings switched to lease mode {mode.value}, junction retention "
                          f"{'on' if proposed.mooncake_junction_retention else 'off'}, "
                          f"max lease rounds {proposed.mooncake_max_lease_rounds} "
                          f"(settings {active.hash}, was {current.hash})")
