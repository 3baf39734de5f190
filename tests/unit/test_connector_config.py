"""The connector's configuration: defaults are upstream's, bad input says what to change; the
lease mode is one key, its earlier spellings deprecated aliases that must agree."""

from __future__ import annotations

import hashlib
import json
import re
import warnings

import pytest
from pydantic import ValidationError

from moonlease_settings.config import (
    LEASE_MODE_KEY,
    SELECTIVE_LEASE_ENV,
    ConnectorConfigError,
    DeprecatedSettingWarning,
    LeaseMode,
    MoonleaseConnectorConfig,
)
from moonlease_settings.lease_modes import ALIAS_KEYS
from moonlease_settings.settings_file import parse_settings_file, settings_hash

pytestmark = pytest.mark.unit


def test_defaults_are_upstream_behaviour() -> None:
    config = MoonleaseConnectorConfig.from_sources({"load_async": True, "lookup_rpc_port": 3}, {})
    assert config.lease_mode is LeaseMode.LEASE_ALL
    assert not config.mooncake_junction_retention


@pytest.mark.parametrize("mode", list(LeaseMode))
@pytest.mark.parametrize("junctions", [False, True])
def test_round_trip_through_extra_config(mode: LeaseMode, junctions: bool) -> None:
    rendered = MoonleaseConnectorConfig.for_mode(mode, junction_retention=junctions).to_extra_config()
    parsed = MoonleaseConnectorConfig.from_sources(rendered, {})
    assert parsed.lease_mode is mode
    assert parsed.mooncake_junction_retention is junctions


def test_the_lease_mode_key_takes_the_crd_spelling_without_a_warning() -> None:
    for mode in LeaseMode:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            config = MoonleaseConnectorConfig.from_sources({LEASE_MODE_KEY: mode.value}, {})
        assert config.lease_mode is mode and config.strategy.mode is mode


def test_rendered_extra_config_names_the_mode_once_and_no_alias() -> None:
    rendered = MoonleaseConnectorConfig.for_mode(LeaseMode.LAST_HIT_ONLY).to_extra_config()
    assert rendered[LEASE_MODE_KEY] == "lastHitOnly"
    assert not set(rendered) & set(ALIAS_KEYS)


def test_a_bad_mode_lists_the_modes() -> None:
    with pytest.raises(ConnectorConfigError, match="'sometimes' is not a lease mode: use one of "
                                                   "leaseAll, selective, lastHitOnly"):
        MoonleaseConnectorConfig.from_sources({LEASE_MODE_KEY: "sometimes"}, {})


