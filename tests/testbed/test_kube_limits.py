"""The local API server enforces the real API server's limits that matter to the operator: object
names, label and annotation syntax and size, object and request size, resourceVersion
preconditions on every write, selector syntax and supported field labels, and `limit`/`continue`
pagination. Every check goes over HTTP to the running server and reads the `kind: Status` body a
real server would send."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import aiohttp
import pytest

from moonlease_dev.testbed.kube import (
    CONFIGMAPS,
    DEPLOYMENTS,
    MAX_ANNOTATIONS_BYTES,
    LocalApiServer,
    deployment_manifest,
    namespace_manifest,
)
from moonlease_dev.testbed.kube.validation import (
    label_value_errors,
    qualified_name_errors,
    dns1035_label_errors,
    dns1123_label_errors,
    dns1123_subdomain_errors,
    generated_name,
)
from moonlease_dev.testbed.kube.pagination import decode_continue, page

pytestmark = pytest.mark.operator

DEPLOYS = "/apis/apps/v1/namespaces/default/deployments"
POLICIES = "/apis/moonlease.io/v1alpha1/namespaces/default/mooncakeleasepolicies"
MERGE = "application/merge-patch+json"


async def http(kube: LocalApiServer, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
               content_type: str = "application/json", params: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        data = raw if raw is not None else (None if body is None else json.dumps(body))
        async with session.request(method, kube.url + path, data=data, params=params,
                                   headers={"Content-Type": content_type}) as rsp:
            return rsp.status, await rsp.json()


def assert_status(body: Any, code: int, reason: str) -> None:
    """A real Status body: kind, code, reason, a message; no traceback leaked."""
    assert body["kind"] == "Status" and body["apiVersion"] == "v1" and body["status"] == "Failure", body
    assert (body["code"], body["reason"]) == (code, reason), body
    assert body["message"] and "traceback" not in body.get("details", {}), body


def policy(name: str = "fleet") -> dict[str, Any]:
    return {"apiVersion": "moonlease.io/v1alpha1", "kind": "MooncakeLeasePolicy",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"master": {"name": "mooncake-master"}, "targets": [{"name": "llama-decode", "role": "decode"}]}}


# ---- pure rules ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("check", "value", "valid"), [
    (dns1123_subdomain_errors, "llama-decode.v2", True),
    (dns1123_subdomain_errors, "Llama", False),
    (dns1123_subdomain_errors, "a" * 254, False),
    (dns1123_label_errors, "team-a", True),
    (dns1123_label_errors, "team.a", False),
    (dns1035_label_errors, "master", True),
    (dns1035_label_errors, "1master", False),
    (qualified_name_errors, "moonlease.io/config-hash", True),
    (qualified_name_errors, "app", True),
    (qualified_name_errors, "Bad_Prefix/x", False),
    (qualified_name_errors, "a/b/c", False),
    (qualified_name_errors, "x" * 64, False),
    (label_value_errors, "", True),
    (label_value_errors, "v" * 63, True),
    (label_value_errors, "v" * 64, False),
    (label_value_errors, "-lead", False),
])
def test_syntax_rules(check: Any, value: str, valid: bool) -> None:
    assert (check(value) == []) is valid


def test_generate_name_leaves_room_for_the_suffix() -> None:
    assert generated_name("p" * 80, "abcde") == "p" * 58 + "abcde"


def test_pages_cover_every_item_once() -> None:
    items = [{"metadata": {"namespace": "default", "name": f"d{i}"}} for i in range(5)]
    first = page(items, revision=7, limit=2)
    assert [i["metadata"]["name"] for i in first.items] == ["d0", "d1"] and first.remaining == 3
    token = decode_continue(first.next_token or "")
    assert token.revision == 7
    second = page(items, revision=7, limit=2, start=token.start)
    last = page(items, revision=7, limit=2, start=decode_continue(second.next_token or "").start)
    assert [i["metadata"]["name"] for i in last.items] == ["d4"] and last.next_token is None
    with pytest.raises(ValueError):
        decode_continue("not-a-token")


def test_importing_the_test_bed_patches_nothing() -> None:
    """The pure helpers (and the package) import without touching kmock's internals."""
    code = ("import kmock._internal.parsing as p; before = p.parse_path; "
            "import moonlease_dev.testbed.kube, moonlease_dev.testbed.kube.selectors; "
            "assert p.parse_path is before, 'patched at import'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- names, labels, annotations --------------------------------------------------------------------

async def test_object_names_follow_each_resource_rule(kube_manual: LocalApiServer) -> None:
    status, body = await http(kube_manual, "POST", DEPLOYS, deployment_manifest("Llama_Decode"))
    assert status == 422
    assert_status(body, 422, "Invalid")
    assert body["message"].startswith('Deployment.apps "Llama_Decode" is invalid: metadata.name: Invalid value')
    assert body["details"]["causes"][0] == {"reason": "FieldValueInvalid", "field": "metadata.name",
                                            "message": body["details"]["causes"][0]["message"]}
    status, _ = await http(kube_manual, "POST", DEPLOYS, deployment_manifest("d" * 254))
    assert status == 422
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "1master"}, "spec": {}}
    status, body = await http(kube_manual, "POST", "/api/v1/namespaces/default/services", service)
    assert status == 422 and "DNS-1035" in body["message"]
    status, _ = await http(kube_manual, "POST", DEPLOYS, deployment_manifest("1master"))
    assert status == 201  # a valid subdomain, though not a valid Service name
    status, body = await http(kube_manual, "POST", "/api/v1/namespaces", namespace_manifest("team.a"))
    assert status == 422 and "RFC 1123 label" in body["message"]
    status, _ = await http(kube_manual, "POST", POLICIES, policy("Fleet"))
    assert status == 422  # custom resources: RFC 1123 subdomains too
    assert kube_manual.list(DEPLOYMENTS, "default") and len(kube_manual.list(DEPLOYMENTS, "default")) == 1


