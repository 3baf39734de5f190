"""Go clients reading `/openapi/v2` from the local API server: client-go asks for it as gnostic's
protobuf only (no JSON fallback), so each test here fails with "proto: cannot parse invalid
wire-format data" against a server that answers JSON. Helm's server-side dry run (the Helm 4 SDK)
reads it where a kind is missing from the v3 documents and must write nothing; `kubectl explain
--output=plaintext-openapiv2` reads every part of it (definitions, references, types,
descriptions, required fields, the group-version-kind extensions)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import helm_python as helm
import pytest
import yaml

from moonlease_dev.testbed.kube import BUILTIN_RESOURCES, LocalApiServer
from tests.conformance.conftest import Kubectl

pytestmark = pytest.mark.conformance

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "moonlease"
NAMESPACE = "inference"
CLIENT_GO_ACCEPT = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"  # discovery.OpenAPISchema's
PROTOBUF = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"  # what the API server answers


def snapshot(kube: LocalApiServer) -> tuple[int, dict[str, list[tuple[Any, ...]]]]:
    """The server's resourceVersion and every stored object by resource (name, namespace, version)."""
    stored = {}
    for what in [*BUILTIN_RESOURCES, "mooncakeleasepolicies"]:
        stored[str(what)] = sorted((o["metadata"].get("namespace"), o["metadata"]["name"],
                                    o["metadata"]["resourceVersion"]) for o in kube.list(what))
    return kube.emulator.resource_version, stored


async def helm_dry_run(kube: LocalApiServer, values: dict[str, Any], *, create_namespace: bool) -> dict[str, Any]:
    """`helm install moonlease charts/moonlease -n inference --dry-run=server` through the Helm SDK
    (its calls block: they run in a thread while this loop serves them)."""
    kubeconfig = yaml.safe_dump(kube.kubeconfig(namespace=NAMESPACE))
    with helm.Config(kubeconfig_content=kubeconfig, namespace=NAMESPACE) as config:
        release: dict[str, Any] = await asyncio.to_thread(
            config.install, str(CHART), "moonlease", values, namespace=NAMESPACE, dry_run="server",
            create_namespace=create_namespace, timeout=60)
    return release


def only_reads(kube: LocalApiServer, since: int) -> None:
    writes = [(c.method, c.path) for c in kube.api_calls(since) if c.method.upper() != "GET"]
    assert writes == [], "a dry run wrote"


async def test_helm_server_dry_run_installs_nothing(kube: LocalApiServer) -> None:
    # 1. A cluster with the policy CRD only: the chart's kopf peering kind is in no v3 document,
    # so Helm's validation looks it up in v2 (protobuf) and then says what an API server makes it
    # say. Against a server that answered JSON, it failed on the protobuf instead.
    before, since = snapshot(kube), len(kube.api_calls())
    with pytest.raises(helm.HelmError) as refused:
        await helm_dry_run(kube, {}, create_namespace=True)
    assert 'no matches for kind "KopfPeering" in version "kopf.dev/v1"' in str(refused.value)
    assert "ensure CRDs are installed first" in str(refused.value)
    assert "proto:" not in str(refused.value)
    assert any(c.path == "/openapi/v2" for c in kube.api_calls(since))
    assert snapshot(kube) == before
    only_reads(kube, since)

    # 2. Without the operator (no peering object): the dry run renders the release, creating
    # neither the namespace (--create-namespace), nor the CRDs of crds/, nor any object or
    # release record.
    release = await helm_dry_run(kube, {"operator": {"enabled": False}}, create_namespace=True)
    assert (release["status"], release["revision"]) == ("pending-install", 1)
    kinds = {doc["kind"] for doc in yaml.safe_load_all(release["manifest"]) if doc}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "MooncakeLeasePolicy"} <= kinds
    assert snapshot(kube) == before
    assert kube.get("namespaces", None, NAMESPACE) is None
    assert kube.get("customresourcedefinitions", None, "kopfpeerings.kopf.dev") is None
    only_reads(kube, since)

    # 3. The whole chart, its CRDs and namespace in place (a cluster it was installed in before).
    await kube.apply_yaml((CHART / "crds" / "kopf-peerings.yaml").read_text())
    await kube.apply_yaml(f"apiVersion: v1\nkind: Namespace\nmetadata: {{name: {NAMESPACE}}}\n")
    before, since = snapshot(kube), len(kube.api_calls())
    release = await helm_dry_run(kube, {}, create_namespace=False)
    assert release["status"] == "pending-install"
    kinds = {doc["kind"] for doc in yaml.safe_load_all(release["manifest"]) if doc}
    assert {"KopfPeering", "ServiceAccount", "Role", "RoleBinding", "Deployment"} <= kinds
    assert snapshot(kube) == before
    assert kube.list("secrets", NAMESPACE) == []  # no release record
    only_reads(kube, since)


