"""GitOps mode (`vllm.connector.settingsOwner: policy`, issue 19): the chart renders the vLLM
workloads adopted exactly as the operator would adopt them, and their settings ConfigMaps
without data, so that nothing Helm (server-side apply) or Argo CD applies is a field the
operator writes; everything else renders as in the default mode."""

from __future__ import annotations

import copy
from typing import Any

import helm_python as helm
import pytest

from moonlease_settings.lease_modes import ALIAS_KEYS, LEASE_MODE_KEY
from moonlease_settings.settings_file import SETTINGS_FILE_KEY, SETTINGS_FILE_PATH
from moonlease_operator.core.connector_delivery import (
    SETTINGS_CONFIG_MAP_LABEL,
    SETTINGS_VOLUME,
    build_adoption_desired,
    settings_config_map_name,
)
from tests.chart.rendering import JsonObj, container, find, kv_transfer_config, render_objects, values_sets

pytestmark = pytest.mark.chart

SETS = values_sets()
POLICY_OWNS = {"vllm": {"connector": {"settingsOwner": "policy"}}}


def _merged(base: JsonObj, extra: JsonObj) -> JsonObj:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = _merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def _settings_maps(objects: list[JsonObj]) -> dict[str, JsonObj]:
    return {o["metadata"]["name"]: o for o in find(objects, "ConfigMap")
            if (o["metadata"].get("labels") or {}).get(SETTINGS_CONFIG_MAP_LABEL) == "true"}


def _policy_targets(objects: list[JsonObj]) -> set[str]:
    """The vLLM workloads the rendered policy manages (its targets other than the master)."""
    policy = one_of_kind(objects, "MooncakeLeasePolicy")
    return {t["name"] for t in policy["spec"]["targets"]}


def one_of_kind(objects: list[JsonObj], kind: str) -> JsonObj:
    (found,) = find(objects, kind)
    return found


def _without_settings_data(objects: list[JsonObj], workloads: set[str]) -> list[JsonObj]:
    out = copy.deepcopy(objects)
    for obj in out:
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"].removesuffix("-moonlease") in workloads:
            obj.pop("data", None)
    return out


@pytest.mark.parametrize("name", ["default", "ab"])
def test_policy_owned_settings_render_adopted_workloads_and_data_less_config_maps(chart: helm.Chart, name: str) -> None:
    values = SETS[name]
    by_chart = render_objects(chart, values)
    by_policy = render_objects(chart, _merged(values, POLICY_OWNS))

    chart_maps, policy_maps = _settings_maps(by_chart), _settings_maps(by_policy)
    assert chart_maps and all("connector-settings.json" in m["data"] for m in chart_maps.values())
    assert sorted(policy_maps) == sorted(chart_maps)
    managed = _policy_targets(by_policy)
    unmanaged = {m for m in policy_maps if m.removesuffix("-moonlease") not in managed}
    assert managed and (unmanaged if name == "ab" else not unmanaged)  # ab pins its treatment arm
    for config_map, obj in policy_maps.items():
        workload = config_map.removesuffix("-moonlease")
        if workload in managed:
            assert "data" not in obj, config_map  # the operator's alone
        else:  # an arm the policy leaves alone keeps the settings its values give it
            assert obj["data"] == chart_maps[config_map]["data"], config_map
    # Only the managed settings' content differs: workloads, Services, the policy, RBAC render the same.
    assert by_policy == _without_settings_data(by_chart, managed)

    deployments = [d for d in find(by_policy, "Deployment") if "vllm" in d["metadata"]["labels"].get(
        "app.kubernetes.io/component", "")]
    assert deployments
    for deployment in deployments:
        config_map = settings_config_map_name(deployment["metadata"]["name"])
        assert config_map in policy_maps
        desired = build_adoption_desired(config_map)  # what the operator's adoption writes
        spec = deployment["spec"]["template"]["spec"]
        assert desired[f"volume:{SETTINGS_VOLUME}"]["v"] in spec["volumes"]
        assert desired[f"mount:{SETTINGS_VOLUME}"]["v"] in container(deployment)["volumeMounts"]
        extra: dict[str, Any] = kv_transfer_config(deployment)["kv_connector_extra_config"]
        assert extra[SETTINGS_FILE_KEY] == SETTINGS_FILE_PATH
        # No lease key the operator would change is rendered into the start-up config.
        assert not {LEASE_MODE_KEY, *ALIAS_KEYS, "mooncake_junction_retention"} & set(extra), deployment["metadata"]["name"]
