"""The operator's side of live connector settings: what it expects pods to report, where it
reads them, and which workloads it can deliver them to. Pure: plain dicts."""

from __future__ import annotations

import json
from typing import Any

import pytest

from moonlease_settings.config import MoonleaseConnectorConfig
from moonlease_settings.settings_file import SETTINGS_FILE_PATH, parse_settings_file, settings_hash
from moonlease_operator.api import ConnectorSpec, LeaseMode, Reason
from moonlease_operator.core.changes import ChangeAction, WorkloadChange
from moonlease_operator.core.connector_delivery import (
    SCRIPT_KV_TRANSFER_CONFIG,
    SETTINGS_VOLUME,
    SettingsReport,
    adoption_hash,
    evaluate_pod_settings,
    expected_settings_hash,
    read_settings_report,
    settings_endpoint,
)
from moonlease_operator.core.manageability import evaluate_target
from moonlease_operator.core.settings import build_connector_settings, build_target_desired
from moonlease_operator.core.slots import build_update

pytestmark = pytest.mark.unit

SELECTIVE = build_connector_settings(ConnectorSpec(lease_mode=LeaseMode.SELECTIVE))


def workload(container: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "w", "namespace": "ns"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "w"}},
                     "template": {"metadata": {"labels": {"app": "w"}}, "spec": {"containers": [container]}}}}


def test_the_expected_hash_is_what_the_connector_computes_over_the_workloads_own_defaults() -> None:
    user = {"kv_connector_extra_config": {"mooncake_max_lease_rounds": 5, "lookup_rpc_port": 1}}
    obj = workload({"name": "vllm", "args": ["serve", "m", "--kv-transfer-config", json.dumps(user)]})
    expected = expected_settings_hash(obj, "vllm", SELECTIVE.file)
    running = parse_settings_file(json.dumps(SELECTIVE.file), MoonleaseConnectorConfig(mooncake_max_lease_rounds=5))
    assert expected == settings_hash(running)
    assert expected != expected_settings_hash(workload({"name": "vllm", "args": ["serve", "m"]}), "vllm",
                                              SELECTIVE.file)  # other start-up defaults, other hash
    contradicting = workload({"name": "vllm", "args": ["serve", "m", "--kv-transfer-config",
                                                       json.dumps({"kv_connector_extra_config": {
                                                           "mooncake_selective_lease": True}})],
                              "env": [{"name": "VLLM_MOONCAKE_STORE_SELECTIVE_LEASE", "value": "0"}]})
    assert expected_settings_hash(contradicting, "vllm", SELECTIVE.file) is None  # would not start


def test_the_settings_endpoint_port_comes_from_the_pod_then_the_connector_then_the_default() -> None:
    def pod(annotations: dict[str, str] | None = None, **container: Any) -> dict[str, Any]:
        return {"metadata": {"annotations": annotations or {}}, "status": {"podIP": "10.1.2.3"},
                "spec": {"containers": [{"name": "proxy"},
                                        {"name": "vllm", "volumeMounts": [{"name": SETTINGS_VOLUME}], **container}]}}

    assert settings_endpoint(pod()) == "10.1.2.3:9410"
    assert settings_endpoint(pod(env=[{"name": "MOONLEASE_SETTINGS_METRICS_PORT", "value": "9500"}])) == "10.1.2.3:9500"
    kv = json.dumps({"kv_connector_extra_config": {"mooncake_settings_metrics_port": 9600}})
    assert settings_endpoint(pod(args=["--kv-transfer-config", kv])) == "10.1.2.3:9600"
    assert settings_endpoint(pod({"moonlease.io/settings-metrics-port": "9700"}, args=["--kv-transfer-config", kv])) \
        == "10.1.2.3:9700"
    assert settings_endpoint({"status": {}, "spec": {}}) is None  # no IP yet


def test_reports_and_per_pod_reasons() -> None:
    info = ("moonlease_connector_settings_info", {"lease_mode": "selective", "settings_hash": "aa"}, 1.0)
    refused = ("moonlease_connector_settings_refused_info", {"settings_hash": "bb", "reason": "client_unsupported"}, 1.0)
    report = read_settings_report([info, refused])
    assert report == SettingsReport("aa", "selective", "bb", "client_unsupported")
    assert read_settings_report([]).error is not None

    assert evaluate_pod_settings("p", report, "aa") is None
    assert evaluate_pod_settings("p", report, "bb") == (
        "pod p: connector runs settings aa (lease mode selective), expected bb; it refused them (client_unsupported)")
    assert "expected cc" in evaluate_pod_settings("p", report, "cc") and "refused" not in evaluate_pod_settings("p", report, "cc")
    assert "not read yet" in evaluate_pod_settings("p", None, "aa")
    assert "unreadable: refused" in evaluate_pod_settings("p", SettingsReport(error="refused"), "aa")
    assert "would refuse the workload's start-up settings" in evaluate_pod_settings("p", report, None)


def test_a_shell_script_is_refused_with_exactly_what_to_add_and_adopted_once_it_has_it() -> None:
    bare = workload({"name": "vllm", "command": ["sh", "-c"], "args": ["pip install x && vllm serve m"]})
    problem = evaluate_target(bare, None)
    assert problem is not None and problem.reason is Reason.UNMANAGEABLE_WORKLOAD
    assert SCRIPT_KV_TRANSFER_CONFIG in problem.message
    assert json.loads(SCRIPT_KV_TRANSFER_CONFIG.split(" ", 1)[1].strip("'"))["kv_connector_extra_config"] == {
        "mooncake_settings_file": SETTINGS_FILE_PATH}

    script = f"pip install x && vllm serve m {SCRIPT_KV_TRANSFER_CONFIG}"
    ready = workload({"name": "vllm", "command": ["sh", "-c"], "args": [script]})
    assert evaluate_target(ready, None) is None
    desired = build_target_desired(ready, None, "w-moonlease")
    adopted = build_update(ready, WorkloadChange(kind="Deployment", name="w", action=ChangeAction.APPLY, policy="p",
                                                 desired=desired, config_hash=adoption_hash("w-moonlease")))
    assert adopted is not None
    container = adopted["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == [script] and container["command"] == ["sh", "-c"]  # the script untouched
    assert container["volumeMounts"] == [{"name": SETTINGS_VOLUME, "mountPath": "/etc/moonlease/connector",
                                          "readOnly": True}]
    # The settings file named by the environment instead of the script works too.
    by_env = workload({"name": "vllm", "command": ["bash", "-lc"],
                       "args": ["vllm serve m --kv-transfer-config '{\"kv_connector\":\"MooncakeStoreConnector\","
                                "\"kv_connector_module_path\":\"moonlease_connector\"}'"],
                       "env": [{"name": "MOONLEASE_SETTINGS_FILE", "value": SETTINGS_FILE_PATH}]})
    assert evaluate_target(by_env, None) is None
