"""Real kubectl 1.32 against the local API server: each test runs commands as a user would and
asserts what a real API server makes kubectl print or do (a server that answered differently —
octet-stream watches, no Tables, dry runs that write — fails them)."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
from pathlib import Path

import aiohttp
import pytest

from moonlease_dev.testbed.kube import CONFIGMAPS, DEPLOYMENTS, NAMESPACES, SECRETS, SERVICES, LocalApiServer
from tests.conformance.conftest import Kubectl, apply_ok, deployment_yaml, header

pytestmark = pytest.mark.conformance

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "examples" / "policies" / "lease-all.yaml"


# ---- 1. watch streams Go clients read ---------------------------------------------------------

async def test_get_watch_prints_the_changes_as_they_happen(kube: LocalApiServer, kubectl: Kubectl) -> None:
    await apply_ok(kubectl, deployment_yaml(replicas=2))
    await kube.wait_for(lambda: (kube.get(DEPLOYMENTS, "default", "web") or {}).get("status", {})
                        .get("readyReplicas") == 2, what="web ready")
    watching = asyncio.create_task(kubectl("get", "deploy", "web", "-w", "--request-timeout=3s", timeout=15))
    await kube.wait_for(lambda: kube.emulator.open_watches > 0, what="kubectl's watch")
    patched = await kubectl("patch", "deploy", "web", "-p", '{"spec":{"replicas":3}}')
    assert patched.returncode == 0, patched.stderr
    done = await watching
    assert "no stream serializers" not in done.stderr and "octet-stream" not in done.stderr
    lines = done.stdout.splitlines()
    assert header(done.stdout) == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"]
    assert sum(line.startswith("NAME") for line in lines) == 1  # one header, then a row per event
    assert lines[1].split()[:2] == ["web", "2/2"]
    assert any(line.split()[:2] == ["web", "3/3"] for line in lines[2:]), done.stdout
    # The stream is newline-delimited JSON as client-go reads it.
    assert any(call.verb == "watch" and call.resource == "deployments" for call in kube.api_calls())


async def test_rollout_status_and_wait_follow_the_deployment(kube: LocalApiServer, kubectl: Kubectl) -> None:
    await apply_ok(kubectl, deployment_yaml(replicas=3))
    rollout = await kubectl("rollout", "status", "deploy/web", "--timeout=15s")
    assert rollout.returncode == 0, rollout.stderr
    assert 'deployment "web" successfully rolled out' in rollout.stdout
    waited = await kubectl("wait", "--for=condition=Available", "deploy/web", "--timeout=15s")
    assert waited.returncode == 0, waited.stderr
    assert "deployment.apps/web condition met" in waited.stdout
    # A condition that never comes: kubectl waits on the watch, then gives up (exit 1).
    never = await kubectl("wait", "--for=condition=Stalled", "deploy/web", "--timeout=1s")
    assert never.returncode == 1 and "timed out waiting" in never.stderr


async def test_a_watch_answers_json_lines_with_the_json_content_type(kube: LocalApiServer) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(kube.url + "/api/v1/namespaces", params={"watch": "true", "timeoutSeconds": "1"}) as rsp:
            assert rsp.headers["Content-Type"].split(";")[0] == "application/json"
            events = [json.loads(line) async for line in rsp.content if line.strip()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "default")]


# ---- 2. Table responses -----------------------------------------------------------------------

async def test_get_prints_each_kinds_columns(kube: LocalApiServer, kubectl: Kubectl) -> None:
    await apply_ok(kubectl, deployment_yaml(replicas=2))
    await kube.wait_for(lambda: (kube.get(DEPLOYMENTS, "default", "web") or {}).get("status", {})
                        .get("availableReplicas") == 2, what="web available")
    plain = await kubectl("get", "deploy")
    assert header(plain.stdout) == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"]
    assert plain.stdout.splitlines()[1].split()[:4] == ["web", "2/2", "2", "2"]
    wide = await kubectl("get", "deploy", "-o", "wide")
    assert header(wide.stdout) == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE", "CONTAINERS", "IMAGES",
                                   "SELECTOR"]
    assert wide.stdout.splitlines()[1].split()[5:] == ["web", "nginx:1.27", "app=web"]
    # Warnings about short names of subresources would mean discovery lists them wrongly.
    assert "could also match" not in plain.stderr

    await apply_ok(kubectl, "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: settings}\ndata: {a: '1', b: '2'}\n")
    cms = await kubectl("get", "configmaps")
    assert header(cms.stdout) == ["NAME", "DATA", "AGE"]
    assert cms.stdout.splitlines()[1].split()[:2] == ["settings", "2"]

    event = """apiVersion: v1
