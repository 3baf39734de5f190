"""Each lease mode's facts are decided once, on its strategy (`moonlease_settings.lease_modes`), and every place
that states a mode rule agrees with them, mode by mode: the CRD's enum and CEL rule (and the
operator's mirror of it), the operator's compatibility gate, the connector's capability gate,
the chart's values schema, the bench's cases and the connector's metric label. (The chart's
`_validate.tpl` is checked the same way in tests/chart/test_render.py, the connector's layout
gate in tests/connector/test_lease_mode_gates.py.) A new mode that one place forgets fails here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from moonlease_connector.adapters.settings_watcher import SettingsExporter
from moonlease_settings.config import LEASE_MODE_KEY, MoonleaseConnectorConfig
from moonlease_connector.core.capabilities import StoreCapabilities, missing_capability
from moonlease_settings.lease_modes import ALIAS_KEYS, STRATEGIES, LeaseMode, strategy_of
from moonlease_connector.core.live_settings import ActiveSettings, SettingsSource
from moonlease_settings.settings_file import SETTINGS_INFO_METRIC
from moonlease_dev.bench.serve_plan import ServeCase, parse_cases
from moonlease_operator.api import StageName, parse_spec
from moonlease_operator.core.compatibility import VersionSource, evaluate_compatibility
from moonlease_operator.core.settings import build_connector_settings
from tests.unit.test_cel_rules import SPEC_SCHEMA, failed_rules, mirror_accepts
from tests.unit.test_policy_api import with_changes

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
MODES = list(LeaseMode)
HYBRID_MESSAGE = "needs every target to be hybrid"


def test_one_strategy_per_mode_and_one_vocabulary_everywhere() -> None:
    assert [strategy.mode for strategy in STRATEGIES.values()] == MODES
    names = [mode.value for mode in MODES]
    assert SPEC_SCHEMA["properties"]["connector"]["properties"]["leaseMode"]["enum"] == names
    values = json.loads((REPO / "charts/moonlease/values.schema.json").read_text())
    vllm = values["properties"]["vllm"]["properties"]
    assert vllm["connector"]["properties"]["leaseMode"]["enum"] == names
    assert vllm["arms"]["items"]["properties"]["leaseMode"]["enum"] == names
    assert MoonleaseConnectorConfig.model_fields[LEASE_MODE_KEY].annotation is LeaseMode
    # Every alias names a mode that is its strategy's, and no two modes share one.
    assert {strategy_of(mode).alias_key: mode for mode in ALIAS_KEYS.values()} == dict(ALIAS_KEYS)


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_the_crd_rule_and_its_mirror_refuse_plain_targets_exactly_for_hybrid_modes(mode: LeaseMode) -> None:
    needs_hybrid = strategy_of(mode).needs_hybrid_model
    plain = with_changes(**{"connector.leaseMode": mode.value})
    hybrid = with_changes(**{"connector.leaseMode": mode.value, "targets.0.hybrid": True,
                             "targets.1.hybrid": True})
    assert any(HYBRID_MESSAGE in m for m in failed_rules(plain)) is needs_hybrid
    assert mirror_accepts(plain) is not needs_hybrid
    assert failed_rules(hybrid) == [] and mirror_accepts(hybrid)


def _sources(version: str) -> list[VersionSource]:
    return [VersionSource(StageName.MASTER, "Deployment", "mooncake-master", version, None),
            VersionSource(StageName.DECODE, "Deployment", "llama-decode", version, None)]


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_the_compatibility_gate_asks_what_the_strategy_needs(mode: LeaseMode) -> None:
    strategy = strategy_of(mode)
    base = parse_spec(with_changes(**{"targets.0.hybrid": True, "targets.1.hybrid": True}))
    spec = base.model_copy(update={"connector": base.connector.model_copy(update={"lease_mode": mode})})
    assert evaluate_compatibility(spec, _sources("0.3.14")) == []
    old = evaluate_compatibility(spec, _sources("0.3.13"))
    assert bool(old) is strategy.needs_probe_key()
    assert all(f"{mode.value} needs >= 0.3.14" in problem for problem in old)
    # A spec that bypassed the CEL rule (plain targets) is refused for hybrid modes only.
    plain = spec.model_copy(update={"targets": [t.model_copy(update={"hybrid": False}) for t in spec.targets]})
    bypassed = [p for p in evaluate_compatibility(plain, _sources("0.3.14")) if "hybrid" in p]
    assert bool(bypassed) is strategy.needs_hybrid_model


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_the_connectors_capability_gate_asks_for_the_strategys_probe_policies(mode: LeaseMode) -> None:
    strategy = strategy_of(mode)
    bare = StoreCapabilities("0.3.13", False, ())
    problem = missing_capability(mode, bare)
    assert (problem is not None) is strategy.needs_probe_key()
    if problem is not None:
        assert f"{LEASE_MODE_KEY}={mode.value} needs Mooncake >= 0.3.14" in problem
    assert missing_capability(mode, StoreCapabilities("0.3.14", True, strategy.probe_policies)) is None


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_the_operator_delivers_the_one_key_and_retires_the_aliases(mode: LeaseMode) -> None:
    from moonlease_operator.core.connector_delivery import build_settings_file_desired

    file = build_connector_settings(parse_spec(with_changes(**{
        "connector.leaseMode": mode.value, "targets.0.hybrid": True, "targets.1.hybrid": True})).connector).file
    assert file[LEASE_MODE_KEY] == mode.value and not set(file) & set(ALIAS_KEYS)
    desired = build_settings_file_desired(file)
    assert desired[f"doc:{LEASE_MODE_KEY}"] == {"v": mode.value}
    assert all(desired[f"doc:{alias}"] is None for alias in ALIAS_KEYS)  # removed from old files


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_the_bench_and_the_metric_label_spell_the_mode_as_users_do(mode: LeaseMode) -> None:
    (case,) = parse_cases(f"m:w:{mode.value}")
    assert isinstance(case, ServeCase) and case.mode is mode
    assert MoonleaseConnectorConfig.from_sources(case.extra_config()).lease_mode is mode
    exporter = SettingsExporter()
    exporter.show(ActiveSettings(MoonleaseConnectorConfig.for_mode(mode), SettingsSource.STARTUP))
    labels: list[dict[str, Any]] = [sample.labels for family in exporter.registry.collect()
                                    if family.name == SETTINGS_INFO_METRIC for sample in family.samples]
    assert [label["lease_mode"] for label in labels] == [mode.value]