@pytest.mark.parametrize(("extra", "environ", "mode", "write"), [
    ({"mooncake_selective_lease": True}, {}, LeaseMode.SELECTIVE, "selective"),
    ({"mooncake_kda_last_hit_only": True}, {}, LeaseMode.LAST_HIT_ONLY, "lastHitOnly"),
    ({}, {SELECTIVE_LEASE_ENV: "1"}, LeaseMode.SELECTIVE, "selective"),
    ({}, {SELECTIVE_LEASE_ENV: "0"}, LeaseMode.LEASE_ALL, "leaseAll"),
    ({"mooncake_selective_lease": True, "mooncake_kda_last_hit_only": False}, {SELECTIVE_LEASE_ENV: "1"},
     LeaseMode.SELECTIVE, "selective"),
    ({"mooncake_selective_lease": False, "mooncake_kda_last_hit_only": False}, {}, LeaseMode.LEASE_ALL,
     "leaseAll"),
    ({LEASE_MODE_KEY: "lastHitOnly", "mooncake_selective_lease": False}, {}, LeaseMode.LAST_HIT_ONLY,
     "lastHitOnly"),
])
def test_deprecated_aliases_still_work_with_one_warning_naming_key_and_value(
        extra: dict, environ: dict, mode: LeaseMode, write: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = MoonleaseConnectorConfig.from_sources(extra, environ)
    assert config.lease_mode is mode
    assert len(caught) == 1 and caught[0].category is DeprecatedSettingWarning
    message = str(caught[0].message)
    assert f'write "{LEASE_MODE_KEY}": "{write}"' in message
    for alias in [*(k for k in extra if k in ALIAS_KEYS), *environ]:
        assert alias in message


@pytest.mark.parametrize(("extra", "environ", "match"), [
    ({"mooncake_selective_lease": True, "mooncake_kda_last_hit_only": True}, {},
     "mooncake_selective_lease=true and mooncake_kda_last_hit_only=true switch on different lease modes"),
    ({"mooncake_selective_lease": False}, {SELECTIVE_LEASE_ENV: "1"},
     "VLLM_MOONCAKE_STORE_SELECTIVE_LEASE=1 contradicts mooncake_selective_lease=false"),
    ({"mooncake_kda_last_hit_only": True}, {SELECTIVE_LEASE_ENV: "1"}, "switch on different lease modes"),
    ({LEASE_MODE_KEY: "leaseAll", "mooncake_selective_lease": True}, {},
     "mooncake_lease_mode=leaseAll contradicts mooncake_selective_lease=true"),
    ({LEASE_MODE_KEY: "selective"}, {SELECTIVE_LEASE_ENV: "0"},
     "mooncake_lease_mode=selective contradicts VLLM_MOONCAKE_STORE_SELECTIVE_LEASE=0"),
    ({LEASE_MODE_KEY: "selective", "mooncake_kda_last_hit_only": True}, {},
     "mooncake_lease_mode=selective contradicts mooncake_kda_last_hit_only=true"),
    ({}, {SELECTIVE_LEASE_ENV: "maybe"}, "VLLM_MOONCAKE_STORE_SELECTIVE_LEASE='maybe' is not a boolean"),
    ({"mooncake_selective_lease": "yes"}, {}, "mooncake_selective_lease='yes' is not a boolean"),
])
def test_contradicting_lease_settings_stop_start_up(extra: dict, environ: dict, match: str) -> None:
    with pytest.raises(ConnectorConfigError, match=re.escape(match)):
        MoonleaseConnectorConfig.from_sources(extra, environ)


def test_an_alias_merged_over_a_whole_dump_says_its_mode() -> None:
    """Code that lays the old key over a dump of the defaults (the compat tier's forced modes
    do) gets that mode: the dump's leaseAll is a default, not the user's word."""
    base = MoonleaseConnectorConfig(mooncake_max_lease_rounds=5)
    with pytest.warns(DeprecatedSettingWarning, match='"mooncake_lease_mode": "selective"'):
        forced = MoonleaseConnectorConfig.model_validate({**base.model_dump(), "mooncake_selective_lease": True})
    assert forced.lease_mode is LeaseMode.SELECTIVE and forced.mooncake_max_lease_rounds == 5
    with pytest.raises(ValidationError, match="switch on different lease modes"):
        MoonleaseConnectorConfig.model_validate({"mooncake_selective_lease": True, "mooncake_kda_last_hit_only": True})


def test_a_settings_file_of_an_earlier_operator_is_read_and_reports_the_same_hash() -> None:
    """An operator of the previous release writes the booleans and expects the hash of what it
    wrote: a connector reading them as `mooncake_lease_mode` reports exactly that hash."""
    defaults = MoonleaseConnectorConfig()
    old_file = json.dumps({"mooncake_selective_lease": True, "mooncake_kda_last_hit_only": False,
                           "mooncake_junction_retention": True})
    with pytest.warns(DeprecatedSettingWarning, match="in the settings file instead"):
        parsed = parse_settings_file(old_file, defaults)
    assert parsed == MoonleaseConnectorConfig.for_mode(LeaseMode.SELECTIVE, junction_retention=True)
    legacy = hashlib.sha256(b'{"mooncake_junction_retention":true,"mooncake_selective_lease":true}')
    assert settings_hash(parsed) == legacy.hexdigest()[:16]
    # An alias switched off in a file drops the start-up mode it names, and only that one.
    last_hit = MoonleaseConnectorConfig.for_mode(LeaseMode.LAST_HIT_ONLY)
    with pytest.warns(DeprecatedSettingWarning):
        assert parse_settings_file('{"mooncake_kda_last_hit_only": false}', last_hit).lease_mode is LeaseMode.LEASE_ALL
        assert parse_settings_file('{"mooncake_selective_lease": false}', last_hit).lease_mode is LeaseMode.LAST_HIT_ONLY
    with pytest.raises(ConnectorConfigError, match="contradicts"):
        parse_settings_file('{"mooncake_lease_mode": "leaseAll", "mooncake_kda_last_hit_only": true}', defaults)


def test_misspelt_key_gets_a_suggestion() -> None:
    with pytest.raises(ConnectorConfigError, match="did you mean 'mooncake_lease_mode'"):
        MoonleaseConnectorConfig.from_sources({"mooncake_lease_mod": "selective"}, {})


def test_string_instead_of_boolean_is_rejected_with_advice() -> None:
    with pytest.raises(ConnectorConfigError, match="JSON booleans"):
        MoonleaseConnectorConfig.from_sources({"mooncake_junction_retention": "yes"}, {})