kind: Event
metadata: {name: web.1}
involvedObject: {kind: Deployment, name: web, namespace: default}
reason: ScalingReplicaSet
message: Scaled up to 2
type: Normal
"""
    created = await kubectl("create", "-f", "-", input=event)
    assert created.returncode == 0, created.stderr
    events = await kubectl("get", "events")
    assert header(events.stdout) == ["LAST SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    assert events.stdout.splitlines()[1].split()[1:] == ["Normal", "ScalingReplicaSet", "deployment/web", "Scaled",
                                                         "up", "to", "2"]


async def test_delete_waits_for_the_object_to_go(kube: LocalApiServer, kubectl: Kubectl) -> None:
    await apply_ok(kubectl, "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: held, finalizers: [example.com/x]}\n")
    deleting = asyncio.create_task(kubectl("delete", "cm", "held", "--wait", "--timeout=15s", timeout=20))
    await kube.wait_for(lambda: (kube.get(CONFIGMAPS, "default", "held") or {}).get("metadata", {})
                        .get("deletionTimestamp"), what="deletion started")
    await asyncio.sleep(0.3)
    assert not deleting.done()  # kubectl waits on its watch while the finalizer holds the object
    await kube.patch(CONFIGMAPS, "default", "held", {"metadata": {"finalizers": None}})
    done = await deleting
    assert done.returncode == 0 and 'configmap "held" deleted' in done.stdout, done.stderr
    assert kube.get(CONFIGMAPS, "default", "held") is None


async def test_get_mlp_prints_the_crds_printer_columns(kube: LocalApiServer, kubectl: Kubectl) -> None:
    namespace = await kubectl("create", "-f", "-", input="apiVersion: v1\nkind: Namespace\nmetadata: {name: inference}\n")
    assert namespace.returncode == 0, namespace.stderr
    created = await kubectl("apply", "-f", str(POLICY))
    assert created.returncode == 0, created.stderr
    listed = await kubectl("get", "mlp", "-A")
    assert header(listed.stdout) == ["NAMESPACE", "NAME", "MODE", "PHASE", "STAGE", "READY", "A/B", "VERDICT", "AGE"]
    assert listed.stdout.splitlines()[1].split()[:3] == ["inference", "llama-fleet", "leaseAll"]
    wide = await kubectl("get", "mlp", "-n", "inference", "-o", "wide")
    assert header(wide.stdout)[-2:] == ["SAMPLES", "REASON"]  # the priority-1 columns


async def test_a_kind_without_printer_columns_gets_name_and_age(kube: LocalApiServer, kubectl: Kubectl) -> None:
    crd = """apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.example.com}
