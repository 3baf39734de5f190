"""Table responses, OpenAPI documents, protobuf bodies, workload admission and strategic merge
patches of the local API server: the pure parts (the conformance tier runs kubectl against them)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from moonlease_dev.testbed.kube.openapi import definition_name, openapi_v3, openapi_v3_index
from moonlease_dev.testbed.kube.patches import strategic_merge_patch
from moonlease_dev.testbed.kube.protobuf import UnreadableBody, decode_object
from moonlease_dev.testbed.kube.resources import DEPLOYMENTS, ResourceType
from moonlease_dev.testbed.kube.tables import columns_for, human_duration, json_path, table, wants_table
from moonlease_dev.testbed.kube.workloads import default_workload, scale_view, scaled, workload_errors

pytestmark = pytest.mark.unit

NOW = datetime.datetime(2026, 1, 2, 12, 0, 0, tzinfo=datetime.UTC)


@pytest.mark.parametrize(("seconds", "shown"), [
    (-5, "<invalid>"), (-1, "0s"), (0, "0s"), (119, "119s"), (120, "2m"), (150, "2m30s"), (600, "10m"),
    (179 * 60, "179m"), (3 * 3600, "3h"), (3 * 3600 + 60, "3h1m"), (8 * 3600, "8h"), (47 * 3600, "47h"),
    (48 * 3600, "2d"), (50 * 3600, "2d2h"), (8 * 86400, "8d"), (800 * 86400, "2y70d"), (9 * 365 * 86400, "9y"),
])
def test_ages_read_as_kubectl_prints_them(seconds: int, shown: str) -> None:
    assert human_duration(seconds) == shown


@pytest.mark.parametrize(("accept", "table_wanted"), [
    ("application/json;as=Table;v=v1;g=meta.k8s.io,application/json", True),
    ("application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json", False),  # v1beta1: not served
    ("application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json;as=Table;v=v1;g=meta.k8s.io", True),
    ("application/vnd.kubernetes.protobuf;as=Table;v=v1;g=meta.k8s.io,application/json", False),
    ("application/json, */*", False), ("", False), (None, False),
])
def test_a_table_is_sent_only_when_it_is_the_first_acceptable_answer(accept: str | None, table_wanted: bool) -> None:
    assert wants_table(accept) is table_wanted


def test_printer_column_paths() -> None:
    obj = {"status": {"conditions": [{"type": "Synced", "status": "False"}, {"type": "Ready", "status": "True"}],
                      "list": [1, 2]}}
    assert json_path(obj, '.status.conditions[?(@.type=="Ready")].status') == ["True"]
    assert json_path(obj, ".status.list[1]") == [2]
    assert json_path(obj, ".status.missing.deeper") == []
    assert json_path(obj, "{.status.list[0]}") == [1]
    with pytest.raises(ValueError, match="unsupported JSONPath"):
        json_path(obj, ".status.list[*]")


def test_a_crds_columns_come_after_the_name_with_dates_as_ages() -> None:
    columns = columns_for("example.com", "Widget", [
        {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {"name": "Debug", "type": "string", "jsonPath": ".status.debug", "priority": 1}])
    shown = table(columns, [{"metadata": {"name": "w", "creationTimestamp": "2026-01-02T11:55:00Z"},
                             "spec": {"size": 3}}], list_meta={"resourceVersion": "7"}, now=NOW)
    assert [c["name"] for c in shown["columnDefinitions"]] == ["Name", "Size", "Age", "Debug"]
    assert shown["columnDefinitions"][3]["priority"] == 1
    assert shown["rows"][0]["cells"] == ["w", 3, "5m", None]
    assert shown["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
    assert shown["metadata"] == {"resourceVersion": "7"}
    assert [c.name for c in columns_for("example.com", "Widget", [])] == ["Name", "Age"]
    assert [c.name for c in columns_for("example.com", "Other", None)] == ["Name", "Age"]


def test_deployment_rows() -> None:
    deploy = {"metadata": {"name": "web", "creationTimestamp": "2026-01-02T09:00:00Z"},
              "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "web"}},
                       "template": {"spec": {"containers": [{"name": "a", "image": "x:1"}, {"name": "b", "image": "y"}]}}},
              "status": {"readyReplicas": 2, "updatedReplicas": 3, "availableReplicas": 2}}
    shown = table(columns_for("apps", "Deployment", None), [deploy], list_meta={}, include_object="None", now=NOW)
    assert shown["rows"] == [{"cells": ["web", "2/3", 3, 2, "3h", "a,b", "x:1,y", "app=web"]}]


def test_openapi_v3_tags_every_kind_and_write_operation() -> None:
    widget = ResourceType("example.com", "v1", "widgets", "Widget", True, custom=True)
    documents = openapi_v3([(DEPLOYMENTS, None), (widget, {"type": "object", "properties": {"spec": {"type": "object"}}})])
    assert set(documents) == {"apis/apps/v1", "apis/example.com/v1"}
    assert definition_name(widget) == "com.example.v1.Widget"
    schema = documents["apis/example.com/v1"]["components"]["schemas"]["com.example.v1.Widget"]
    assert set(schema["properties"]) == {"apiVersion", "kind", "metadata", "spec"}
    patch = documents["apis/apps/v1"]["paths"]["/apis/apps/v1/namespaces/{namespace}/deployments/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {"group": "apps", "version": "v1", "kind": "Deployment"}
    assert "fieldValidation" in [p["name"] for p in patch["parameters"]]
    # The bodies each PATCH accepts (kubectl apply chooses strategic merge from them): custom
    # kinds take no strategic merge patch, as the server refuses it for them.
    assert "application/strategic-merge-patch+json" in patch["requestBody"]["content"]
    custom = documents["apis/example.com/v1"]["paths"]["/apis/example.com/v1/namespaces/{namespace}/widgets/{name}"]
    assert set(custom["patch"]["requestBody"]["content"]) == {
        "application/apply-patch+yaml", "application/json-patch+json", "application/merge-patch+json"}
    assert "requestBody" not in custom["delete"] and set(custom["put"]["requestBody"]["content"]) == {"*/*"}
    assert "io.k8s.apimachinery.pkg.apis.meta.v1.Patch" in documents["apis/example.com/v1"]["components"]["schemas"]
    index = openapi_v3_index(documents)["paths"]
    assert index["apis/apps/v1"]["serverRelativeURL"].startswith("/openapi/v3/apis/apps/v1?hash=")


def _field(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload


def test_protobuf_bodies_decode_to_json_and_refuse_what_they_cannot_read() -> None:
    meta = _field(1, b"cm") + _field(2, b"") + bytes([7 << 3, 0])  # name, empty generateName, generation 0
    entry = _field(2, _field(1, b"k") + _field(2, b"v"))
    body = b"k8s\x00" + _field(1, _field(1, b"v1") + _field(2, b"ConfigMap")) + _field(2, _field(1, meta) + entry)
    assert decode_object(body) == {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"},
                                   "data": {"k": "v"}}
    unknown_field = b"k8s\x00" + _field(1, _field(1, b"v1") + _field(2, b"ConfigMap")) + _field(2, _field(9, b"x"))
    with pytest.raises(UnreadableBody, match="field 9"):
        decode_object(unknown_field)
    with pytest.raises(UnreadableBody, match="prefix"):
        decode_object(b'{"kind": "ConfigMap"}')


# ---- workloads and strategic merge patch ------------------------------------------------------

def _deployment(**spec: Any) -> dict[str, Any]:
    base = {"selector": {"matchLabels": {"app": "w"}},
            "template": {"metadata": {"labels": {"app": "w", "tier": "x"}},
                         "spec": {"containers": [{"name": "c", "image": "i"}]}}}
    return {"kind": "Deployment", "metadata": {"name": "w"}, "spec": {**base, **spec}}


def test_workloads_are_defaulted_and_validated_as_apps_v1() -> None:
    defaulted = default_workload(_deployment())
    assert defaulted["spec"]["replicas"] == 1 and defaulted["spec"]["strategy"]["rollingUpdate"] == {
        "maxUnavailable": "25%", "maxSurge": "25%"}
    assert default_workload(_deployment(strategy={"type": "Recreate"}))["spec"]["strategy"] == {"type": "Recreate"}
    sts = default_workload({"kind": "StatefulSet", "spec": {}})["spec"]
    assert sts["podManagementPolicy"] == "OrderedReady" and sts["updateStrategy"]["rollingUpdate"] == {"partition": 0}
    assert workload_errors(default_workload(_deployment())) == []
    expressions = _deployment(selector={"matchExpressions": [{"key": "tier", "operator": "In", "values": ["x", "y"]}]})
    assert workload_errors(default_workload(expressions)) == []
    lines = [e.message for e in workload_errors(_deployment(replicas=-1, selector={"matchLabels": {"app": "v"}}))]
    assert lines == ["spec.replicas: Invalid value: -1: must be greater than or equal to 0",
                     'spec.template.metadata.labels: Invalid value: {"app": "w", "tier": "x"}: `selector` does not'
                     ' match template `labels`']
    no_image = _deployment(replicas=1)
    no_image["spec"]["template"]["spec"]["containers"] = [{"name": "c"}]
    assert [e.message for e in workload_errors(no_image)] == ["spec.template.spec.containers[0].image: Required value"]


def test_the_scale_view_and_a_scale_write() -> None:
    deploy = default_workload(_deployment(replicas=3))
    deploy["metadata"]["resourceVersion"] = "9"
    view = scale_view(deploy)
    assert view["spec"] == {"replicas": 3} and view["status"] == {"replicas": 0, "selector": "app=w"}
    assert view["metadata"] == {"name": "w", "resourceVersion": "9"}
    assert scaled(deploy, {"spec": {"replicas": 5}, "status": {"replicas": 99}})["spec"]["replicas"] == 5


def test_strategic_merge_patch_directives() -> None:
    current = {"metadata": {"finalizers": ["a"], "labels": {"x": "1"}},
               "spec": {"ports": [{"port": 80, "name": "http"}, {"port": 81, "name": "m"}],
                        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1}},
                        "containers": [{"name": "a"}, {"name": "b"}, {"name": "c"}]}}
    patch = {"metadata": {"finalizers": ["b", "a"], "labels": {"$patch": "delete"}},
             "spec": {"ports": [{"port": 81, "name": "metrics"}],
                      "strategy": {"$retainKeys": ["type"], "type": "Recreate"},
                      "$setElementOrder/containers": [{"name": "c"}, {"name": "a"}],
                      "containers": [{"name": "b", "$patch": "delete"}]}}
    assert strategic_merge_patch(current, patch) == {
        "metadata": {"finalizers": ["a", "b"]},
        "spec": {"ports": [{"port": 80, "name": "http"}, {"port": 81, "name": "metrics"}],
                 "strategy": {"type": "Recreate"}, "containers": [{"name": "c"}, {"name": "a"}]}}
    removed = strategic_merge_patch(current, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]}})
    assert removed["metadata"]["finalizers"] == []
    replaced = strategic_merge_patch(current, {"spec": {"$patch": "replace", "new": {"$patch": "x", "k": 1}}})
    assert replaced["spec"] == {"new": {"k": 1}}


def test_built_in_kinds_publish_the_kubernetes_definitions_and_prune_unknown_fields() -> None:
    from moonlease_dev.testbed.kube.openapi import builtin_schemas, prune_builtin

    schemas = builtin_schemas("io.k8s.api.apps.v1.Deployment", "#/components/schemas/")
    deployment = schemas["io.k8s.api.apps.v1.Deployment"]
    assert deployment["x-kubernetes-group-version-kind"] == [{"group": "apps", "kind": "Deployment", "version": "v1"}]
    assert deployment["properties"]["apiVersion"] == {"type": "string", "description": deployment["properties"][
        "apiVersion"]["description"]}  # one type, no enum
    assert deployment["properties"]["spec"]["allOf"] == [{"$ref": "#/components/schemas/io.k8s.api.apps.v1.DeploymentSpec"}]
    containers = schemas["io.k8s.api.core.v1.PodSpec"]["properties"]["containers"]
    assert (containers["x-kubernetes-list-type"], containers["x-kubernetes-list-map-keys"]) == ("map", ["name"])
    assert schemas["io.k8s.apimachinery.pkg.util.intstr.IntOrString"]["format"] == "int-or-string"
    assert "io.k8s.api.core.v1.Container" in schemas and "io.k8s.api.core.v1.Service" not in schemas

    obj = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "w", "labels": {"any": "key"}},
           "spec": {"replicass": 1, "template": {"spec": {"containers": [{"name": "c", "imagePolicy": "x"}]}}}}
    pruned, dropped = prune_builtin(obj, "io.k8s.api.apps.v1.Deployment")
    assert dropped == ["spec.replicass", "spec.template.spec.containers[0].imagePolicy"]
    assert pruned["spec"] == {"template": {"spec": {"containers": [{"name": "c"}]}}}
    assert pruned["metadata"]["labels"] == {"any": "key"}  # a map's keys are data, not fields
