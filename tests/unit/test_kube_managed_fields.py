"""Field managers, server-side apply and the Deployment controller's ReplicaSet bookkeeping of the
local API server: the pure parts (the conformance tier runs kubectl and Helm against them)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from moonlease_dev.testbed.kube.managed_fields import (
    ApplyConflicts,
    apply_config,
    field_set,
    from_fields_v1,
    path_text,
    record_update,
    to_fields_v1,
)
from moonlease_dev.testbed.kube.replicasets import (
    REVISION,
    REVISION_HISTORY,
    next_revision,
    promoted_annotations,
    replicaset_for,
    to_prune,
)

pytestmark = pytest.mark.unit

NOW = "2026-01-02T12:00:00Z"


def deployment(replicas: int = 2, image: str = "nginx:1.27", **labels: str) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "namespace": "default", "uid": "u1", "resourceVersion": "7",
                         **({"labels": labels} if labels else {})},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
                     "template": {"metadata": {"labels": {"app": "web"}},
                                  "spec": {"containers": [{"name": "web", "image": image, "args": ["-a"]}]}}},
            "status": {"replicas": 2}}


def test_field_sets_key_lists_as_the_types_declare_them_and_skip_server_fields() -> None:
    obj = deployment(tier="web")
    obj["metadata"]["finalizers"] = ["example.com/a"]
    paths = field_set(obj)
    assert ("f:spec", "f:replicas") in paths
    container = ("f:spec", "f:template", "f:spec", "f:containers", 'k:{"name":"web"}')
    assert container in paths and (*container, "f:image") in paths
    assert (*container, "f:args") in paths  # an atomic list is one leaf
    assert ("f:metadata", "f:finalizers", 'v:"example.com/a"') in paths
    assert not any(p[0] == "f:status" or p[:2] in {("f:metadata", "f:name"), ("f:metadata", "f:uid")} for p in paths)
    assert field_set(obj, subresource="status") == {("f:status", "f:replicas")}
    # A CRD's schema decides: x-kubernetes-list-type map with its keys, else atomic.
    schema = {"type": "object", "properties": {"spec": {"type": "object", "properties": {
        "targets": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                    "items": {"type": "object"}},
        "stages": {"type": "array", "items": {"type": "string"}}}}}}
    custom = {"spec": {"targets": [{"name": "a", "role": "decode"}], "stages": ["master"]}}
    assert field_set(custom, schema) == {("f:spec", "f:targets", 'k:{"name":"a"}'),
                                         ("f:spec", "f:targets", 'k:{"name":"a"}', "f:name"),
                                         ("f:spec", "f:targets", 'k:{"name":"a"}', "f:role"),
                                         ("f:spec", "f:stages")}


def test_fields_v1_round_trips_and_paths_print_as_the_api_server_prints_them() -> None:
    paths = field_set(deployment(tier="web"))
    tree = to_fields_v1(paths)
    assert tree["f:spec"]["f:template"]["f:spec"]["f:containers"]['k:{"name":"web"}']["."] == {}
    assert from_fields_v1(json.loads(json.dumps(tree))) == paths
    assert path_text(("f:spec", "f:containers", 'k:{"name":"web"}', "f:image")) == '.spec.containers[name="web"].image'
    assert path_text(("f:metadata", "f:finalizers", 'v:"a"')) == '.metadata.finalizers[="a"]'


def test_an_update_takes_the_fields_it_changed_from_every_other_manager() -> None:
    old = deployment()
    entries = record_update([], "creator", None, old, schema=None, api_version="apps/v1", now=NOW)
    assert [e["manager"] for e in entries] == ["creator"]
    new = copy.deepcopy(old)
    new["spec"]["replicas"] = 5
    new["metadata"]["labels"] = {"stage": "canary"}
    entries = record_update(entries, "scaler", old, new, schema=None, api_version="apps/v1", now=NOW)
    owned = {e["manager"]: from_fields_v1(e["fieldsV1"]) for e in entries}
    assert owned["scaler"] == {("f:spec", "f:replicas"), ("f:metadata", "f:labels", "f:stage")}
    assert ("f:spec", "f:replicas") not in owned["creator"]
    # Removing a field takes it from its manager; a manager left with nothing is dropped.
    gone = copy.deepcopy(new)
    del gone["metadata"]["labels"]
    gone["spec"]["replicas"] = 2
    entries = record_update(entries, "creator", new, gone, schema=None, api_version="apps/v1", now=NOW)
    assert [e["manager"] for e in entries] == ["creator"]
    # The status subresource's writer owns status only, under its own entry.
    status = copy.deepcopy(gone)
    status["status"] = {"replicas": 3}
    entries = record_update(entries, "controller", gone, status, schema=None, api_version="apps/v1", now=NOW,
                            subresource="status")
    assert entries[-1]["subresource"] == "status" and entries[-1]["fieldsV1"] == {"f:status": {"f:replicas": {}}}


def applied(replicas: int | None = 2, image: str = "nginx:1.27", **labels: str) -> dict[str, Any]:
    config = deployment(replicas or 0, image, **labels)
    for key in ("uid", "resourceVersion"):
        del config["metadata"][key]
    del config["status"]
    if replicas is None:
        del config["spec"]["replicas"]
    return config


def test_apply_conflicts_on_different_values_shares_same_ones_and_force_moves_ownership() -> None:
    live, entries = apply_config([], "alice", None, applied(2, tier="web"), schema=None, api_version="apps/v1",
                                 now=NOW)
    with pytest.raises(ApplyConflicts) as raised:
        apply_config(entries, "bob", live, applied(3, tier="db"), schema=None, api_version="apps/v1", now=NOW)
    assert raised.value.message == ('Apply failed with 2 conflicts: conflicts with "alice":\n'
                                    '- .metadata.labels.tier\n- .spec.replicas')
    assert [c["field"] for c in raised.value.causes()] == [".metadata.labels.tier", ".spec.replicas"]
    shared, entries = apply_config(entries, "bob", live, applied(2, tier="web"), schema=None,
                                   api_version="apps/v1", now=NOW)
    owners = {e["manager"] for e in entries if ("f:spec", "f:replicas") in from_fields_v1(e["fieldsV1"])}
    assert owners == {"alice", "bob"}
    forced, entries = apply_config(entries, "carol", shared, applied(4), schema=None, api_version="apps/v1",
                                   now=NOW, force=True)
    assert forced["spec"]["replicas"] == 4
    owners = {e["manager"] for e in entries if ("f:spec", "f:replicas") in from_fields_v1(e["fieldsV1"])}
    assert owners == {"carol"}
    # An Update manager is named with its API version.
    updated = record_update(entries, "kubectl-edit", forced, {**forced, "spec": {**forced["spec"], "replicas": 9}},
                            schema=None, api_version="apps/v1", now=NOW)
    with pytest.raises(ApplyConflicts, match='conflict with "kubectl-edit" using apps/v1: .spec.replicas'):
        apply_config(updated, "carol", {**forced, "spec": {**forced["spec"], "replicas": 9}}, applied(4),
                     schema=None, api_version="apps/v1", now=NOW)


def test_apply_merges_by_key_and_removes_what_the_manager_stopped_applying() -> None:
    live, entries = apply_config([], "alice", None, applied(2, tier="web", team="a"), schema=None,
                                 api_version="apps/v1", now=NOW)
    live, entries = apply_config(entries, "bob", live, {**applied(None, tier="web"), "spec": {"template": {"spec": {
        "containers": [{"name": "sidecar", "image": "busybox"}]}}}}, schema=None, api_version="apps/v1", now=NOW)
    assert [c["name"] for c in live["spec"]["template"]["spec"]["containers"]] == ["web", "sidecar"]
    # alice drops `team` (hers alone: removed) and `tier` (bob's too: kept), and the replicas.
    live, entries = apply_config(entries, "alice", live, applied(None), schema=None, api_version="apps/v1", now=NOW)
    assert live["metadata"]["labels"] == {"tier": "web"}
    assert "replicas" not in live["spec"]
    assert [c["name"] for c in live["spec"]["template"]["spec"]["containers"]] == ["web", "sidecar"]


def test_kubectl_takes_over_its_client_side_applied_fields_without_a_conflict() -> None:
    last = applied(2)
    live = {**deployment(2), "metadata": {**deployment(2)["metadata"], "annotations": {
        "kubectl.kubernetes.io/last-applied-configuration": json.dumps(last)}}}
    entries = record_update([], "kubectl-client-side-apply", None, live, schema=None, api_version="apps/v1", now=NOW)
    merged, entries = apply_config(entries, "kubectl", live, applied(3), schema=None, api_version="apps/v1", now=NOW)
    assert merged["spec"]["replicas"] == 3
    with pytest.raises(ApplyConflicts):  # another manager name gets the conflict
        apply_config(entries, "bob", merged, applied(4), schema=None, api_version="apps/v1", now=NOW)


def test_replicasets_number_templates_and_promote_one_that_comes_back() -> None:
    dep = deployment(4)
    dep["metadata"]["annotations"] = {"kubernetes.io/change-cause": "bump", REVISION: "1",
                                      "kubectl.kubernetes.io/last-applied-configuration": "{}"}
    first = replicaset_for(dep, dep["spec"]["template"], "abc", 1)
    assert first["metadata"]["name"] == "web-abc"
    assert first["spec"]["selector"]["matchLabels"] == {"app": "web", "pod-template-hash": "abc"}
    assert first["spec"]["template"]["metadata"]["labels"]["pod-template-hash"] == "abc"
    assert first["metadata"]["annotations"] == {"kubernetes.io/change-cause": "bump", REVISION: "1",
                                                "deployment.kubernetes.io/desired-replicas": "4",
                                                "deployment.kubernetes.io/max-replicas": "5"}
    second = replicaset_for(dep, dep["spec"]["template"], "def", next_revision([first]))
    assert second["metadata"]["annotations"][REVISION] == "2"
    promoted = promoted_annotations(first, dep, next_revision([first, second]))
    assert (promoted[REVISION], promoted[REVISION_HISTORY]) == ("3", "1")
    first["metadata"]["annotations"] = promoted
    assert promoted_annotations(first, dep, 5)[REVISION_HISTORY] == "1,3"


def test_old_replicasets_past_the_limit_are_pruned_oldest_first() -> None:
    dep = deployment()
    sets = [replicaset_for(dep, dep["spec"]["template"], f"h{n}", n) for n in range(1, 5)]
    sets[1]["spec"]["replicas"] = 1  # still scaled up: never pruned
    assert to_prune(sets, "h4", 1) == ["web-h1"]
    assert to_prune(sets, "h4", 0) == ["web-h1", "web-h3"]
    assert to_prune(sets, "h4", 10) == []
