"""The pods of one reconcile, indexed (issue 16): a workload's pods found through the index are
exactly those a scan of every pod finds, so health and verification do not change."""

from __future__ import annotations

import random

import pytest

from moonlease_operator.core.health import current_ready_pods, evaluate_health
from moonlease_operator.core.pod_set import PodSet
from moonlease_operator.core.slots import CONFIG_HASH_ANNOTATION
from tests.unit.test_label_index import SELECTORS, random_labels

pytestmark = pytest.mark.unit


def pod(name: str, namespace: str | None, labels: dict[str, str], *, ready: bool = True,
        deleting: bool = False) -> dict:
    meta: dict = {"name": name, "labels": labels, "annotations": {CONFIG_HASH_ANNOTATION: "h1"}}
    if namespace is not None:
        meta["namespace"] = namespace
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_selected_pods_equal_a_scan_in_the_given_order() -> None:
    rng = random.Random(16)
    pods = [pod(f"p{i}", rng.choice(["a", "b", None]), random_labels(rng)) for i in range(300)]
    indexed = PodSet(pods)
    assert list(indexed) == pods and len(indexed) == 300
    for selector in SELECTORS:
        for namespace in ("a", "b", "c"):
            scanned = [p for p in pods if p["metadata"].get("namespace", namespace) == namespace
                       and selector.matches(p["metadata"]["labels"])]
            assert indexed.selected(namespace, selector) == scanned


def test_health_and_ready_pods_are_the_same_through_the_index() -> None:
    rng = random.Random(7)
    pods = [pod(f"p{i}", "a", random_labels(rng), ready=rng.random() < 0.8, deleting=rng.random() < 0.1)
            for i in range(200)]
    for selector in SELECTORS:
        if not selector.match_labels:
            continue
        obj = {"kind": "Deployment", "metadata": {"name": "w", "namespace": "a", "generation": 1},
               "spec": {"replicas": 3, "selector": {"matchLabels": selector.match_labels},
                        "template": {"metadata": {"annotations": {CONFIG_HASH_ANNOTATION: "h1"}}}},
               "status": {"observedGeneration": 1, "replicas": 3, "updatedReplicas": 3, "readyReplicas": 3,
                          "availableReplicas": 3}}
        assert evaluate_health(obj, PodSet(pods)) == evaluate_health(obj, pods)
        assert current_ready_pods(obj, PodSet(pods)) == current_ready_pods(obj, pods)


def test_a_cache_index_is_used_only_while_it_agrees_with_the_pods_read() -> None:
    from moonlease_operator.api import LabelSelector
    from moonlease_operator.core.label_index import LabelIndex

    pods = [pod("p0", "a", {"app": "web"}), pod("p1", "a", {"app": "db"})]
    cache = LabelIndex()
    for p in pods:
        cache.put(p["metadata"]["name"], p["metadata"]["labels"])
    web = LabelSelector(match_labels={"app": "web"})
    assert PodSet(pods, cache).selected("a", web) == [pods[0]]
    # The cache moved on after the pods were read (p1 relabelled, p2 added): the answer is
    # still the one the pods read give.
    cache.put("p1", {"app": "web"})
    cache.put("p2", {"app": "web"})
    assert PodSet(pods, cache).selected("a", web) == [pods[0]]
    cache.put("p0", {"app": "db"})
    assert PodSet(pods, cache).selected("a", web) == [pods[0]]
