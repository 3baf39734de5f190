"""The lease modes: one vocabulary, each mode's facts on its strategy, and the one key that picks
a mode. Pure (the standard library only).

A mode's name is what users write everywhere: the CRD's `spec.connector.leaseMode`, the chart's
`vllm.connector.leaseMode`, the connector's `mooncake_lease_mode` and the `lease_mode` label of
the connector's metrics. What a mode needs — the `batch_probe_key` policies its lookups use, a
hybrid (full attention + align-mode Mamba) model, the store's LastHitOnly response contract —
is stated once, on its strategy here. The connector's capability and layout gates
(`moonlease_connector.core.capabilities`, `.last_hit_layout`), the operator's compatibility gate
and the CRD's CEL rule read it; the chart's `_validate.tpl` and
values schema are tested against it (tests/unit/test_lease_modes.py).

The connector took its mode from two booleans before `mooncake_lease_mode` existed
(`mooncake_selective_lease` with its environment variable, `mooncake_kda_last_hit_only`); they
are still read, as deprecated aliases (`choose_lease_mode`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar


class LeaseMode(str, Enum):
    """Which keys a lookup leases. The names are the CRD's `spec.connector.leaseMode`."""

    LEASE_ALL = "leaseAll"  # upstream: batch_is_exist leases every existing candidate
    SELECTIVE = "selective"  # seed 002: probe without lease, lease only the hit's load set
    LAST_HIT_ONLY = "lastHitOnly"  # seed 000: recurrent states via LastHitOnly probing


#: The `batch_probe_key` policy of last-hit-only lookups: Mooncake answers for the recurrent
#: checkpoint a hit would load (`moonlease_connector.core.last_hit` reads its answers).
LAST_HIT_ONLY_POLICY = "LastHitOnly"

#: The connector key (in `kv_connector_extra_config` and the settings file) naming the mode.
LEASE_MODE_KEY = "mooncake_lease_mode"
#: Seed 002's switch, still read as an alias of `mooncake_lease_mode: selective`.
SELECTIVE_LEASE_ENV = "VLLM_MOONCAKE_STORE_SELECTIVE_LEASE"


class LeaseModeStrategy:
    """What one lease mode is and needs. Subclassed once per mode; never instantiated."""

    mode: ClassVar[LeaseMode]
    #: One line for people (CRD, chart and connector docs say the same).
    summary: ClassVar[str]
    #: The `batch_probe_key` policies its lookups call (empty: upstream's calls only, any
    #: Mooncake); any policy needs Mooncake >= 0.3.14 on the master and every client.
    probe_policies: ClassVar[tuple[str, ...]] = ()
    #: Whether it needs a hybrid model: every prefix-cached group full attention or align-mode
    #: Mamba, with a Mamba group (`moonlease_connector.core.last_hit_layout`); CRD targets
    #: declare `hybrid: true`.
    needs_hybrid_model: ClassVar[bool] = False
    #: Whether the worker detects the store's LastHitOnly response contract before lookups.
    detects_probe_contract: ClassVar[bool] = False
    #: The deprecated boolean `kv_connector_extra_config` key that switched it on, if any.
    alias_key: ClassVar[str | None] = None
    #: The deprecated environment variable that switched it on, if any.
    alias_env: ClassVar[str | None] = None

    @classmethod
    def needs_probe_key(cls) -> bool:
        """Whether it needs Mooncake's `batch_probe_key` (>= 0.3.14 everywhere)."""
        return bool(cls.probe_policies)


class LeaseAll(LeaseModeStrategy):
    mode = LeaseMode.LEASE_ALL
    summary = "every key a lookup finds is leased (vLLM's behaviour)"


class Selective(LeaseModeStrategy):
    mode = LeaseMode.SELECTIVE
    summary = "candidates are probed without a lease; only the keys loading the hit reads are leased"
    probe_policies = ("none",)
    alias_key = "mooncake_selective_lease"
    alias_env = SELECTIVE_LEASE_ENV


class LastHitOnly(LeaseModeStrategy):
    mode = LeaseMode.LAST_HIT_ONLY
    summary = ("KV keys as vLLM, recurrent states through one LastHitOnly probe: only the selected "
               "recurrent checkpoint is leased (hybrid models only)")
    # Also a lease-free question when the final-token pass depends on it.
    probe_policies = (LAST_HIT_ONLY_POLICY, "none")
    needs_hybrid_model = True
    detects_probe_contract = True
    alias_key = "mooncake_kda_last_hit_only"


#: Every mode's strategy, in the enum's order.
STRATEGIES: Mapping[LeaseMode, type[LeaseModeStrategy]] = {
    strategy.mode: strategy for strategy in (LeaseAll, Selective, LastHitOnly)}
assert list(STRATEGIES) == list(LeaseMode), "one strategy per LeaseMode, in order"


def strategy_of(mode: LeaseMode) -> type[LeaseModeStrategy]:
    return STRATEGIES[mode]


