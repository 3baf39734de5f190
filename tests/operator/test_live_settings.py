"""Live connector settings verified on running connectors: kopf against the local API server,
each vLLM pod's settings endpoint served by the connector's real watcher and exporter on
loopback (`moonlease_dev.testbed.connector_pods`), reading the pod's copy of its ConfigMap as the
kubelet would keep it. A pod whose connector never reports the new settings keeps its stage
Progressing with a per-pod reason, then the stage times out and rolls back: the settings file
goes back, and the pods report the old settings again — no pod restarted on the way."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from moonlease_dev.testbed.connector_pods import ConnectorPods
from moonlease_dev.testbed.kube import CONFIGMAPS, PODS, LocalApiServer
from moonlease_dev.testbed.kube.simulator import workload_of
from moonlease_settings.config import MoonleaseConnectorConfig
from moonlease_settings.settings_file import SETTINGS_FILE_NAME, SETTINGS_FILE_PATH, parse_settings_file, settings_hash
from moonlease_operator.core.connector_delivery import SETTINGS_PORT_ANNOTATION, settings_config_map_name
from moonlease_operator.runner import OperatorThread
from tests.fixtures.kube import FAST_OPTIONS
from tests.operator.fleet import (
    DECODE,
    NS,
    WORKLOADS,
    ManualClock,
    condition,
    create_fleet,
    phase,
    policy,
    reasons,
    stage_phases,
    status,
    workload,
)
from tests.support.settings_volume import read_settings_endpoint

pytestmark = pytest.mark.operator

WAIT = 15.0


def endpoint_reports(kube: LocalApiServer, owner: str) -> list[Any]:
    """What the running connectors of a workload's pods report on their settings endpoints."""
    return [read_settings_endpoint(int(port)) for pod in kube.list(PODS, NS)
            if (port := pod["metadata"].get("annotations", {}).get(SETTINGS_PORT_ANNOTATION)) is not None
            and workload_of(kube.emulator, pod) == owner]


def lease_modes(kube: LocalApiServer, owner: str) -> set[str]:
    """The lease modes the running connectors of a workload's pods report."""
    return {report.lease_mode for report in endpoint_reports(kube, owner)}


def file_mode(kube: LocalApiServer, owner: str) -> str:
    text = kube.get(CONFIGMAPS, NS, settings_config_map_name(owner))["data"][SETTINGS_FILE_NAME]
    return parse_settings_file(text, MoonleaseConnectorConfig()).lease_mode.value


def decode_target(kube: LocalApiServer) -> dict:
    return next(t for t in status(kube).get("targets", []) if t["name"] == "llama-decode")


async def test_a_pod_that_never_reports_the_new_settings_times_out_and_rolls_back(
        kube: LocalApiServer, connector_pods: ConnectorPods) -> None:
    await create_fleet(kube)
    clock = ManualClock()
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS, clock=clock):
        await kube.create(policy())
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
        assert lease_modes(kube, "llama-decode") == {"selective"}
        generations = {name: workload(kube, name)["metadata"]["generation"] for name in WORKLOADS}
        pods = {p["metadata"]["name"] for p in kube.list(PODS, NS)}

        connector_pods.freeze("llama-decode")  # its kubelet never delivers the new file
        await kube.patch("mlp", NS, "fleet", {"spec": {"connector": {"leaseMode": "leaseAll"}}})
        await kube.wait_for(lambda: stage_phases(kube).get("decode") == "Progressing"
                            and "connector settings not verified" in decode_target(kube).get("message", ""),
                            timeout=WAIT, what="the decode stage waiting for its connectors")
        message = decode_target(kube)["message"]
        assert decode_target(kube)["phase"] == "Updating"
        for pod in ("llama-decode-0", "llama-decode-1"):
            assert f"pod {pod}: connector runs settings" in message and "(lease mode selective)" in message
        await kube.wait_for(lambda: "SettingsNotVerified" in reasons(kube, transient=True), timeout=WAIT,
                            what="the SettingsNotVerified event")  # posted right after the status write
        assert stage_phases(kube)["prefill"] == "Succeeded" and lease_modes(kube, "llama-prefill") == {"leaseAll"}
        assert file_mode(kube, "llama-decode") == "leaseAll"  # written; never delivered
        assert phase(kube) == "Progressing"

        clock.advance(31)  # past stageTimeoutSeconds
        await kube.wait_for(lambda: phase(kube) == "Degraded", timeout=WAIT, what="phase Degraded")
        await kube.wait_for(lambda: lease_modes(kube, "llama-prefill") == {"selective"},
                            timeout=WAIT, what="prefill's connectors back on selective")

    degraded = condition(kube, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "RolledBack")
    assert "connector settings not verified" in degraded["message"]
    assert stage_phases(kube) == {"master": "Skipped", "prefill": "RolledBack", "decode": "RolledBack"}
    assert file_mode(kube, "llama-decode") == file_mode(kube, "llama-prefill") == "selective"
    assert lease_modes(kube, "llama-decode") == {"selective"}
    # Forward and back through the settings files alone: no workload changed, no pod restarted.
    assert {name: workload(kube, name)["metadata"]["generation"] for name in WORKLOADS} == generations
    assert {p["metadata"]["name"] for p in kube.list(PODS, NS)} == pods