spec:
  group: example.com
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
"""
    await apply_ok(kubectl, crd)
    await apply_ok(kubectl, "apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: w1}\nsize: 3\n")
    listed = await kubectl("get", "widgets")
    assert header(listed.stdout) == ["NAME", "AGE"]
    assert listed.stdout.splitlines()[1].split() == ["w1", listed.stdout.splitlines()[1].split()[1]]
    crds = await kubectl("get", "crd")
    assert header(crds.stdout) == ["NAME", "CREATED AT"]


# ---- 3. server-side dry run -------------------------------------------------------------------

async def test_dry_run_and_diff_never_write(kube: LocalApiServer, kubectl: Kubectl) -> None:
    await apply_ok(kubectl, deployment_yaml(replicas=2))
    await kube.wait_for(lambda: (kube.get(DEPLOYMENTS, "default", "web") or {}).get("status", {})
                        .get("readyReplicas") == 2, what="web ready")
    await asyncio.sleep(0.2)  # the simulator settles: nothing else writes from here on
    await kube.simulator.stop()
    before, revision = kube.get(DEPLOYMENTS, "default", "web"), kube.emulator.resource_version

    applied = await apply_ok(kubectl, deployment_yaml(replicas=5), "--dry-run=server")
    assert "deployment.apps/web configured (server dry run)" in applied
    diff = await kubectl("diff", "-f", "-", input=deployment_yaml(replicas=5))
    assert diff.returncode == 1, diff.stderr  # 1: differences found
    assert "-  replicas: 2" in diff.stdout and "+  replicas: 5" in diff.stdout
    created = await kubectl("create", "--dry-run=server", "-f", "-", input=deployment_yaml("other"))
    assert created.returncode == 0 and "(server dry run)" in created.stdout, created.stderr
    deleted = await kubectl("delete", "deploy", "web", "--dry-run=server")
    assert deleted.returncode == 0 and "(server dry run)" in deleted.stdout, deleted.stderr
    patched = await kubectl("patch", "deploy", "web", "--dry-run=server", "-p", '{"spec":{"replicas":7}}')
    assert patched.returncode == 0, patched.stderr

    # Nothing was written: same object, no new resourceVersion (hence no watch event), no "other".
    assert kube.get(DEPLOYMENTS, "default", "web") == before
    assert kube.emulator.resource_version == revision
    assert kube.get(DEPLOYMENTS, "default", "other") is None


async def test_dry_run_refuses_values_other_than_all(kube: LocalApiServer) -> None:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}
    async with aiohttp.ClientSession() as session:
        async with session.post(kube.url + "/api/v1/namespaces/default/configmaps", params={"dryRun": "Some"},
                                json=body) as rsp:
            assert rsp.status == 400
            assert 'Unsupported value: "Some"' in (await rsp.json())["message"]
        async with session.post(kube.url + "/api/v1/namespaces/default/configmaps", params={"dryRun": "All"},
                                json=body) as rsp:
            assert rsp.status == 201
            answered = await rsp.json()
    assert answered["metadata"]["name"] == "c" and "resourceVersion" not in answered["metadata"]
    assert kube.get(CONFIGMAPS, "default", "c") is None


# ---- 4. protobuf ------------------------------------------------------------------------------

async def test_kubectls_typed_create_commands_send_protobuf_and_succeed(kube: LocalApiServer,
                                                                        kubectl: Kubectl) -> None:
    for command in (["create", "namespace", "team-a"],
                    ["create", "configmap", "settings", "--from-literal=mode=fast", "--from-literal=n=2"],
                    ["create", "secret", "generic", "token", "--from-literal=key=s3cret"],
                    ["create", "deployment", "web", "--image=nginx:1.27", "--replicas=0", "--port=8080"],
                    ["create", "deployment", "job", "--image=busybox", "--", "sleep", "10"],
                    ["create", "service", "clusterip", "web", "--tcp=80:8080"]):
        done = await kubectl(*command)
        assert done.returncode == 0, (command, done.stderr)
    protobuf_posts = [call for call in kube.api_calls() if call.verb == "create"]
    assert len(protobuf_posts) == 6

    assert kube.get(NAMESPACES, None, "team-a") is not None
    assert kube.get(CONFIGMAPS, "default", "settings")["data"] == {"mode": "fast", "n": "2"}
    assert kube.get(SECRETS, "default", "token")["data"] == {"key": base64.b64encode(b"s3cret").decode()}
    web = kube.get(DEPLOYMENTS, "default", "web")
    assert web["spec"]["replicas"] == 0  # a pointer in Go: 0 is kept, not defaulted
    assert web["spec"]["selector"] == {"matchLabels": {"app": "web"}}
    assert web["spec"]["template"]["spec"]["containers"] == [
        {"name": "nginx", "image": "nginx:1.27", "ports": [{"containerPort": 8080}]}]
    job = kube.get(DEPLOYMENTS, "default", "job")
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["sleep", "10"]
    assert kube.get(SERVICES, "default", "web")["spec"]["ports"] == [
        {"name": "80-8080", "port": 80, "protocol": "TCP", "targetPort": 8080}]

    services = await kubectl("get", "svc", "web")
    assert header(services.stdout) == ["NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)", "AGE"]


async def test_protobuf_is_answered_in_json_and_unreadable_bodies_get_415(kube: LocalApiServer) -> None:
    protobuf = "application/vnd.kubernetes.protobuf"
    async with aiohttp.ClientSession() as session:
        async with session.get(kube.url + "/api/v1/namespaces/default",
                               headers={"Accept": f"{protobuf},application/json"}) as rsp:
            assert rsp.status == 200 and rsp.headers["Content-Type"].startswith("application/json")
            assert (await rsp.json())["metadata"]["name"] == "default"
        # A kind this server does not read from protobuf (a Pod): refused as an apiserver refuses
        # a body it cannot decode, not a server failure.
        pod = b"k8s\x00" + b"\n\x09" + b"\n\x02v1\x12\x03Pod" + b"\x12\x00"
        async with session.post(kube.url + "/api/v1/namespaces/default/pods", data=pod,
                                headers={"Content-Type": protobuf}) as rsp:
            assert rsp.status == 415
            status = await rsp.json()
    assert status["kind"] == "Status" and status["reason"] == "UnsupportedMediaType"
    assert "v1/Pod" in status["message"]
    assert kube.emulator.errors == []


# ---- 5. OpenAPI -------------------------------------------------------------------------------

async def test_apply_validates_through_openapi_and_explain_reads_it(kube: LocalApiServer, kubectl: Kubectl) -> None:
    namespace = await kubectl("create", "-f", "-", input="apiVersion: v1\nkind: Namespace\nmetadata: {name: inference}\n")
    assert namespace.returncode == 0, namespace.stderr
    created = await kubectl("apply", "-f", str(POLICY))  # no --validate=false
    assert created.returncode == 0, created.stderr
    assert "mooncakeleasepolicy.moonlease.io/llama-fleet created" in created.stdout

    unknown = POLICY.read_text().replace("spec:\n", "spec:\n  bogusField: 1\n", 1)
    refused = await kubectl("apply", "-f", "-", input=unknown.replace("llama-fleet", "other-fleet"))
    assert refused.returncode == 1
    assert "unknown field" in refused.stderr and "spec.bogusField" in refused.stderr

    explained = await kubectl("explain", "mlp.spec")
    assert explained.returncode == 0, explained.stderr
    assert "KIND:       MooncakeLeasePolicy" in explained.stdout
    assert "FIELD: spec <Object>" in explained.stdout
    assert "master\t<Object> -required-" in explained.stdout
    deeper = await kubectl("explain", "mlp.spec.rollout")
    assert deeper.returncode == 0 and "FIELD: rollout <Object>" in deeper.stdout, deeper.stderr

    index = await kubectl("get", "--raw", "/openapi/v3")
    assert "apis/moonlease.io/v1alpha1" in json.loads(index.stdout)["paths"]
    v2 = json.loads((await kubectl("get", "--raw", "/openapi/v2")).stdout)
    assert v2["definitions"]["io.moonlease.v1alpha1.MooncakeLeasePolicy"]["x-kubernetes-group-version-kind"] == [
        {"group": "moonlease.io", "version": "v1alpha1", "kind": "MooncakeLeasePolicy"}]


async def test_replace_edit_and_json_patches_validate_and_lock(kube: LocalApiServer, kubectl: Kubectl) -> None:
    await apply_ok(kubectl, deployment_yaml(replicas=2))
    # replace (validation on) of the object as read: accepted, and its resourceVersion is the lock.
    # The emulated Deployment controller writes status and revision after the apply, as a real one
    # does, so the object read may go stale before the replace: read again then, as a client would.
    for _ in range(10):
        current = (await kubectl("get", "deploy", "web", "-o", "yaml")).stdout
        replaced = await kubectl("replace", "-f", "-", input=current.replace("replicas: 2", "replicas: 3", 1))
        if "the object has been modified" not in replaced.stderr:
            break
    assert replaced.returncode == 0 and "deployment.apps/web replaced" in replaced.stdout, replaced.stderr
    stale = await kubectl("replace", "-f", "-", input=current.replace("replicas: 2", "replicas: 4", 1))
    assert stale.returncode == 1
    assert ('Operation cannot be fulfilled on deployments.apps "web": the object has been modified; please apply'
            ' your changes to the latest version and try again') in stale.stderr, stale.stderr
    assert kube.get(DEPLOYMENTS, "default", "web")["spec"]["replicas"] == 3
    # edit: kubectl's editor (a sed here) changes the object; the server validates the result.
    edited = await kubectl("edit", "deploy/web", extra_env={"KUBE_EDITOR": "sed -i 's/^  replicas: 3$/  replicas: 5/'"})
    assert edited.returncode == 0 and "deployment.apps/web edited" in edited.stdout, edited.stderr
    assert kube.get(DEPLOYMENTS, "default", "web")["spec"]["replicas"] == 5
    refused = await kubectl("edit", "deploy/web", extra_env={"KUBE_EDITOR": "sed -i 's/^  replicas: 5$/  replicas: -1/'"})
    # (kubectl writes the server's causes into the file it reopens; stderr names the object.)
    assert refused.returncode == 1 and 'deployments.apps "web" is invalid' in refused.stderr, refused.stderr
    assert any(call.verb == "patch" for call in kube.api_calls()[-2:])  # refused by the server, not kubectl
    assert kube.get(DEPLOYMENTS, "default", "web")["spec"]["replicas"] == 5
    # JSON patches, a failed `test` answered 422 as the API server does.
    patched = await kubectl("patch", "deploy", "web", "--type=json",
                            "-p", '[{"op":"test","path":"/spec/replicas","value":5},'
                                  '{"op":"replace","path":"/spec/replicas","value":1}]')
    assert patched.returncode == 0, patched.stderr
    failed = await kubectl("patch", "deploy", "web", "--type=json",
                           "-p", '[{"op":"test","path":"/spec/replicas","value":5}]')
    assert failed.returncode == 1 and kube.get(DEPLOYMENTS, "default", "web")["spec"]["replicas"] == 1


async def test_built_in_kinds_explain_and_refuse_unknown_fields(kube: LocalApiServer, kubectl: Kubectl) -> None:
    explained = await kubectl("explain", "deployment")
    assert explained.returncode == 0, explained.stderr
    assert "KIND:       Deployment" in explained.stdout and "spec\t<DeploymentSpec>" in explained.stdout
    assert "Deployment enables declarative updates for Pods and ReplicaSets." in explained.stdout
    deeper = await kubectl("explain", "deploy.spec.template.spec.containers.image")
    assert deeper.returncode == 0 and "FIELD: image <string>" in deeper.stdout, deeper.stderr
    assert "Container image name." in deeper.stdout
    surge = await kubectl("explain", "deployment.spec.strategy.rollingUpdate.maxSurge")
    assert "The maximum number of pods that can be scheduled above the desired number" in surge.stdout

    # kubectl apply validates (strict, on the server): a misspelt field of a built-in kind is refused
    # as the API server's decoder refuses it; with validation off it is dropped, not stored.
    typo = deployment_yaml().replace("  replicas: 2\n", "  replicas: 2\n  replicass: 3\n").replace(
        'image: "nginx:1.27"', 'image: "nginx:1.27", imagePolicy: Always')
    refused = await kubectl("apply", "-f", "-", input=typo)
    assert refused.returncode == 1
    assert ('Deployment in version "v1" cannot be handled as a Deployment: strict decoding error: unknown field'
            ' "spec.replicass", unknown field "spec.template.spec.containers[0].imagePolicy"') in refused.stderr, \
        refused.stderr
    assert kube.get(DEPLOYMENTS, "default", "web") is None
    await apply_ok(kubectl, typo, "--validate=false")
    stored = kube.get(DEPLOYMENTS, "default", "web")
    assert "replicass" not in stored["spec"] and "imagePolicy" not in stored["spec"]["template"]["spec"]["containers"][0]


async def test_version_is_one_the_chart_supports(kubectl: Kubectl) -> None:
    version = await kubectl("version", "-o", "json")
    assert version.returncode == 0, version.stderr
    server = json.loads(version.stdout)["serverVersion"]
    assert (int(server["major"]), int(server["minor"])) >= (1, 30)  # the chart's kubeVersion
    assert "version difference" not in version.stderr  # within kubectl 1.32's supported skew


# ---- 6. CEL rules at admission -----------------------------------------------------------------

async def test_every_cel_rule_of_the_crd_refuses_its_violation_with_an_apiserver_message(
        kube: LocalApiServer, kubectl: Kubectl) -> None:
    from tests.unit.test_policy_api import CEL_VIOLATIONS, VALID

    # One kubectl process per rule, a few at a time (each waits mostly on its own start-up and
    # discovery; the server answers them all from its event loop).
    slots = asyncio.Semaphore(4)

    async def apply(index: int, spec: dict) -> subprocess.CompletedProcess[str]:
        policy = {"apiVersion": "moonlease.io/v1alpha1", "kind": "MooncakeLeasePolicy",
                  "metadata": {"name": f"bad-{index}", "namespace": "default"}, "spec": spec}
        async with slots:
            return await kubectl("apply", "-f", "-", input=json.dumps(policy), timeout=60.0)

    answers = await asyncio.gather(*(apply(index, spec) for index, spec in enumerate(CEL_VIOLATIONS.values())))
    for index, (message, refused) in enumerate(zip(CEL_VIOLATIONS, answers, strict=True)):
        assert refused.returncode == 1, (message, refused.stdout)
        # e.g. The MooncakeLeasePolicy "bad-0" is invalid: spec.targets[0]: Invalid value: "object": ...
        assert f'The MooncakeLeasePolicy "bad-{index}" is invalid: spec' in refused.stderr, refused.stderr
        assert f': Invalid value: "object": {message}' in refused.stderr, refused.stderr
        assert refused.stderr.count(message) == 1  # one line per failed rule
        assert "spec.targets[0]: spec.targets" not in refused.stderr and ": spec: spec" not in refused.stderr
    assert kube.list("mlp") == []

    good = {"apiVersion": "moonlease.io/v1alpha1", "kind": "MooncakeLeasePolicy",
            "metadata": {"name": "good", "namespace": "default"}, "spec": VALID}
    await apply_ok(kubectl, json.dumps(good))
    # Ratcheting: a status write does not run the spec's rules again, and still succeeds.
    await kube.patch("mlp", "default", "good", {"status": {"phase": "Pending"}}, subresource="status")
    assert kube.get("mlp", "default", "good")["status"]["phase"] == "Pending"


# ---- 6. the scale subresource, Deployment validation and defaulting ---------------------------

async def test_scale_reads_and_writes_the_scale_subresource(kube: LocalApiServer, kubectl: Kubectl) -> None:
    await apply_ok(kubectl, deployment_yaml(replicas=2))
    scaled = await kubectl("scale", "deploy", "web", "--replicas=4")
    assert scaled.returncode == 0 and "deployment.apps/web scaled" in scaled.stdout, scaled.stderr
    assert kube.get(DEPLOYMENTS, "default", "web")["spec"]["replicas"] == 4
    scale = json.loads((await kubectl("get", "--raw", "/apis/apps/v1/namespaces/default/deployments/web/scale")).stdout)
    assert (scale["kind"], scale["apiVersion"], scale["spec"]) == ("Scale", "autoscaling/v1", {"replicas": 4})
    assert scale["status"]["selector"] == "app=web"
    # --current-replicas is a precondition kubectl checks against the Scale it reads.
    stale = await kubectl("scale", "deploy", "web", "--replicas=1", "--current-replicas=2")
    assert stale.returncode == 1 and "Expected replicas to be 2, was 4" in stale.stderr
    negative = await kubectl("patch", "deploy", "web", "--subresource=scale", "--type=merge",
                             "-p", '{"spec":{"replicas":-2}}')
    assert negative.returncode == 1
    assert 'The Deployment "web" is invalid: spec.replicas: Invalid value: -2: must be greater than or equal to 0' \
        in negative.stderr
    assert kube.get(DEPLOYMENTS, "default", "web")["spec"]["replicas"] == 4


async def test_deployments_are_validated_and_defaulted(kube: LocalApiServer, kubectl: Kubectl) -> None:
    refused = await kubectl("apply", "-f", "-", input=deployment_yaml(replicas=-3))
    assert refused.returncode == 1
    assert ('The Deployment "web" is invalid: spec.replicas: Invalid value: -3: must be greater than or equal to 0'
            in refused.stderr), refused.stderr
    mismatched = deployment_yaml().replace("labels: {app: web}", "labels: {app: other}")
    refused = await kubectl("apply", "-f", "-", input=mismatched)
    assert refused.returncode == 1
    assert "spec.template.metadata.labels: Invalid value" in refused.stderr
    assert "`selector` does not match template `labels`" in refused.stderr
    assert kube.get(DEPLOYMENTS, "default", "web") is None

    await apply_ok(kubectl, deployment_yaml().replace("  replicas: 2\n", ""))
    spec = kube.get(DEPLOYMENTS, "default", "web")["spec"]
    assert spec["replicas"] == 1 and spec["revisionHistoryLimit"] == 10 and spec["progressDeadlineSeconds"] == 600
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"}}


# ---- the project's kubectl plugin --------------------------------------------------------------

async def test_kubectl_moonlease_status_reads_the_policy_through_kubectl(kube: LocalApiServer, kubectl: Kubectl) -> None:
    namespace = await kubectl("create", "-f", "-", input="apiVersion: v1\nkind: Namespace\nmetadata: {name: inference}\n")
    assert namespace.returncode == 0, namespace.stderr
    applied = await kubectl("apply", "-f", str(POLICY))
    assert applied.returncode == 0, applied.stderr
    await kube.patch("mlp", "inference", "llama-fleet", {"status": {"phase": "Pending"}}, subresource="status")
    shown = await kubectl("moonlease", "status", "llama-fleet", "-n", "inference", "-o", "json", plugin=True,
                          timeout=60)
    assert shown.returncode == 1, shown.stderr  # the command's contract: 0 only once Ready
    status = json.loads(shown.stdout)
    assert status["name"] == "llama-fleet" and status["phase"] == "Pending", status


# ---- strategic merge patch, as kubectl sends it -----------------------------------------------

async def test_apply_and_patch_merge_lists_by_key_keep_order_and_drop_directives(
        kube: LocalApiServer, kubectl: Kubectl) -> None:
    def with_env(names: list[str], strategy: str = "") -> str:
        env = ", ".join(f"{{name: {n}, value: v{n}}}" for n in names)
        text = deployment_yaml().replace('image: "nginx:1.27"', f'image: "nginx:1.27", env: [{env}]')
        return text.replace("spec:\n  replicas", f"spec:\n{strategy}  replicas", 1)

    await apply_ok(kubectl, with_env(["A", "B", "C"]))
    # kubectl apply sends a 3-way strategic merge patch: $setElementOrder/env, a delete of B,
    # and $retainKeys for the strategy switched to Recreate (rollingUpdate must go). It builds it
    # from the v3 document, whose PATCH operation lists the strategic merge media type (without
    # it kubectl logs at -v=5 that the v3 path does not support it and falls back to v2).
    changed = await kubectl("apply", "-v=5", "-f", "-", input=with_env(["C", "A", "D"], "  strategy: {type: Recreate}\n"))
    assert changed.returncode == 0, changed.stderr
    assert "OpenAPI V3 path" not in changed.stderr and "error calculating patch" not in changed.stderr
    spec = kube.get(DEPLOYMENTS, "default", "web")["spec"]
    assert [e["name"] for e in spec["template"]["spec"]["containers"][0]["env"]] == ["C", "A", "D"]
    assert spec["strategy"] == {"type": "Recreate"}
    assert "$" not in json.dumps(kube.get(DEPLOYMENTS, "default", "web"))

    service = """apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 8080}, {name: metrics, port: 81, targetPort: 9090}]
"""
    await apply_ok(kubectl, service)
    patched = await kubectl("patch", "svc", "web", "-p", '{"spec":{"ports":[{"port":81,"targetPort":9191}]}}')
    assert patched.returncode == 0, patched.stderr
    ports = kube.get(SERVICES, "default", "web")["spec"]["ports"]
    assert [(p["port"], p["targetPort"]) for p in ports] == [(80, 8080), (81, 9191)]  # merged by port

    await apply_ok(kubectl, "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: held, finalizers: [example.com/a]}\n")
    added = await kubectl("patch", "cm", "held", "-p", '{"metadata":{"finalizers":["example.com/b"]}}')
    assert added.returncode == 0, added.stderr
    assert kube.get(CONFIGMAPS, "default", "held")["metadata"]["finalizers"] == ["example.com/a", "example.com/b"]
    removed = await kubectl("patch", "cm", "held", "-p",
                            '{"metadata":{"$deleteFromPrimitiveList/finalizers":["example.com/a"]}}')
    assert removed.returncode == 0, removed.stderr
    assert kube.get(CONFIGMAPS, "default", "held")["metadata"]["finalizers"] == ["example.com/b"]
