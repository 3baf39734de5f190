"""The watch caches' pure helpers (issue 16): what a cached object keeps, which of two
versions is older, which objects a label-selected cache takes from our own writes."""

from __future__ import annotations

import pytest

from moonlease_operator.adapters.watch_cache import LAST_APPLIED, _matches, is_older, collection_path, trim_object

pytestmark = pytest.mark.unit


def test_trim_drops_bookkeeping_and_keeps_what_the_planner_reads() -> None:
    raw = {"metadata": {"name": "d", "resourceVersion": "7", "managedFields": [{"manager": "kubectl"}],
                        "annotations": {LAST_APPLIED: "{...}", "moonlease.io/original": "{}"}},
           "spec": {"replicas": 2}}
    obj = trim_object(raw, "Deployment")
    assert obj == {"kind": "Deployment", "spec": {"replicas": 2},
                   "metadata": {"name": "d", "resourceVersion": "7", "annotations": {"moonlease.io/original": "{}"},
                                "managedFields": [{"manager": "kubectl", "fieldsV1": {}}]}}
    assert "managedFields" in raw["metadata"]  # the caller's object is left alone


def test_versions_and_selectors() -> None:
    def at(version: str, **labels: str) -> dict:
        return {"metadata": {"resourceVersion": version, "labels": labels}}

    assert is_older(at("9"), at("10")) and not is_older(at("10"), at("9")) and not is_older(at("9"), None)
    assert not is_older(at("abc"), at("10"))  # opaque versions: never taken as older
    assert _matches(at("1", **{"moonlease.io/policy": "p"}), "moonlease.io/policy")
    assert _matches(at("1", a="true"), "a=true") and not _matches(at("1", a="false"), "a=true")
    assert not _matches(at("1"), "moonlease.io/policy") and _matches(at("1"), None)
    assert collection_path("Deployment", None) == "/apis/apps/v1/deployments"
    assert collection_path("ConfigMap", "ns") == "/api/v1/namespaces/ns/configmaps"
