"""The test bed at fleet scale (issue 16): the simulated controllers and connectors act on what
was written, not on every object each tick, and the emulator's lookups go through its indexes —
with the same results as before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from moonlease_dev.testbed.connector_pods import ConnectorPods
from moonlease_settings.settings_file import SETTINGS_FILE_NAME, SETTINGS_FILE_PATH, SETTINGS_MOUNT_DIR
from moonlease_operator.core.connector_delivery import SETTINGS_PORT_ANNOTATION, SETTINGS_VOLUME
from moonlease_dev.testbed.kube import DEPLOYMENTS, PODS, ApiServerEmulator, LocalApiServer, deployment_manifest, is_rollout_complete

pytestmark = pytest.mark.operator


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Record every object the simulated parts read through `stored_object` (a spy on our own
    emulator, which still answers)."""
    reads: list[tuple[Any, ...]] = []
    real = ApiServerEmulator.stored_object

    def spy(self: ApiServerEmulator, what: Any, namespace: str | None, name: str) -> Any:
        reads.append((self.resource_type(what).kind, namespace, name))
        return real(self, what, namespace, name)

    monkeypatch.setattr(ApiServerEmulator, "stored_object", spy)
    return reads


async def settle(kube: LocalApiServer, limit: int = 10) -> int:
    for ticks in range(1, limit + 1):
        await kube.simulator.tick()
        if kube.simulator.idle:
            return ticks
    raise AssertionError(f"the simulator still had work after {limit} ticks")


async def test_a_settled_fleet_costs_no_reads_and_a_change_wakes_only_its_workload(
        kube_manual: LocalApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(20):
        await kube_manual.create(deployment_manifest(f"web-{i:02d}", replicas=2))
    assert not kube_manual.simulator.idle
    await settle(kube_manual)
    assert all(is_rollout_complete(d) for d in kube_manual.list(DEPLOYMENTS, "default"))
    assert len(kube_manual.list(PODS, "default")) == 40

    reads = count_reads(monkeypatch)
    version = kube_manual.emulator.resource_version
    for _ in range(5):
        await kube_manual.simulator.tick()
    assert reads == [] and kube_manual.emulator.resource_version == version  # nothing read, nothing written

    obj = kube_manual.get(DEPLOYMENTS, "default", "web-07")
    assert obj is not None
    template = obj["spec"]["template"]
    template["spec"]["containers"][0]["args"] = ["--lease=selective"]
    await kube_manual.patch(DEPLOYMENTS, "default", "web-07", {"spec": {"template": template}})
    assert not kube_manual.simulator.idle
    await settle(kube_manual)
    assert {name for kind, _, name in reads if kind == "Deployment"} == {"web-07"}
    done = kube_manual.get(DEPLOYMENTS, "default", "web-07")
    assert done is not None and is_rollout_complete(done) and done["status"]["observedGeneration"] == 2


async def test_another_clients_write_is_seen_even_while_the_simulator_writes(kube_manual: LocalApiServer) -> None:
    """The simulator ignores its own writes only: a status someone else clobbered is put back,
    a pod someone deleted is created again."""
    await kube_manual.create(deployment_manifest("web", replicas=2))
    await settle(kube_manual)
    good = kube_manual.get(DEPLOYMENTS, "default", "web")
    assert good is not None

    await kube_manual.patch(DEPLOYMENTS, "default", "web", {"status": {"readyReplicas": 0}}, subresource="status")
    pod = kube_manual.list(PODS, "default")[0]["metadata"]["name"]
    await kube_manual.delete(PODS, "default", pod)
    await settle(kube_manual)
    again = kube_manual.get(DEPLOYMENTS, "default", "web")
    assert again is not None and again["status"]["readyReplicas"] == 2 and is_rollout_complete(again)
    assert pod in {p["metadata"]["name"] for p in kube_manual.list(PODS, "default")}


async def test_connector_pods_look_only_at_written_pods(kube_manual: LocalApiServer, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(10):
        await kube_manual.create(deployment_manifest(f"web-{i}", replicas=1))
    await settle(kube_manual)
    pods = ConnectorPods(kube_manual, tmp_path)
    try:
        await pods.sync()  # the first pass looks at every pod (none mounts settings)
        assert pods.idle
        reads = count_reads(monkeypatch)
        await pods.sync()
        assert reads == []

        name = kube_manual.list(PODS, "default")[3]["metadata"]["name"]
        await kube_manual.patch(PODS, "default", name, {"metadata": {"labels": {"touched": "yes"}}})
        assert not pods.idle
        await pods.sync()
        assert reads == [("Pod", "default", name)] and pods.idle
    finally:
        await pods.stop()


async def test_a_pod_deleted_and_created_again_between_passes_gets_a_new_connector(
        kube_manual: LocalApiServer, tmp_path: Path) -> None:
    """The simulated controller may delete a pod and create one of the same name in one step
    (a rollback to an earlier template): that is a new container, whose connector announces
    its endpoint on the new pod object."""
    await kube_manual.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "web-moonlease"},
                              "data": {SETTINGS_FILE_NAME: '{"lease_mode": "selective"}'}})
    body = connector_pod("web-0")
    pods = ConnectorPods(kube_manual, tmp_path)
    try:
        await kube_manual.create(body)
        await pods.sync()
        first = kube_manual.get(PODS, "default", "web-0")
        assert first is not None and SETTINGS_PORT_ANNOTATION in first["metadata"]["annotations"]
        await kube_manual.delete(PODS, "default", "web-0")
        await kube_manual.create(body)
        await pods.sync()
        again = kube_manual.get(PODS, "default", "web-0")
        assert again is not None and again["metadata"]["uid"] != first["metadata"]["uid"]
        assert again["metadata"]["annotations"][SETTINGS_PORT_ANNOTATION] == pods.endpoint("web-0").split(":")[1]
    finally:
        await pods.stop()