async def test_generate_name_is_cut_to_fit(kube_manual: LocalApiServer) -> None:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "c" * 70}}
    status, created = await http(kube_manual, "POST", "/api/v1/namespaces/default/configmaps", body)
    assert status == 201 and len(created["metadata"]["name"]) == 63


async def test_label_keys_and_values(kube_manual: LocalApiServer) -> None:
    too_long = deployment_manifest("web", labels={"moonlease.io/policy": "p" * 64})
    status, body = await http(kube_manual, "POST", DEPLOYS, too_long)
    assert status == 422
    assert_status(body, 422, "Invalid")
    assert "metadata.labels: Invalid value" in body["message"] and "no more than 63 characters" in body["message"]
    # The pod template's labels are checked too (the operator's config-hash and policy labels).
    status, body = await http(kube_manual, "POST", DEPLOYS, deployment_manifest("web", labels={"Bad_Prefix/x": "y"}))
    assert status == 422 and {c["field"] for c in body["details"]["causes"]} >= {
        "metadata.labels", "spec.template.metadata.labels"}
    status, created = await http(kube_manual, "POST", DEPLOYS,
                                 deployment_manifest("web", labels={"moonlease.io/policy": "p" * 63}))
    assert status == 201
    path = f"{DEPLOYS}/web"
    status, body = await http(kube_manual, "PATCH", path, {"spec": {"template": {"metadata": {"labels": {
        "moonlease.io/policy": "q" * 64}}}}}, content_type=MERGE)
    assert status == 422 and "spec.template.metadata.labels" in body["message"]
    assert kube_manual.get(DEPLOYMENTS, "default", "web") == created  # nothing stored


