"""The connector's typed configuration: the switches the operator sets, validated at start-up.

Pure: pydantic only, so the operator imports it to render exactly these keys.

Read from `kv_connector_extra_config` (next to upstream's own keys, which are left alone). The
lease mode is one key, `mooncake_lease_mode` (`lease_modes`); the booleans that picked it
before (and selective lease's environment variable) are read as deprecated aliases. Every
setting defaults to upstream's behaviour.
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moonlease_settings.lease_modes import (
    ALIAS_KEYS,
    LEASE_MODE_KEY,
    SELECTIVE_LEASE_ENV,
    LeaseMode,
    LeaseModeError,
    LeaseModeStrategy,
    ModeChoice,
    choose_lease_mode,
    parse_lease_mode,
    strategy_of,
)
from moonlease_settings.retention import RetentionSettings

__all__ = ["LEASE_MODE_KEY", "SELECTIVE_LEASE_ENV", "ConnectorConfigError", "DeprecatedSettingWarning",
           "LeaseMode", "MoonleaseConnectorConfig", "warn_deprecated"]

#: Keys upstream's MooncakeStoreConnector reads from kv_connector_extra_config (vLLM 0.32/0.33).
UPSTREAM_EXTRA_CONFIG_KEYS = frozenset({
    "load_async", "lookup_async", "enable_lookup", "save_decode_cache", "lookup_rpc_port",
    "cache_prefix", "enable_group_semantics", "custom_mem_pool", "store_tp_size",
    "enable_store_tp_lcm", "prefill_tp_sizes", "enable_cross_layers_blocks",
    "preferred_segment", "enable_kv_events",
})

#: Moonlease keys that say where live settings come from, not what they are
#: (`moonlease_settings.settings_file`); never part of the settings or their hash.
DELIVERY_EXTRA_CONFIG_KEYS = frozenset({"mooncake_settings_file", "mooncake_settings_metrics_port"})


class ConnectorConfigError(ValueError):
    """A bad connector setting; the message says what to change."""


class DeprecatedSettingWarning(FutureWarning):
    """A deprecated connector setting was read (shown by default: it is addressed to users)."""


def warn_deprecated(choice: ModeChoice, where: str) -> None:
    """The one warning for the lease-mode aliases a source used (none when it used none)."""
    message = choice.deprecation(where)
    if message is not None:
        warnings.warn(message, DeprecatedSettingWarning, stacklevel=3)


def check_service_url(url: str) -> str:
    """`url` if it names an HTTP service as ``http(s)://host[:port][/prefix]`` (the fleet order
    service's ``mooncake_fleet_order_url``); ValueError saying what to write otherwise."""
    if not re.fullmatch(r"https?://[^/:\s]+(:[0-9]{1,5})?(/\S*)?", url):
        raise ValueError(f"give the fleet order service as http://host:port (e.g. "
                         f"http://fleet-order:8790), not {url!r}")
    return url


