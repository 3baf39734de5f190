"""The operator image, run as the chart runs it (read-only root, uid 65532, a tmpfs /tmp): it prints
the CRD the chart ships, and it reconciles a policy against the local API server, reached over the
podman network (the server listens on the network's gateway address, not on a public one). The
simulated pods run the connector's real settings endpoints (`ConnectorPods`) on that address too,
so the operator in its container verifies each stage against them, as it does in a cluster."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from moonlease_dev.testbed.connector_pods import ConnectorPods
from moonlease_dev.testbed.kube import local_api_server
from tests.chart.rendering import CHART_DIR
from tests.images.conftest import Images
from tests.images.podman import Network, podman, run_detached
from tests.operator.fleet import create_fleet, phase, policy, status

pytestmark = pytest.mark.images


def test_the_operator_image_prints_the_crd_the_chart_ships(images: Images) -> None:
    result = podman("run", "--rm", "--read-only", images["operator"], "crd")
    assert result.stdout == (CHART_DIR / "crds" / "mooncakeleasepolicies.yaml").read_text()
    user = podman("run", "--rm", "--read-only", "--entrypoint", "id", images["operator"], "-u").stdout.strip()
    assert user == "65532"


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


async def test_the_operator_image_reconciles_a_policy(images: Images, network: Network,
                                                      tmp_path: Path) -> None:
    network.bring_up(images["operator"])
    async with local_api_server(tick_interval=0.02, host=network.gateway, port=_free_port(network.gateway),
                                pod_ip=network.gateway) as kube:
        pods = ConnectorPods(kube, tmp_path / "connector-pods", host=network.gateway)
        pods.start()
        await create_fleet(kube)
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
        kubeconfig.chmod(0o644)
        operator = run_detached(network, images["operator"], [
            "operator", "--standalone", "--namespace=default", "--reconcile-interval=0.2",
            "--metrics-port=9090", "--liveness=http://0.0.0.0:8080/healthz"],
            name="operator", env={"KUBECONFIG": "/etc/moonlease/kubeconfig"},
            volumes=[f"{kubeconfig}:/etc/moonlease/kubeconfig:ro"])
        await kube.create(policy())
        try:
            await kube.wait_for(lambda: phase(kube) == "Ready" or not operator.running(), timeout=120,
                                what="the policy Ready, reconciled by the operator in its container")
        finally:
            logs = operator.logs()
            operator.stop()
            await pods.stop()
        assert phase(kube) == "Ready", (status(kube), logs)
        # The operator in the container made the calls (kopf and our client identify themselves).
        agents = {call.user_agent.split("/")[0] for call in kube.api_calls()}
        assert {"kopf", "moonlease-operator"} <= agents, agents