async def test_annotations_total_at_most_256_kib(kube_manual: LocalApiServer) -> None:
    await kube_manual.create(deployment_manifest("web"))
    path = f"{DEPLOYS}/web"
    key = "moonlease.io/targets"
    fits = {"metadata": {"annotations": {key: "x" * (MAX_ANNOTATIONS_BYTES - len(key))}}}
    status, _ = await http(kube_manual, "PATCH", path, fits, content_type=MERGE)
    assert status == 200
    over = {"metadata": {"annotations": {"moonlease.io/more": "y"}}}
    status, body = await http(kube_manual, "PATCH", path, over, content_type=MERGE)
    assert status == 422
    assert body["message"].endswith("metadata.annotations: Too long: must have at most 262144 bytes")
    assert body["details"]["causes"][0]["reason"] == "FieldValueTooLong"
    status, body = await http(kube_manual, "PATCH", path, {"metadata": {"annotations": {"a b": "c"}}},
                              content_type=MERGE)
    assert status == 422 and "metadata.annotations" in body["message"]
    status, body = await http(kube_manual, "PATCH", path, {"metadata": {"finalizers": ["not valid!"]}},
                              content_type=MERGE)
    assert status == 422 and "metadata.finalizers[0]" in body["message"]


# ---- sizes -------------------------------------------------------------------------------------------

async def test_configmap_data_at_most_1_mib(kube_manual: LocalApiServer) -> None:
    big = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "big"}, "data": {"a": "x" * ((1 << 20) + 1)}}
    status, body = await http(kube_manual, "POST", "/api/v1/namespaces/default/configmaps", big)
    assert status == 422 and "must have at most 1048576 bytes" in body["message"]
    assert kube_manual.get(CONFIGMAPS, "default", "big") is None


async def test_objects_over_1_5_mib_and_bodies_over_3_mib_are_refused(kube_manual: LocalApiServer) -> None:
    args = [f"--flag-{i}={'v' * 1000}" for i in range(1600)]  # ~1.6 MB: over etcd's 1.5 MiB
    huge = deployment_manifest("huge", containers=[{"name": "main", "image": "i", "args": args}])
    status, body = await http(kube_manual, "POST", DEPLOYS, huge)
    assert status == 413
    assert_status(body, 413, "RequestEntityTooLarge")
    assert kube_manual.get(DEPLOYMENTS, "default", "huge") is None

    # A patch that grows a stored object past the limit is refused the same way; nothing changes.
    created = await kube_manual.create(deployment_manifest("web"))
    grow = {"spec": {"template": {"spec": {"containers": [{"name": "main", "image": "i", "args": args}]}}}}
    status, body = await http(kube_manual, "PATCH", f"{DEPLOYS}/web", grow, content_type=MERGE)
    assert status == 413 and kube_manual.get(DEPLOYMENTS, "default", "web") == created

    status, body = await http(kube_manual, "POST", DEPLOYS, raw=b" " * (3 * 1024 * 1024 + 1))
    assert status == 413 and body["message"] == "Request entity too large: limit is 3145728"


# ---- resourceVersion preconditions -------------------------------------------------------------------------

async def test_every_write_with_a_stale_resource_version_conflicts(kube_manual: LocalApiServer) -> None:
    created = await kube_manual.create(policy())
    path = f"{POLICIES}/fleet"
    stale = created["metadata"]["resourceVersion"]
    status, current = await http(kube_manual, "PATCH", path, {"metadata": {"labels": {"a": "b"}}}, content_type=MERGE)
    assert status == 200 and int(current["metadata"]["resourceVersion"]) > int(stale)
    assert current["metadata"]["generation"] == 1

    attempts = [
        ("PATCH", path, {"metadata": {"resourceVersion": stale}, "spec": {"master": {"evictionRatio": 0.2}}}, MERGE),
        ("PATCH", f"{path}/status", {"metadata": {"resourceVersion": stale}, "status": {"phase": "Ready"}}, MERGE),
        ("PATCH", path, [{"op": "replace", "path": "/metadata/resourceVersion", "value": stale}],
         "application/json-patch+json"),
        ("PUT", path, {**current, "metadata": {**current["metadata"], "resourceVersion": stale}}, "application/json"),
        ("DELETE", path, {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"resourceVersion": stale}},
         "application/json"),
        ("DELETE", path, {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": "someone-else"}},
         "application/json"),
    ]
    for method, url, body, content_type in attempts:
        status, answer = await http(kube_manual, method, url, body, content_type=content_type)
        assert status == 409, (method, url, answer)
        assert_status(answer, 409, "Conflict")
        assert answer["details"] == {"name": "fleet", "group": "moonlease.io", "kind": "mooncakeleasepolicies"}
    assert kube_manual.get("mlp", "default", "fleet") == current  # none of them wrote anything

    # A custom resource's PUT must name the version it replaces.
    unconditional = {**current, "metadata": {k: v for k, v in current["metadata"].items() if k != "resourceVersion"}}
    status, answer = await http(kube_manual, "PUT", path, unconditional)
    assert status == 422 and "metadata.resourceVersion" in answer["message"]

    # The current version goes through, bumps resourceVersion, and generation only for spec.
    status, respec = await http(kube_manual, "PATCH", path, {"metadata": {"resourceVersion": current["metadata"][
        "resourceVersion"]}, "spec": {"master": {"evictionRatio": 0.2}}}, content_type=MERGE)
    assert status == 200 and respec["metadata"]["generation"] == 2
    assert int(respec["metadata"]["resourceVersion"]) > int(current["metadata"]["resourceVersion"])
    status, answer = await http(kube_manual, "POST", POLICIES, {**policy("other"), "metadata": {
        "name": "other", "resourceVersion": "5"}})
    assert status == 400 and "should not be set" in answer["message"]