def connector_pod(name: str, args: list[str] | None = None) -> dict[str, Any]:
    """A pod mounting web-moonlease whose vLLM command loads our connector and names the file
    (`args` replaces that command line)."""
    kv = {"kv_connector": "MooncakeStoreConnector", "kv_connector_module_path": "moonlease_connector",
          "kv_role": "kv_both", "kv_connector_extra_config": {"mooncake_settings_file": SETTINGS_FILE_PATH}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "vllm", "image": "vllm:1",
                                     "args": args if args is not None else
                                     ["serve", "m", "--kv-transfer-config", json.dumps(kv)],
                                     "volumeMounts": [{"name": SETTINGS_VOLUME, "mountPath": SETTINGS_MOUNT_DIR}]}],
                     "volumes": [{"name": SETTINGS_VOLUME, "configMap": {"name": "web-moonlease"}}]}}


@pytest.mark.parametrize("args", [
    ["serve", "m"],  # vLLM without our connector: the mounted file is read by nobody
    # A script that only mentions us (a lone script token for an image whose entrypoint is a shell).
    [f"pip install moonlease_connector && echo {SETTINGS_FILE_PATH} && vllm serve m"],
])
async def test_a_pod_whose_command_does_not_load_our_connector_runs_none(
        kube_manual: LocalApiServer, tmp_path: Path, args: list[str]) -> None:
    """The stricter pod model (issue 27): mounting the settings file is not enough; the
    container's command line must start vLLM with our connector and name the file."""
    await kube_manual.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "web-moonlease"},
                              "data": {SETTINGS_FILE_NAME: '{"lease_mode": "selective"}'}})
    pods = ConnectorPods(kube_manual, tmp_path)
    try:
        await kube_manual.create(connector_pod("plain-0", args))
        await kube_manual.create(connector_pod("ours-0"))
        await pods.sync()
        plain, ours = kube_manual.get(PODS, "default", "plain-0"), kube_manual.get(PODS, "default", "ours-0")
        assert plain is not None and SETTINGS_PORT_ANNOTATION not in (plain["metadata"].get("annotations") or {})
        assert ours is not None and SETTINGS_PORT_ANNOTATION in ours["metadata"]["annotations"]
    finally:
        await pods.stop()