async def test_a_rollback_is_rolled_back_only_once_the_connectors_run_the_restored_file(
        kube: LocalApiServer, connector_pods: ConnectorPods) -> None:
    """The status says RolledBack only when the running connectors say so: a stage whose file
    went back but whose kubelet has not delivered it stays RollingBack, with the pods named."""
    await create_fleet(kube)
    clock = ManualClock()
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS, clock=clock):
        await kube.create(policy())
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
        connector_pods.freeze("llama-decode")  # decode never takes the change: its stage times out
        await kube.patch("mlp", NS, "fleet", {"spec": {"connector": {"leaseMode": "leaseAll"}}})
        await kube.wait_for(lambda: stage_phases(kube).get("prefill") == "Succeeded"
                            and lease_modes(kube, "llama-prefill") == {"leaseAll"},
                            timeout=WAIT, what="prefill's connectors on leaseAll")
        connector_pods.freeze("llama-prefill")  # ... and prefill's kubelet stops too

        clock.advance(31)  # past stageTimeoutSeconds: roll back
        await kube.wait_for(lambda: file_mode(kube, "llama-prefill") == "selective"
                            and "restored connector settings not verified" in prefill_target(kube).get("message", ""),
                            timeout=WAIT, what="prefill's file restored, its connectors not yet on it")
        assert stage_phases(kube)["prefill"] == "RollingBack" and phase(kube) == "RollingBack"
        assert prefill_target(kube)["phase"] == "RollingBack"
        assert "(lease mode leaseAll)" in prefill_target(kube)["message"]
        assert lease_modes(kube, "llama-prefill") == {"leaseAll"}

        connector_pods.thaw("llama-prefill")  # the kubelet delivers the restored file
        await kube.wait_for(lambda: phase(kube) == "Degraded", timeout=WAIT, what="phase Degraded")
        assert lease_modes(kube, "llama-prefill") == {"selective"}

    assert condition(kube, "Degraded")["reason"] == "RolledBack"
    assert stage_phases(kube) == {"master": "Skipped", "prefill": "RolledBack", "decode": "RolledBack"}


def prefill_target(kube: LocalApiServer) -> dict:
    return next((t for t in status(kube).get("targets", []) if t["name"] == "llama-prefill"), {})


def reported_hashes(kube: LocalApiServer, owner: str) -> set[str]:
    """The settings hashes the running connectors of a workload's pods report."""
    return {report.settings_hash for report in endpoint_reports(kube, owner)}


async def test_turning_retention_pin_off_reaches_pods_whose_start_up_settings_pin(
        kube: LocalApiServer, connector_pods: ConnectorPods) -> None:
    """A chart-installed decode starts with `mooncake_retention_pin: true`; the policy turns pin
    on, then off: the settings file says `false`, and the connectors run without pinning (a key
    left out would fall back to the start-up `true`: Ready while every pod still pins)."""
    decode = copy.deepcopy(DECODE)
    container = decode["spec"]["template"]["spec"]["containers"][0]
    container["args"] = [*container["args"], "--kv-transfer-config",
                         json.dumps({"kv_connector_extra_config": {"mooncake_retention_pin": True}})]
    startup = MoonleaseConnectorConfig(mooncake_retention_pin=True)
    await create_fleet(kube, decode=decode)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        await kube.create(policy(**{"connector.retentionPin": True}))
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready, pin on")
        first = status(kube)["desiredConfigHash"]
        await kube.patch("mlp", NS, "fleet", {"spec": {"connector": {"retentionPin": False}}})
        await kube.wait_for(lambda: phase(kube) == "Ready" and status(kube)["desiredConfigHash"] != first,
                            timeout=WAIT, what="phase Ready, pin off")
        text = kube.get(CONFIGMAPS, NS, settings_config_map_name("llama-decode"))["data"][SETTINGS_FILE_NAME]
        running = parse_settings_file(text, startup)
        assert json.loads(text)["mooncake_retention_pin"] is False and running.mooncake_retention_pin is False
        await kube.wait_for(lambda: reported_hashes(kube, "llama-decode") == {settings_hash(running)},
                            timeout=WAIT, what="decode's connectors running without pinning")


async def test_a_script_passing_an_extra_key_is_verified_on_what_it_passes(
        kube: LocalApiServer, connector_pods: ConnectorPods) -> None:
    """A decode started by `sh -c` whose vLLM command loads our connector with one extra
    Moonlease key: the connector starts on that key, so the operator expects it too and the
    rollout verifies (it used to expect the default start-up settings, fail and roll back)."""
    kv = {"kv_connector": "MooncakeStoreConnector", "kv_connector_module_path": "moonlease_connector",
          "kv_role": "kv_both", "kv_connector_extra_config": {"mooncake_settings_file": SETTINGS_FILE_PATH,
                                                              "mooncake_max_lease_rounds": 7}}
    decode = copy.deepcopy(DECODE)
    decode["spec"]["template"]["spec"]["containers"][0].update(
        command=["/bin/sh", "-c"],
        args=[f"huggingface-cli download /models/llama && exec vllm serve /models/llama"
              f" --kv-transfer-config '{json.dumps(kv)}'"])
    await create_fleet(kube, decode=decode)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        await kube.create(policy())
        await kube.wait_for(lambda: phase(kube) in ("Ready", "Degraded"), timeout=WAIT, what="the rollout to end")
        assert phase(kube) == "Ready", condition(kube, "Ready")
        text = kube.get(CONFIGMAPS, NS, settings_config_map_name("llama-decode"))["data"][SETTINGS_FILE_NAME]
        running = parse_settings_file(text, MoonleaseConnectorConfig(mooncake_max_lease_rounds=7))
        assert reported_hashes(kube, "llama-decode") == {settings_hash(running)}
    assert decode["spec"]["template"]["spec"]["containers"][0]["args"] == \
        workload(kube, "llama-decode")["spec"]["template"]["spec"]["containers"][0]["args"]  # the script untouched