# ---- selectors -------------------------------------------------------------------------------------------

async def test_selectors_are_checked_like_the_real_server(kube_manual: LocalApiServer) -> None:
    for name, tier in (("a", "web"), ("b", "db")):
        await kube_manual.create(deployment_manifest(name, labels={"tier": tier}))
    status, listed = await http(kube_manual, "GET", DEPLOYS, params={"labelSelector": "tier in (db),app.kubernetes.io/name"})
    assert status == 200 and [d["metadata"]["name"] for d in listed["items"]] == ["b"]
    status, listed = await http(kube_manual, "GET", DEPLOYS, params={"fieldSelector": "metadata.name!=a"})
    assert status == 200 and [d["metadata"]["name"] for d in listed["items"]] == ["b"]

    status, body = await http(kube_manual, "GET", DEPLOYS, params={"labelSelector": f"tier={'x' * 64}"})
    assert status == 400
    assert_status(body, 400, "BadRequest")
    status, body = await http(kube_manual, "GET", DEPLOYS, params={"labelSelector": "tier in db"})
    assert status == 400 and "unable to parse requirement" in body["message"]
    # Deployments support no field selector beyond metadata.name / metadata.namespace.
    status, body = await http(kube_manual, "GET", DEPLOYS, params={"fieldSelector": "spec.replicas=2"})
    assert status == 400 and body["message"] == "field label not supported: spec.replicas"
    status, body = await http(kube_manual, "GET", DEPLOYS, params={"fieldSelector": "spec.replicas=2", "watch": "true"})
    assert status == 400
    status, body = await http(kube_manual, "GET", "/api/v1/namespaces/default/events",
                              params={"fieldSelector": "involvedObject.name=a,reason=Started"})
    assert status == 200 and body["items"] == []


# ---- pagination ----------------------------------------------------------------------------------------------

