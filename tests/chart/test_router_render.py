"""The opt-in prefill/decode router (`router.enabled`): one vllm-router Deployment and Service
per arm, pointed at that arm's prefill and decode Services; nothing without the value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from tests.chart.rendering import (
    NAMESPACE,
    container,
    find,
    kubernetes_validate_strict,
    one,
    render,
    render_objects,
    values_sets,
)

pytestmark = pytest.mark.chart

ROUTER = {"router": {"enabled": True, "image": {"repository": "example.org/vllm-router"}},
          "vllm": {"prefill": {"kvRole": "kv_producer"}, "decode": {"kvRole": "kv_consumer"}}}


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def _routers(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in find(objects, "Deployment")
            if o["metadata"]["labels"].get("app.kubernetes.io/component") == "router"}


def _flags(deployment: dict[str, Any], name: str) -> list[str]:
    args = container(deployment, "router")["args"]
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    values += [args[i + 1] for i, a in enumerate(args) if a == f"--{name}"]
    return values


def test_no_router_unless_asked(chart: helm.Chart) -> None:
    assert _routers(render_objects(chart)) == {}


def test_router_routes_each_request_through_the_arms_prefill_then_decode(chart: helm.Chart) -> None:
    objects = render_objects(chart, ROUTER)
    deployment = one(objects, "Deployment", "moonlease-router")
    assert set(_routers(objects)) == {"moonlease-router"}
    main = container(deployment, "router")
    assert main["image"] == "example.org/vllm-router:0.1.17"
    assert main["command"] == ["vllm-router"] and "--vllm-pd-disaggregation" in main["args"]
    assert _flags(deployment, "prefill") == [f"http://moonlease-prefill.{NAMESPACE}.svc:8000"]
    assert _flags(deployment, "decode") == [f"http://moonlease-decode.{NAMESPACE}.svc:8000"]
    assert _flags(deployment, "policy") == ["round_robin"] and _flags(deployment, "decode-policy") == []
    # The Services the router names exist and select the engines of that role.
    for role in ("prefill", "decode"):
        service = one(objects, "Service", f"moonlease-{role}")
        assert service["spec"]["ports"][0]["port"] == 8000
    router_service = one(objects, "Service", "moonlease-router")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert router_service["spec"]["selector"].items() <= labels.items()
    assert "moonlease.io/role" not in labels  # not an engine: the operator's targets stay the engines
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert main["readinessProbe"]["httpGet"]["path"] == "/health"
    assert main["startupProbe"]["failureThreshold"] * main["startupProbe"]["periodSeconds"] >= 1800
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "29000" and _flags(deployment, "prometheus-port") == ["29000"]


def test_one_router_per_arm_each_on_its_own_engines(chart: helm.Chart) -> None:
    objects = render_objects(chart, _merged(values_sets()["ab"], {**ROUTER, "router": {
        **ROUTER["router"], "policy": "consistent_hash", "decodePolicy": "power_of_two",
        "extraArgs": ["--request-timeout-secs=600"]}}))
    routers = _routers(objects)
    assert set(routers) == {"moonlease-router-control", "moonlease-router-treatment"}
    for arm in ("control", "treatment"):
        deployment = routers[f"moonlease-router-{arm}"]
        assert _flags(deployment, "prefill") == [f"http://moonlease-prefill-{arm}.{NAMESPACE}.svc:8000"]
        assert _flags(deployment, "decode") == [f"http://moonlease-decode-{arm}.{NAMESPACE}.svc:8000"]
        assert _flags(deployment, "policy") == ["consistent_hash"]
        assert _flags(deployment, "decode-policy") == ["power_of_two"]
        assert container(deployment, "router")["args"][-1] == "--request-timeout-secs=600"
        assert deployment["spec"]["template"]["metadata"]["labels"]["moonlease.io/arm"] == arm


@pytest.mark.parametrize(("values", "message"), [
    ({"router": {"enabled": True}}, "router.image.repository is required"),
    ({"router": {"enabled": True, "image": {"repository": "r"}}, "vllm": {"enabled": False}},
     "needs vllm.enabled"),
    ({"router": {"enabled": True, "image": {"repository": "r"}, "policy": "fastest"}}, "policy"),
])
def test_bad_router_values_fail_with_what_to_change(chart: helm.Chart, values: dict[str, Any],
                                                    message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render_objects(chart, values)


def test_router_manifests_pass_kubernetes_validate_strict(chart: helm.Chart, tmp_path: Path) -> None:
    objects = [o for o in render_objects(chart, ROUTER)
               if o["metadata"]["labels"].get("app.kubernetes.io/component") == "router"]
    assert {o["kind"] for o in objects} == {"Deployment", "Service"}
    kubernetes_validate_strict(objects, tmp_path / "router.yaml")


def test_notes_send_the_first_request_through_the_router_when_there_is_one(chart: helm.Chart) -> None:
    with_router = render(chart, _merged(values_sets()["ab"], ROUTER))["moonlease/templates/NOTES.txt"]
    assert "moonlease-router-control  (port 8000, arm control)" in with_router
    assert "moonlease-router-treatment  (port 8000, arm treatment)" in with_router
    assert f"kubectl -n {NAMESPACE} port-forward svc/moonlease-router-control 8000" in with_router
    assert "each engine serves alone" not in with_router
    alone = render(chart)["moonlease/templates/NOTES.txt"]
    assert "router.enabled=true" in alone and "each engine serves alone" in alone
    assert "port-forward svc/moonlease-decode 8000" in alone and "svc/moonlease-router" not in alone


EVICT = {"vllm": {"connector": {"retention": {"evict": True}}},
         "mooncake": {"master": {"settings": {"eviction_high_watermark_ratio": 0.85}}}}


@pytest.mark.parametrize(("replicas", "warned"), [((1, 0), False), ((1, 1), True), ((4, 1), True)])
def test_notes_warn_about_evict_on_a_store_several_engines_share(chart: helm.Chart, replicas: tuple[int, int],
                                                                 warned: bool) -> None:
    prefill, decode = replicas
    values = _merged(EVICT, {"vllm": {"prefill": {"replicas": prefill}, "decode": {"replicas": decode}}})
    notes = render(chart, values)["moonlease/templates/NOTES.txt"]
    assert (f"retention evict is on and {prefill + decode} vLLM engines share this store" in notes) is warned
    no_evict = _merged(values, {"vllm": {"connector": {"retention": {"evict": False}}}})
    assert "WARNING: retention evict" not in render(chart, no_evict)["moonlease/templates/NOTES.txt"]
