"""Real kubectl's server-side apply against the local API server: field managers recorded on every
write (`metadata.managedFields`, `fieldManager`), conflicts answered as the API server words them,
`--force-conflicts` taking ownership, fields a manager stops applying removed, and a client-side
applied object moving to server-side apply without a conflict."""

from __future__ import annotations

import json

import aiohttp
import pytest

from moonlease_dev.testbed.kube import DEPLOYMENTS, LocalApiServer
from tests.conformance.conftest import Kubectl, apply_ok, deployment_yaml

pytestmark = pytest.mark.conformance


def managers(kube: LocalApiServer) -> dict[tuple[str, str, str], dict]:
    """(manager, operation, subresource) -> fieldsV1 of the stored Deployment `web`."""
    obj = kube.get(DEPLOYMENTS, "default", "web")
    return {(e["manager"], e["operation"], e.get("subresource", "")): e["fieldsV1"]
            for e in obj["metadata"].get("managedFields", [])}


def labelled(replicas: int, **labels: str) -> str:
    text = deployment_yaml(replicas=replicas)
    shown = ", ".join(f"{k}: {v}" for k, v in labels.items())
    return text.replace("metadata: {name: web, namespace: default}",
                        f"metadata: {{name: web, namespace: default, labels: {{{shown}}}}}")


async def test_server_side_apply_owns_fields_conflicts_and_forces(kube: LocalApiServer, kubectl: Kubectl) -> None:
    created = await apply_ok(kubectl, labelled(2, tier="web", team="a"), "--server-side")
    assert created.strip() == "deployment.apps/web serverside-applied"
    owned = managers(kube)[("kubectl", "Apply", "")]
    assert owned["f:spec"]["f:replicas"] == {}
    assert owned["f:metadata"]["f:labels"] == {"f:team": {}, "f:tier": {}}
    assert owned["f:spec"]["f:template"]["f:spec"]["f:containers"]['k:{"name":"web"}'] == \
        {".": {}, "f:image": {}, "f:name": {}}
    assert "f:status" not in owned and "f:name" not in owned["f:metadata"]

    # Another manager setting the field differently: 409, nothing changes.
    refused = await kubectl("apply", "--server-side", "--field-manager=bob", "-f", "-", input=labelled(3, tier="web"))
    assert refused.returncode == 1
    assert 'Apply failed with 1 conflict: conflict with "kubectl": .spec.replicas' in refused.stderr, refused.stderr
    assert "--force-conflicts" in refused.stderr
    assert kube.get(DEPLOYMENTS, "default", "web")["spec"]["replicas"] == 2
    # The same value is shared ownership, not a conflict.
    await apply_ok(kubectl, labelled(2, tier="web"), "--server-side", "--field-manager=bob")
    # Forced: bob takes .spec.replicas away from kubectl.
    await apply_ok(kubectl, labelled(3, tier="web"), "--server-side", "--field-manager=bob", "--force-conflicts")
    assert kube.get(DEPLOYMENTS, "default", "web")["spec"]["replicas"] == 3
    assert "f:replicas" not in managers(kube)[("kubectl", "Apply", "")]["f:spec"]
    assert managers(kube)[("bob", "Apply", "")]["f:spec"]["f:replicas"] == {}

    # kubectl stops applying both labels: `team` (its alone) goes, `tier` (bob's too) stays.
    await apply_ok(kubectl, labelled(2).replace(", labels: {}", "").replace("  replicas: 2\n", ""), "--server-side")
    assert kube.get(DEPLOYMENTS, "default", "web")["metadata"]["labels"] == {"tier": "web"}
    assert kube.get(DEPLOYMENTS, "default", "web")["spec"]["replicas"] == 3

    # Updates are recorded too: the scale subresource's writer now owns .spec.replicas, so an
    # applier that sets it differently conflicts with an Update manager.
    scaled = await kubectl("scale", "deploy/web", "--replicas=5")
    assert scaled.returncode == 0, scaled.stderr
    assert managers(kube)[("kubectl", "Update", "scale")] == {"f:spec": {"f:replicas": {}}}
    again = await kubectl("apply", "--server-side", "--field-manager=bob", "-f", "-", input=labelled(3, tier="web"))
    assert again.returncode == 1
    assert 'conflict with "kubectl" with subresource "scale" using apps/v1: .spec.replicas' in again.stderr