async def test_lists_paginate_consistently_at_the_first_pages_version(kube_manual: LocalApiServer) -> None:
    await kube_manual.create(namespace_manifest("team-a"))
    for i in range(7):
        await kube_manual.create(deployment_manifest(f"d{i}", namespace="team-a" if i % 2 else "default"))
    status, first = await http(kube_manual, "GET", "/apis/apps/v1/deployments", params={"limit": "3"})
    assert status == 200 and len(first["items"]) == 3
    assert first["metadata"]["remainingItemCount"] == 4 and first["metadata"]["continue"]
    listed_at = first["metadata"]["resourceVersion"]

    # Changes between pages do not show: every page is the list as of the first one.
    await kube_manual.delete(DEPLOYMENTS, "team-a", "d5")
    await kube_manual.create(deployment_manifest("d9", namespace="team-a"))
    await kube_manual.patch(DEPLOYMENTS, "team-a", "d3", {"spec": {"replicas": 5}})

    names = [f'{d["metadata"]["namespace"]}/{d["metadata"]["name"]}' for d in first["items"]]
    token = first["metadata"]["continue"]
    replicas = {}
    while token:
        status, more = await http(kube_manual, "GET", "/apis/apps/v1/deployments",
                                  params={"limit": "3", "continue": token})
        assert status == 200 and more["metadata"]["resourceVersion"] == listed_at
        names += [f'{d["metadata"]["namespace"]}/{d["metadata"]["name"]}' for d in more["items"]]
        replicas.update({d["metadata"]["name"]: d["spec"]["replicas"] for d in more["items"]})
        token = more["metadata"].get("continue")
    assert names == sorted(names) and len(names) == 7 and "team-a/d5" in names and "team-a/d9" not in names
    assert replicas.get("d3", 2) == 2

    # etcd compaction past a list's version ends its pagination: 410 Expired.
    status, again = await http(kube_manual, "GET", "/apis/apps/v1/deployments", params={"limit": "3"})
    await kube_manual.patch(DEPLOYMENTS, "team-a", "d3", {"spec": {"replicas": 6}})
    kube_manual.compact()
    status, body = await http(kube_manual, "GET", "/apis/apps/v1/deployments",
                              params={"limit": "3", "continue": again["metadata"]["continue"]})
    assert status == 410
    assert_status(body, 410, "Expired")
    status, body = await http(kube_manual, "GET", "/apis/apps/v1/deployments", params={"continue": "garbage"})
    assert status == 400


async def test_unknown_resources_and_objects_answer_404_status(kube_manual: LocalApiServer) -> None:
    status, body = await http(kube_manual, "GET", "/apis/apps/v1/namespaces/default/widgets")
    assert status == 404
    assert_status(body, 404, "NotFound")
    assert body["message"] == "the server could not find the requested resource"
    status, body = await http(kube_manual, "GET", f"{DEPLOYS}/nowhere")
    assert status == 404 and body["message"] == 'deployments.apps "nowhere" not found'
    assert body["details"] == {"name": "nowhere", "group": "apps", "kind": "deployments"}


async def test_traffic_counts_requests_and_bytes(kube_manual: LocalApiServer) -> None:
    await kube_manual.create(deployment_manifest("web"))
    before = kube_manual.traffic.snapshot()
    async with aiohttp.ClientSession() as session:
        async with session.get(kube_manual.url + DEPLOYS) as rsp:
            size = len(await rsp.read())
    served = kube_manual.traffic.since(before)
    assert served.requests == {("list", "deployments"): 1}
    assert served.bytes_served == {("list", "deployments"): size} and size > 500


async def test_serving_a_request_never_walks_the_servers_request_log(
        kube_manual: LocalApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """kmock's own dispatch asked each reaction `request in view`, a walk through every request the
    server ever got: a request cost time in proportion to the server's age. The emulator's
    reactions are matched on the request alone; a reaction kmock's way (a slice) still counts."""
    from kmock._internal import dsl

    walks = {"root": 0}
    walk = dsl.Root.__iter__

    def counted(self: Any) -> Any:
        walks["root"] += 1
        return walk(self)

    async with aiohttp.ClientSession() as session:
        for _ in range(50):
            async with session.get(kube_manual.url + DEPLOYS) as rsp:
                assert rsp.status == 200
        monkeypatch.setattr(dsl.Root, "__iter__", counted)
        async with session.get(kube_manual.url + DEPLOYS) as rsp:
            assert rsp.status == 200
        assert walks["root"] == 0
        # A reaction of the first matching request only (a slice: matched kmock's way, walking).
        kube_manual.emulator["get"]["/api/teapot"][:1] << 418
        async with session.get(kube_manual.url + "/api/teapot") as rsp:
            assert rsp.status == 418
        assert walks["root"] > 0
        async with session.get(kube_manual.url + "/api/teapot") as rsp:
            assert rsp.status != 418  # depleted: the emulator's own reactions answer