class MoonleaseConnectorConfig(BaseModel):
    """Moonlease's keys in `kv_connector_extra_config`. All default to upstream behaviour."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    mooncake_lease_mode: LeaseMode = Field(
        LeaseMode.LEASE_ALL,
        description="Which keys a lookup leases: " + "; ".join(
            f"{mode.value}: {strategy_of(mode).summary}" for mode in LeaseMode)
        + ". Modes that probe need Mooncake >= 0.3.14 everywhere. Replaces mooncake_selective_lease, "
          "mooncake_kda_last_hit_only and VLLM_MOONCAKE_STORE_SELECTIVE_LEASE (still read, deprecated).")
    mooncake_junction_retention: bool = Field(
        False, description="Seed 004: keep sliding-window tails at shared-prefix junctions so "
                           "sibling prompts hit in the store.")
    mooncake_retention_pin: bool = Field(
        False, description="Moonlease retention: saves put the prompt's shared prefix (the deepest "
                           "prefix four different continuations have followed: a system prompt, "
                           "a branch point) soft-pinned, the rest unpinned, so the master evicts "
                           "the rest first. Needs Mooncake >= 0.3.14 clients and "
                           "allow_evict_soft_pinned_objects on the master.")
    mooncake_retention_skip: bool = Field(
        False, description="Moonlease retention: saves do not write sliding-window blocks or "
                           "recurrent states outside the resume set (dense retention's "
                           "intermediate states).")
    mooncake_retention_retry: bool = Field(
        False, description="Moonlease retention: keys a save's put was refused for lack of space "
                           "(NO_AVAILABLE_HANDLE) are put again after the master has evicted "
                           "(up to 3 times, 20 ms apart), instead of being dropped; Mamba states "
                           "only where a continuation resumes, not dense retention's "
                           "intermediate ones.")
    mooncake_retention_evict: bool = Field(
        False, description="Moonlease retention: before a save's put would take the store above "
                           "mooncake_retention_evict_watermark of its capacity (the master's "
                           "master_allocated_bytes / master_total_capacity_bytes), the connector "
                           "removes the keys its saves and loads touched least recently "
                           "(batch_remove, not forced), so conversations leave whole and oldest first instead "
                           "of by the master's near-random first eviction pass.")
    mooncake_retention_evict_watermark: float = Field(
        0.9, gt=0.0, le=1.0,
        description="Moonlease retention evict: the share of the store's capacity saves keep it "
                    "under; set it to the master's eviction_high_watermark_ratio (Mooncake's "
                    "default 0.9; the operator renders the policy's master setting).")
    mooncake_master_metrics_url: str | None = Field(
        None, description="Moonlease retention evict: the master's Prometheus endpoint (default "
                          "http://<master_server_address host>:9003/metrics, from "
                          "MOONCAKE_CONFIG_PATH).")
    mooncake_fleet_order_url: str | None = Field(
        None, description="Moonlease retention evict: the fleet order service "
                    "(python -m moonlease_connector.fleet_order, one per master; the chart's "
                    "fleetOrder), e.g. http://fleet-order:8790. Every engine of the store reports "
                    "its saves and loads there and removes the keys the whole fleet used least "
                    "recently; unset, evict orders only this engine's own keys. Read at start-up.")
    mooncake_max_lease_rounds: int = Field(
        3, ge=1, le=16, description="Selective lease: how many times a lookup may shorten its hit "
                                    "and lease again when keys vanish between probe and lease.")
    mooncake_lookup_timeout_ms: int = Field(
        1000, ge=0, le=600_000,
        description="Deadline of one lookup, in ms, kept by the scheduler's lookup client: past it "
                    "the lookup is a miss (reason store_timeout), and while that request is still "
                    "out (the worker stuck in a store call) later lookups miss at once until the "
                    "worker answers. The worker runs lookups inline. Read at start-up. 0 turns it "
                    "off: the scheduler waits for the worker, as upstream's.")

    mooncake_load_timeout_ms: int = Field(
        10_000, ge=0, le=600_000,
        description="Deadline of one load's store call (BatchGet), in ms, kept by the worker's "
                    "receive threads: past it the load is reported to vLLM as failed and the "
                    "request recomputes those tokens; the abandoned call's blocks stay out of the "
                    "free pool until it returns. Only with kv_load_failure_policy 'recompute' "
                    "(under 'fail' a failed load fails the request, so the connector leaves the "
                    "wait unbounded, as upstream's, and warns). Read at start-up. 0 turns it off.")

    mooncake_handoff_timeout_ms: int = Field(
        1000, ge=0, le=600_000,
        description="Prefill/decode through the store: how long, in ms, a decode engine's "
                    "lookup waits for the prompt a prefill engine promised to save (the "
                    "prefill's response carries the promise in kv_transfer_params, which P/D "
                    "routers pass on) before it loads what the store holds and recomputes the "
                    "rest; requests without a promise are looked up once, as upstream's. Read "
                    "at start-up. 0 turns the wait off.")

    @field_validator("mooncake_fleet_order_url")
    @classmethod
    def _service_url(cls, url: str | None) -> str | None:
        return None if url is None else check_service_url(url)

    @model_validator(mode="before")
    @classmethod
    def _lease_mode_aliases(cls, data: Any) -> Any:
        """The mode's name as users write it; deprecated aliases laid over the key (a dict that
        merges an alias over a whole dump says that mode). The user-facing sources
        (`from_sources`, the settings file) refuse contradictions before they get here."""
        if not isinstance(data, Mapping):
            return data
        values = {k: v for k, v in data.items() if k not in ALIAS_KEYS}
        if LEASE_MODE_KEY in values:
            values[LEASE_MODE_KEY] = parse_lease_mode(values[LEASE_MODE_KEY])
        aliases = {k: data[k] for k in ALIAS_KEYS if k in data}
        if aliases:
            choice = choose_lease_mode(aliases)
            values[LEASE_MODE_KEY] = choice.over(values.get(LEASE_MODE_KEY, LeaseMode.LEASE_ALL))
            warn_deprecated(choice, "kv_connector_extra_config")
        return values

    @property
    def lease_mode(self) -> LeaseMode:
        return self.mooncake_lease_mode

    @property
    def strategy(self) -> type[LeaseModeStrategy]:
        """The lease mode's facts (`moonlease_settings.lease_modes`)."""
        return strategy_of(self.mooncake_lease_mode)

    @property
    def finds_junctions(self) -> bool:
        """Lookups report shared-prefix junctions and saves keep what a sibling resumes from there:
        junction retention, and retention `skip` (which must not skip the state at a junction)."""
        return self.mooncake_junction_retention or self.mooncake_retention_skip

    @property
    def retention(self) -> RetentionSettings:
        """The retention pieces on (`moonlease_settings.retention`)."""
        return RetentionSettings(pin=self.mooncake_retention_pin, skip=self.mooncake_retention_skip,
                                 retry=self.mooncake_retention_retry, evict=self.mooncake_retention_evict,
                                 evict_watermark=self.mooncake_retention_evict_watermark)

    @classmethod
    def for_mode(cls, mode: LeaseMode, *, junction_retention: bool = False,
                 retention: RetentionSettings = RetentionSettings()) -> MoonleaseConnectorConfig:
        # Retention keys only when a piece is on: a policy without retention renders exactly the
        # keys it rendered before retention existed (same config hash, no rolling restart).
        # `retry` came later: its key is rendered only when it is on, so policies with pin or
        # skip keep their hash too.
        pieces: dict[str, Any] = (
            {"mooncake_retention_pin": retention.pin, "mooncake_retention_skip": retention.skip}
            if retention.pin or retention.skip else {})
        if retention.retry:
            pieces["mooncake_retention_retry"] = True
        if retention.evict:  # later still: rendered only when on, with the watermark it keeps
            pieces["mooncake_retention_evict"] = True
            pieces["mooncake_retention_evict_watermark"] = retention.evict_watermark
        return cls(mooncake_lease_mode=mode, mooncake_junction_retention=junction_retention, **pieces)

    def to_extra_config(self) -> dict[str, Any]:
        """The keys to put in `kv_connector_extra_config` (what the operator renders), as JSON
        values (the lease mode by its name)."""
        return self.model_dump(mode="json")

    @classmethod
    def from_sources(cls, extra_config: Mapping[str, Any] | None,
                     environ: Mapping[str, str] | None = None) -> MoonleaseConnectorConfig:
        """Validate our keys in the extra config plus the environment; upstream keys pass."""
        extra = dict(extra_config or {})
        ours = {k: v for k, v in extra.items() if k in cls.model_fields}
        unknown = sorted(k for k in extra if k not in cls.model_fields and k not in ALIAS_KEYS
                         and k not in UPSTREAM_EXTRA_CONFIG_KEYS and k not in DELIVERY_EXTRA_CONFIG_KEYS
                         and k.startswith("mooncake_"))
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, [*cls.model_fields, *DELIVERY_EXTRA_CONFIG_KEYS], n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConnectorConfigError(
                "unknown Moonlease key(s) in kv_connector_extra_config: " + ", ".join(hints)
                + f". Known keys: {', '.join(sorted(set(cls.model_fields) | DELIVERY_EXTRA_CONFIG_KEYS))}.")

        try:
            choice = choose_lease_mode(extra, environ)
        except LeaseModeError as error:
            raise ConnectorConfigError(f"lease-mode settings at start-up: {error}") from None
        if choice.mode is not None or choice.excluded:
            ours[LEASE_MODE_KEY] = choice.over(LeaseMode.LEASE_ALL)
        warn_deprecated(choice, "kv_connector_extra_config")
        try:
            return cls(**ours)
        except ValidationError as error:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}"
                for e in error.errors())
            raise ConnectorConfigError(
                f"invalid Moonlease connector settings in kv_connector_extra_config: {problems}. "
                "Use JSON booleans (true/false) for the switches.") from None