async def test_kubectl_explain_reads_the_v2_document(kube: LocalApiServer, kubectl: Kubectl) -> None:
    replicas = await kubectl("explain", "deployment.spec.replicas", "--output=plaintext-openapiv2")
    assert replicas.returncode == 0, replicas.stderr
    assert "KIND:     Deployment\nVERSION:  apps/v1" in replicas.stdout
    assert "FIELD:    replicas <integer>" in replicas.stdout
    assert "Number of desired pods." in replicas.stdout
    # References followed across definitions (PodTemplateSpec, PodSpec, Container), list items,
    # required fields.
    containers = await kubectl("explain", "deployment.spec.template.spec.containers",
                               "--output=plaintext-openapiv2")
    assert containers.returncode == 0, containers.stderr
    assert "RESOURCE: containers <[]Object>" in containers.stdout
    assert "name\t<string> -required-" in containers.stdout
    assert "ports\t<[]Object>" in containers.stdout
    # The CRD's schema, found by its x-kubernetes-group-version-kind (a YAML-encoded extension).
    policy = await kubectl("explain", "mlp.spec", "--output=plaintext-openapiv2")
    assert policy.returncode == 0, policy.stderr
    assert "KIND:     MooncakeLeasePolicy\nVERSION:  moonlease.io/v1alpha1" in policy.stdout
    assert "master\t<Object> -required-" in policy.stdout
    assert any(c.path == "/openapi/v2" and c.user_agent.startswith("kubectl") for c in kube.api_calls())


async def test_the_document_is_negotiated_as_the_api_server_does(kube: LocalApiServer) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(kube.url + "/openapi/v2", headers={"Accept": CLIENT_GO_ACCEPT}) as rsp:
            assert rsp.status == 200
            assert rsp.headers["Content-Type"] == PROTOBUF and rsp.headers["Vary"] == "Accept"
            etag = rsp.headers["ETag"]
            protobuf = await rsp.read()
        assert protobuf.startswith(b"\x0a\x032.0")  # Document.swagger (field 1) = "2.0"
        async with session.get(kube.url + "/openapi/v2") as rsp:
            assert rsp.headers["Content-Type"].split(";")[0] == "application/json"
            assert (await rsp.json())["swagger"] == "2.0"
            assert rsp.headers["ETag"] == etag  # one ETag for both encodings (Vary: Accept)
        async with session.get(kube.url + "/openapi/v2", headers={"Accept": CLIENT_GO_ACCEPT,
                                                                  "If-None-Match": etag}) as rsp:
            assert rsp.status == 304
        async with session.get(kube.url + "/openapi/v2", headers={"Accept": "text/html"}) as rsp:
            assert rsp.status == 406
        # A CRD created later changes the document and its ETag.
        await kube.apply_yaml((CHART / "crds" / "kopf-peerings.yaml").read_text())
        async with session.get(kube.url + "/openapi/v2", headers={"Accept": CLIENT_GO_ACCEPT,
                                                                  "If-None-Match": etag}) as rsp:
            assert rsp.status == 200 and rsp.headers["ETag"] != etag
            assert b"io.kopf.dev.v1.KopfPeering" not in protobuf and b"dev.kopf.v1.KopfPeering" in await rsp.read()
