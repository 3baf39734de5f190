"""The connector's configuration: defaults are upstream's, bad input says what to change."""

from __future__ import annotations

import pytest

from moonlease_connector.config import (
    SELECTIVE_LEASE_ENV,
    ConnectorConfigError,
    LeaseMode,
    MoonleaseConnectorConfig,
)

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


def test_environment_switch_enables_selective_lease() -> None:
    config = MoonleaseConnectorConfig.from_sources({}, {SELECTIVE_LEASE_ENV: "1"})
    assert config.lease_mode is LeaseMode.SELECTIVE
    assert MoonleaseConnectorConfig.from_sources({}, {SELECTIVE_LEASE_ENV: "0"}).lease_mode is LeaseMode.LEASE_ALL


def test_environment_contradicting_config_is_an_error() -> None:
    with pytest.raises(ConnectorConfigError, match="contradicts"):
        MoonleaseConnectorConfig.from_sources({"mooncake_selective_lease": False}, {SELECTIVE_LEASE_ENV: "1"})


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConnectorConfigError, match=SELECTIVE_LEASE_ENV):
        MoonleaseConnectorConfig.from_sources({}, {SELECTIVE_LEASE_ENV: "maybe"})


def test_two_lease_modes_at_once_are_rejected() -> None:
    with pytest.raises(ConnectorConfigError, match="at most one"):
        MoonleaseConnectorConfig.from_sources(
            {"mooncake_selective_lease": True, "mooncake_kda_last_hit_only": True}, {})


def test_misspelt_key_gets_a_suggestion() -> None:
    with pytest.raises(ConnectorConfigError, match="did you mean 'mooncake_selective_lease'"):
        MoonleaseConnectorConfig.from_sources({"mooncake_selectiv_lease": True}, {})


def test_string_instead_of_boolean_is_rejected_with_advice() -> None:
    with pytest.raises(ConnectorConfigError, match="JSON booleans"):
        MoonleaseConnectorConfig.from_sources({"mooncake_junction_retention": "yes"}, {})
