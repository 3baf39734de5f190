"""The connector's typed configuration: the switches the operator sets, validated at start-up.

Pure: pydantic only, so the operator imports it to render exactly these keys.

Read from `kv_connector_extra_config` (next to upstream's own keys, which are left alone) and,
for selective lease, from the environment variable the upstream proposal names. Every mode is
off by default, which is upstream's behaviour.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moonlease_connector.core.retention import RetentionSettings

#: Seed 002's switch, honoured as an alternative to the config key.
SELECTIVE_LEASE_ENV = "VLLM_MOONCAKE_STORE_SELECTIVE_LEASE"

#: Keys upstream's MooncakeStoreConnector reads from kv_connector_extra_config (vLLM 0.32/0.33).
UPSTREAM_EXTRA_CONFIG_KEYS = frozenset({
    "load_async", "lookup_async", "enable_lookup", "save_decode_cache", "lookup_rpc_port",
    "cache_prefix", "enable_group_semantics", "custom_mem_pool", "store_tp_size",
    "enable_store_tp_lcm", "prefill_tp_sizes", "enable_cross_layers_blocks",
    "preferred_segment", "enable_kv_events",
})

#: Moonlease keys that say where live settings come from, not what they are
#: (`moonlease_connector.settings`); never part of the settings or their hash.
DELIVERY_EXTRA_CONFIG_KEYS = frozenset({"mooncake_settings_file", "mooncake_settings_metrics_port"})


class LeaseMode(str, Enum):
    """Which keys a lookup leases. The names match the CRD's `spec.connector.leaseMode`."""

    LEASE_ALL = "leaseAll"  # upstream: batch_is_exist leases every existing candidate
    SELECTIVE = "selective"  # seed 002: probe without lease, lease only the hit's load set
    LAST_HIT_ONLY = "lastHitOnly"  # seed 000: recurrent states via LastHitOnly probing


class ConnectorConfigError(ValueError):
    """A bad connector setting; the message says what to change."""


class MoonleaseConnectorConfig(BaseModel):
    """Moonlease's keys in `kv_connector_extra_config`. All default to upstream behaviour."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    mooncake_selective_lease: bool = Field(
        False, description="Seed 002: probe candidates without a lease, then lease only the keys "
                           "loading the hit reads. Needs Mooncake >= 0.3.14 everywhere.")
    mooncake_kda_last_hit_only: bool = Field(
        False, description="Seed 000: for full-attention + align-mode Mamba models, look up and "
                           "lease only the selected recurrent checkpoint.")
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
                           "removes the keys its saves touched least recently (batch_remove, "
                           "not forced), so conversations leave whole and oldest first instead "
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

    @model_validator(mode="after")
    def _one_lease_mode(self) -> MoonleaseConnectorConfig:
        if self.mooncake_selective_lease and self.mooncake_kda_last_hit_only:
            raise ValueError("mooncake_selective_lease and mooncake_kda_last_hit_only are "
                             "alternative lease modes: enable at most one")
        return self

    @property
    def lease_mode(self) -> LeaseMode:
        if self.mooncake_selective_lease:
            return LeaseMode.SELECTIVE
        if self.mooncake_kda_last_hit_only:
            return LeaseMode.LAST_HIT_ONLY
        return LeaseMode.LEASE_ALL

    @property
    def finds_junctions(self) -> bool:
        """Lookups report shared-prefix junctions and saves keep what a sibling resumes from there:
        junction retention, and retention `skip` (which must not skip the state at a junction)."""
        return self.mooncake_junction_retention or self.mooncake_retention_skip

    @property
    def retention(self) -> RetentionSettings:
        """The retention pieces on (`core.retention`)."""
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
        return cls(mooncake_selective_lease=mode is LeaseMode.SELECTIVE,
                   mooncake_kda_last_hit_only=mode is LeaseMode.LAST_HIT_ONLY,
                   mooncake_junction_retention=junction_retention, **pieces)

    def to_extra_config(self) -> dict[str, Any]:
        """The keys to put in `kv_connector_extra_config` (what the operator renders)."""
        return self.model_dump()

    @classmethod
    def from_sources(cls, extra_config: Mapping[str, Any] | None,
                     environ: Mapping[str, str] | None = None) -> MoonleaseConnectorConfig:
        """Validate our keys in the extra config plus the environment; upstream keys pass."""
        extra = dict(extra_config or {})
        ours = {k: v for k, v in extra.items() if k in cls.model_fields}
        unknown = sorted(k for k in extra if k not in cls.model_fields
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

        env_value = (environ or {}).get(SELECTIVE_LEASE_ENV)
        if env_value is not None and env_value.strip() != "":
            env_on = _parse_env_bool(env_value)
            if "mooncake_selective_lease" in ours and ours["mooncake_selective_lease"] is not env_on:
                raise ConnectorConfigError(
                    f"{SELECTIVE_LEASE_ENV}={env_value} contradicts kv_connector_extra_config "
                    f"mooncake_selective_lease={ours['mooncake_selective_lease']}: set one of them")
            ours.setdefault("mooncake_selective_lease", env_on)
        try:
            return cls(**ours)
        except ValidationError as error:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}"
                for e in error.errors())
            raise ConnectorConfigError(
                f"invalid Moonlease connector settings in kv_connector_extra_config: {problems}. "
                "Use JSON booleans (true/false) for the mode switches.") from None


def _parse_env_bool(value: str) -> bool:
    normalized = value.strip().lower()
    if normalized in {"1", "true", "yes", "on"}:
        return True
    if normalized in {"0", "false", "no", "off"}:
        return False
    raise ConnectorConfigError(f"{SELECTIVE_LEASE_ENV}={value!r} is not a boolean: use 1 or 0")
