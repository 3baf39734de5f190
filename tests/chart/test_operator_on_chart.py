"""The operator manages what the chart deploys: installed by Helm (its SDK's `helm install`), the
release is already what its policy declares (the operator verifies it and changes nothing), and a change made to
the policy rolls out exactly what the chart renders for the same values — one decision, made
the same way by the templates and by the operator."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from moonlease_dev.testbed.kube import CONFIGMAPS, LocalApiServer
from moonlease_settings.config import MoonleaseConnectorConfig
from moonlease_settings.settings_file import SETTINGS_FILE_NAME, parse_settings_file
from moonlease_operator.core.conflicts import FIELD_MANAGER
from moonlease_operator.runner import OperatorThread
from tests.chart.operator_scenario import WAIT, FAST_OPTIONS, current, helm_install, policy_status, wait_ready
from tests.chart.rendering import (
    NAMESPACE,
    container,
    env,
    find,
    kv_transfer_config,
    one,
    render_objects,
    values_sets,
)

pytestmark = [pytest.mark.chart, pytest.mark.operator]

SETS = values_sets()
WRITES = ("create", "patch", "update", "delete")


def operator_writes(kube: LocalApiServer) -> set[tuple[str | None, str | None]]:
    return {(c.verb, c.rbac_resource) for c in kube.api_calls()
            if c.verb in WRITES and c.user_agent.startswith(("kopf/", "moonlease-operator/"))}


@pytest.mark.parametrize("name", ["default", "ab", "namespaced-rdma"])
async def test_the_operator_finds_the_release_in_sync_and_restarts_nothing(
        release_kube: LocalApiServer, name: str) -> None:
    kube = release_kube
    watched = SETS[name].get("operator", {}).get("watchNamespaces", [])
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS, namespaces=watched):
        objects = await helm_install(kube, SETS[name])
        workloads = {o["metadata"]["name"]: current(kube, o) for o in find(objects, "Deployment")}
        await wait_ready(kube)
        # The operator may first reconcile while Helm's rollout is still going (a target then shows
        # Updating); a Deployment's status change wakes it again, so the status settles to all Ready.
        await kube.wait_for(lambda: not policy_status(kube).get("targets"), timeout=WAIT,
                            what="the policy's status to count every target Ready")
        status = policy_status(kube)
    assert status["phase"] == "Ready"
    assert {s["name"]: (s["phase"], s["message"]) for s in status["stages"]} == {
        stage: ("Skipped", "nothing to change") for stage in ("master", "prefill", "decode")}
    policy = one(objects, "MooncakeLeasePolicy", "moonlease")
    assert status.get("targets", []) == []  # all Ready: counted, not listed
    assert status["targetsTotal"] == 1 + len(policy["spec"]["targets"])
    assert {c["phase"] for c in status["targetCounts"]} == {"Ready"}
    # Not one write to a workload: only kopf's bookkeeping on the policy, its status, events.
    assert operator_writes(kube) <= {("patch", "mooncakeleasepolicies"), ("patch", "mooncakeleasepolicies/status"),
                                     ("create", "events")}
    for obj in find(objects, "Deployment"):
        assert current(kube, obj)["metadata"]["generation"] == workloads[obj["metadata"]["name"]]["metadata"][
            "generation"] == 1, obj["metadata"]["name"]


def flags(args: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)


async def test_a_policy_change_rolls_out_what_the_chart_renders_for_the_same_values(
        chart: helm.Chart, release_kube: LocalApiServer) -> None:
    kube = release_kube
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        await helm_install(kube, SETS["default"])
        await wait_ready(kube)
        await kube.patch("mlp", NAMESPACE, "moonlease", {"spec": {
            "connector": {"leaseMode": "selective"}, "master": {"evictionRatio": 0.1, "defaultKvLeaseTtlMs": 5000}}})
        # The chart asks for approval of master restarts by default: approve exactly this one.
        pending = await kube.wait_for(lambda: (kube.get("mlp", NAMESPACE, "moonlease") or {}).get(
            "status", {}).get("pendingApproval"), timeout=30, what="the master restart to wait for approval")
        assert str(pending).startswith("forward:2:")
        await kube.patch("mlp", NAMESPACE, "moonlease",
                         {"metadata": {"annotations": {"moonlease.io/approve-master-restart": pending}}})
        status = await wait_ready(kube, revision=2)
    assert [s["phase"] for s in status["stages"]] == ["Succeeded", "Succeeded", "Succeeded"]

    same_values: dict[str, Any] = {
        "vllm": {"connector": {"leaseMode": "selective"}},
        "mooncake": {"master": {"settings": {"eviction_ratio": 0.1, "default_kv_lease_ttl": 5000}}}}
    expected = render_objects(chart, same_values)
    master = one(expected, "Deployment", "moonlease-mooncake-master")
    live_master = current(kube, master)
    assert flags(container(live_master)["args"]) == flags(container(master)["args"])
    for role in ("prefill", "decode"):
        rendered = one(expected, "Deployment", f"moonlease-{role}")
        live = current(kube, rendered)
        assert kv_transfer_config(live) == kv_transfer_config(rendered)
        assert env(live, "vllm") == env(rendered, "vllm")
        assert container(live, "vllm")["volumeMounts"] == container(rendered, "vllm")["volumeMounts"]


async def test_in_gitops_mode_the_operator_alone_writes_the_settings_and_restores_them_on_deletion(
        chart: helm.Chart, release_kube: LocalApiServer) -> None:
    """`vllm.connector.settingsOwner: policy`: the release's settings ConfigMaps come without
    data; the operator writes the policy's settings into them (no workload changes: they are
    rendered adopted), and a deleted policy gives them back as rendered — found by name (the
    operator lists ConfigMaps only label-selected), though their workloads never carried its label."""
    kube = release_kube
    names = [f"moonlease-{role}-moonlease" for role in ("prefill", "decode")]
    objects = await helm_install(kube, {"vllm": {"connector": {"settingsOwner": "policy", "leaseMode": "selective"}}})
    assert all("data" not in kube.get(CONFIGMAPS, NAMESPACE, n) for n in names)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        await wait_ready(kube)
        for name in names:
            config_map = kube.get(CONFIGMAPS, NAMESPACE, name)
            text = config_map["data"][SETTINGS_FILE_NAME]
            assert parse_settings_file(text, MoonleaseConnectorConfig()).lease_mode.value == "selective", name
            # Helm's server-side apply owns only what it rendered (metadata), the operator the data
            # (and its own labels and annotations).
            owners = {e["operation"] if e["manager"] != FIELD_MANAGER else FIELD_MANAGER: e["fieldsV1"]
                      for e in config_map["metadata"]["managedFields"]}
            assert set(owners) == {"Apply", FIELD_MANAGER} and set(owners["Apply"]) == {"f:metadata"}, owners
            assert "f:data" in owners[FIELD_MANAGER], owners
        for obj in find(objects, "Deployment"):  # adopted as rendered: not one rolling update
            assert current(kube, obj)["metadata"]["generation"] == 1, obj["metadata"]["name"]
        await kube.delete("mlp", NAMESPACE, "moonlease")
        await kube.wait_for(lambda: kube.get("mlp", NAMESPACE, "moonlease") is None, timeout=30,
                            what="the policy's finalizer to be released")
    for name in names:
        assert not kube.get(CONFIGMAPS, NAMESPACE, name).get("data"), name
    # ConfigMaps are listed only by the operator's two label-selected caches, once each at start-up
    # (the settings files and those a policy labelled), never per reconcile (issue 16).
    assert len([c for c in kube.api_calls() if (c.verb, c.rbac_resource) == ("list", "configmaps")
                and c.user_agent.startswith("moonlease-operator/")]) <= 2