#: The deprecated keys, each with the mode it switched on.
ALIAS_KEYS: Mapping[str, LeaseMode] = {
    s.alias_key: s.mode for s in STRATEGIES.values() if s.alias_key is not None}
#: The deprecated environment variables, each with the mode it switched on.
ALIAS_ENVS: Mapping[str, LeaseMode] = {
    s.alias_env: s.mode for s in STRATEGIES.values() if s.alias_env is not None}


class LeaseModeError(ValueError):
    """Lease-mode settings that contradict each other or are not understood."""


def parse_lease_mode(value: Any, where: str = LEASE_MODE_KEY) -> LeaseMode:
    """A mode from its name as users write it; a clear error otherwise."""
    if isinstance(value, LeaseMode):
        return value
    try:
        return LeaseMode(value)
    except ValueError:
        raise LeaseModeError(f"{where}={value!r} is not a lease mode: use one of "
                             f"{', '.join(m.value for m in LeaseMode)}") from None


def parse_env_bool(name: str, value: str) -> bool:
    normalized = value.strip().lower()
    if normalized in {"1", "true", "yes", "on"}:
        return True
    if normalized in {"0", "false", "no", "off"}:
        return False
    raise LeaseModeError(f"{name}={value!r} is not a boolean: use 1 or 0")


@dataclass(frozen=True)
class ModeChoice:
    """What one source of settings says about the lease mode.

    `mode`: the mode it names (None: it names none); `excluded`: modes it switches off without
    naming another (an alias set to false); `aliases`: the deprecated spellings it used, as
    written (for the deprecation warning).
    """

    mode: LeaseMode | None = None
    excluded: frozenset[LeaseMode] = frozenset()
    aliases: tuple[str, ...] = field(default=())

    def over(self, base: LeaseMode) -> LeaseMode:
        """The mode once this source is laid over `base` (a start-up default, a dump): its own
        mode if it names one, else `base` unless it switched `base` off (then leaseAll)."""
        if self.mode is not None:
            return self.mode
        return LeaseMode.LEASE_ALL if base in self.excluded else base

    def deprecation(self, where: str = "kv_connector_extra_config") -> str | None:
        """The one warning for the aliases used, naming the key and value to write instead."""
        if not self.aliases:
            return None
        value = (self.mode or LeaseMode.LEASE_ALL).value
        return (f"{', '.join(self.aliases)}: deprecated lease-mode setting; write "
                f"\"{LEASE_MODE_KEY}\": \"{value}\" in {where} instead"
                + ("" if self.mode is not None else " (or leave the key out)"))


def choose_lease_mode(keys: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> ModeChoice:
    """What one source says: `mooncake_lease_mode` and the deprecated aliases among `keys` (and,
    at start-up, the aliases' environment variables), which must agree.

    An alias set to true names its mode; set to false it only rules its mode out. Raises
    `LeaseModeError` when two statements contradict each other: two modes switched on, an alias
    that disagrees with the key or with its environment variable, an alias switching off the
    mode the key names.
    """
    named: dict[LeaseMode, list[str]] = {}
    excluded: dict[LeaseMode, list[str]] = {}
    aliases: list[str] = []
    said: dict[LeaseMode, tuple[str, bool]] = {}
    for key, mode in ALIAS_KEYS.items():
        if key not in keys:
            continue
        value = keys[key]
        if not isinstance(value, bool):
            raise LeaseModeError(f"{key}={value!r} is not a boolean: use true or false "
                                 f"(better: \"{LEASE_MODE_KEY}\": \"{mode.value}\")")
        spelled = f"{key}={str(value).lower()}"
        said[mode] = (spelled, value)
        aliases.append(spelled)
        (named if value else excluded).setdefault(mode, []).append(spelled)
    for name, mode in ALIAS_ENVS.items():
        raw = (environ or {}).get(name)
        if raw is None or not raw.strip():
            continue
        value = parse_env_bool(name, raw)
        spelled = f"{name}={raw}"
        if mode in said and said[mode][1] is not value:
            raise LeaseModeError(f"{spelled} contradicts {said[mode][0]}: set one of them "
                                 f"(better: only \"{LEASE_MODE_KEY}\")")
        aliases.append(spelled)
        (named if value else excluded).setdefault(mode, []).append(spelled)
    if len(named) > 1:
        raise LeaseModeError(" and ".join(spelled[0] for spelled in named.values())
                             + " switch on different lease modes: choose one, as \""
                             + LEASE_MODE_KEY + "\"")
    alias_mode = next(iter(named), None)
    if LEASE_MODE_KEY in keys:
        mode = parse_lease_mode(keys[LEASE_MODE_KEY])
        clash = named.get(alias_mode, []) if alias_mode not in (None, mode) else excluded.get(mode, [])
        if clash:
            raise LeaseModeError(f"{LEASE_MODE_KEY}={mode.value} contradicts {', '.join(clash)}: "
                                 f"remove the deprecated setting")
        return ModeChoice(mode, frozenset(), tuple(aliases))
    return ModeChoice(alias_mode, frozenset(excluded), tuple(aliases))
