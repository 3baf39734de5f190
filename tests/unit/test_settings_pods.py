"""One rule for the pods settings verification waits for and the pods it contacts
(`core.connector_delivery.settings_pods`): a Ready pod of the current template that mounts the
settings volume must report and is contacted; one that does not mount it (a webhook dropped it)
is reported at once with the fix, never waited for; old-template, unready and deleting pods are
neither."""

from __future__ import annotations

import copy

import pytest
from moonlease_operator.api import StageName
from moonlease_operator.core.connector_delivery import (
    SETTINGS_VOLUME,
    pods_to_contact,
    settings_pods,
    unmounted_pod_problem,
)
from moonlease_operator.core.pod_set import PodSet
from moonlease_operator.core.slots import CONFIG_HASH_ANNOTATION

from tests.unit.test_rollout_plan import SPEC, rolled_to, template

pytestmark = pytest.mark.unit


def pod(name: str, app: str, *, mounted: bool = True, ready: bool = True, template: str = "h1",
        deleting: bool = False) -> dict:
    meta: dict = {"name": name, "namespace": "ns", "labels": {"app": app},
                  "annotations": {CONFIG_HASH_ANNOTATION: template}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"volumes": [{"name": SETTINGS_VOLUME}] if mounted else []},
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def workload(app: str, *, adopted: bool = True) -> dict:
    volumes = [{"name": SETTINGS_VOLUME, "configMap": {"name": f"{app}-moonlease"}}] if adopted else []
    return {"kind": "Deployment", "metadata": {"name": app, "namespace": "ns"},
            "spec": {"selector": {"matchLabels": {"app": app}},
                     "template": {"metadata": {"annotations": {CONFIG_HASH_ANNOTATION: "h1"}},
                                  "spec": {"volumes": volumes}}}}


PODS = [pod("a-1", "a"), pod("a-2", "a", mounted=False), pod("a-3", "a", ready=False), pod("a-4", "a", template="h0"),
        pod("a-5", "a", deleting=True), pod("b-1", "b"), pod("c-1", "c")]


@pytest.mark.parametrize("pods", [PODS, PodSet(PODS)], ids=["list", "indexed"])
def test_who_must_report_who_is_contacted_and_who_is_reported_at_once(pods: object) -> None:
    chosen = settings_pods(workload("a"), pods)  # type: ignore[arg-type]
    assert [p["metadata"]["name"] for p in chosen.report] == ["a-1"]
    assert [p["metadata"]["name"] for p in chosen.unmounted] == ["a-2"]
    # Contacted: exactly the pods that must report, of every adopted workload, once each
    contacted = pods_to_contact([workload("a"), workload("b"), workload("a"), workload("c", adopted=False)], pods)  # type: ignore[arg-type]
    assert [p["metadata"]["name"] for p in contacted] == ["a-1", "b-1"]


def test_a_workload_that_reads_no_file_has_no_pod_to_verify() -> None:
    chosen = settings_pods(workload("c", adopted=False), PODS)
    assert chosen.report == () and chosen.unmounted == ()


def test_the_unmounted_pod_is_named_with_the_fix() -> None:
    message = unmounted_pod_problem(pod("a-2", "a", mounted=False))
    assert "pod a-2" in message and SETTINGS_VOLUME in message and "kubectl delete pod a-2" in message


def test_a_ready_pod_without_the_volume_fails_its_stage_at_once_with_the_fix() -> None:
    """It used to be neither contacted nor reported: the stage waited for it until the timeout."""
    cluster = rolled_to("prefill")
    spec = copy.deepcopy(template(cluster, "prefill")["spec"])
    spec["volumes"] = [v for v in spec.get("volumes") or [] if v.get("name") != SETTINGS_VOLUME]
    cluster.pod_specs["prefill"] = spec  # a webhook dropped the volume from the pods
    cluster.settle("prefill")
    cluster.reconcile(SPEC)  # at once: the clock has not moved
    prefill = cluster.status.stage(StageName.PREFILL)
    assert prefill is not None and prefill.phase.value in ("Failed", "RollingBack", "RolledBack")
    assert "pod prefill-0: runs without the settings volume" in prefill.message
    assert "kubectl delete pod prefill-0" in prefill.message