async def test_every_write_records_its_field_manager(kube: LocalApiServer, kubectl: Kubectl) -> None:
    # Only this test's clients write: the rollout simulator's status writes would move the
    # resourceVersion the dry run below must leave alone.
    await kube.simulator.stop()
    await apply_ok(kubectl, deployment_yaml())
    labelled_ok = await kubectl("label", "deploy/web", "stage=canary")
    assert labelled_ok.returncode == 0, labelled_ok.stderr
    found = managers(kube)
    assert found[("kubectl-client-side-apply", "Update", "")]["f:spec"]["f:replicas"] == {}
    assert found[("kubectl-label", "Update", "")] == {"f:metadata": {"f:labels": {"f:stage": {}}}}
    # A client that names no manager is named by its User-Agent's product, as the API server does.
    async with aiohttp.ClientSession() as session:
        async with session.patch(f"{kube.url}{DEPLOYMENTS.path('default', 'web')}",
                                 data=json.dumps({"metadata": {"annotations": {"owner": "gitops"}}}),
                                 headers={"Content-Type": "application/merge-patch+json",
                                          "User-Agent": "argocd-controller/v2.13 (linux)"}) as response:
            assert response.status == 200
        async with session.patch(f"{kube.url}{DEPLOYMENTS.path('default', 'web')}?fieldManager=moonlease-operator",
                                 data=json.dumps({"metadata": {"annotations": {"owner": "operator"}}}),
                                 headers={"Content-Type": "application/merge-patch+json"}) as response:
            assert response.status == 200
        # An apply without a manager is refused, as the API server refuses it.
        async with session.patch(f"{kube.url}{DEPLOYMENTS.path('default', 'web')}", data="{}",
                                 headers={"Content-Type": "application/apply-patch+yaml"}) as response:
            assert response.status == 422
            assert "fieldManager: Required value: is required for apply patch" in (await response.json())["message"]
    found = managers(kube)
    # The operator changed the annotation after argocd: the field moved to the operator.
    assert ("argocd-controller", "Update", "") not in found
    assert found[("moonlease-operator", "Update", "")] == {"f:metadata": {"f:annotations": {"f:owner": {}}}}

    # kubectl's first server-side apply takes over what `kubectl apply` set, without a conflict.
    moved = await kubectl("apply", "--server-side", "-f", "-", input=deployment_yaml(replicas=4))
    assert moved.returncode == 0, moved.stderr
    assert kube.get(DEPLOYMENTS, "default", "web")["spec"]["replicas"] == 4
    assert managers(kube)[("kubectl", "Apply", "")]["f:spec"]["f:replicas"] == {}
    # A dry run conflicts or passes as the write would, and writes nothing.
    version = kube.get(DEPLOYMENTS, "default", "web")["metadata"]["resourceVersion"]
    dry = await kubectl("apply", "--server-side", "--dry-run=server", "--field-manager=bob", "-f", "-",
                        input=deployment_yaml(replicas=6))
    assert dry.returncode == 1 and "conflict with" in dry.stderr
    forced = await kubectl("apply", "--server-side", "--dry-run=server", "--force-conflicts", "--field-manager=bob",
                           "-f", "-", input=deployment_yaml(replicas=6))
    assert forced.returncode == 0, forced.stderr
    stored = kube.get(DEPLOYMENTS, "default", "web")
    assert stored["metadata"]["resourceVersion"] == version and stored["spec"]["replicas"] == 4
    assert not any(manager == "bob" for manager, _, _ in managers(kube))
