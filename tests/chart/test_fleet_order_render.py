"""The opt-in fleet order service (`fleetOrder.enabled`): one pod per release, from the connector
image, holding the whole fleet's recency order in memory (one replica, replaced with Recreate),
and a Service the engines of every arm with retention evict find through their
`mooncake_fleet_order_url`; nothing without the value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from moonlease_settings.config import MoonleaseConnectorConfig

from tests.chart.rendering import (
    CHART_DIR,
    KUBE_VERSION,
    NAMESPACE,
    JsonObj,
    kubernetes_validate_strict,
    container,
    find,
    kv_transfer_config,
    one,
    render,
    render_objects,
)

pytestmark = pytest.mark.chart

FLEET_ORDER = {"fleetOrder": {"enabled": True}}
EVICT = {"vllm": {"connector": {"retention": {"evict": True}}}}
URL = f"http://moonlease-fleet-order.{NAMESPACE}.svc:8790"


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def _fleet_order_objects(objects: list[JsonObj]) -> list[JsonObj]:
    return [o for o in objects if o["metadata"]["labels"].get("app.kubernetes.io/component") == "fleet-order"]


def _engines(objects: list[JsonObj]) -> dict[str, JsonObj]:
    return {o["metadata"]["name"]: o for o in find(objects, "Deployment") if "moonlease.io/role" in o["metadata"]["labels"]}


def _extra_config(engine: JsonObj) -> dict[str, Any]:
    return kv_transfer_config(engine)["kv_connector_extra_config"]


def test_no_fleet_order_unless_asked(chart: helm.Chart) -> None:
    assert _fleet_order_objects(render_objects(chart)) == []
    # Evict alone orders each engine's own keys: no service, no URL.
    objects = render_objects(chart, EVICT)
    assert _fleet_order_objects(objects) == []
    assert all("mooncake_fleet_order_url" not in _extra_config(e) for e in _engines(objects).values())
    assert "fleet order service keeps" not in render(chart, EVICT)["moonlease/templates/NOTES.txt"]


def test_fleet_order_runs_one_pod_from_the_connector_image(chart: helm.Chart) -> None:
    objects = render_objects(chart, FLEET_ORDER)
    assert {(o["kind"], o["metadata"]["name"]) for o in _fleet_order_objects(objects)} == {
        ("Deployment", "moonlease-fleet-order"), ("Service", "moonlease-fleet-order")}
    deployment = one(objects, "Deployment", "moonlease-fleet-order")
    # State in memory only: exactly one process, and never two at a time during a rollout.
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    main = container(deployment, "fleet-order")
    assert main["image"] == container(one(objects, "Deployment", "moonlease-decode"), "vllm")["image"] \
        == "moonlease/vllm-connector:0.1.0-vllm0.33.0"
    assert main["command"] == ["python3", "-m", "moonlease_connector.fleet_order"]
    assert main["args"] == ["--host=0.0.0.0", "--port=8790", "--capacity=1048576"]
    assert main["ports"] == [{"name": "http", "containerPort": 8790, "protocol": "TCP"}]
    for probe in ("readinessProbe", "livenessProbe"):
        assert main[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, probe
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = main["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "tmp", "mountPath": "/tmp"} in main["volumeMounts"]
    assert main["resources"]["requests"]["memory"] and main["resources"]["limits"]["memory"]
    template = deployment["spec"]["template"]["metadata"]
    assert template["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "8790",
                                       "prometheus.io/path": "/metrics"}
    labels = template["labels"]
    assert labels["app.kubernetes.io/component"] == "fleet-order"
    assert "moonlease.io/role" not in labels  # not an engine: the operator's targets stay the engines
    service = one(objects, "Service", "moonlease-fleet-order")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"] == [{"name": "http", "port": 8790, "targetPort": "http", "protocol": "TCP"}]


def test_fleet_order_port_capacity_and_image_come_from_its_values(chart: helm.Chart) -> None:
    digest = "sha256:" + "cd" * 32
    objects = render_objects(chart, {
        "global": {"imageRegistry": "registry.example.com"},
        "vllm": {"image": {"digest": digest}},
        "fleetOrder": {"enabled": True, "port": 9000, "capacity": 4096, "podAnnotations": {"team": "kv"}}})
    deployment = one(objects, "Deployment", "moonlease-fleet-order")
    main = container(deployment, "fleet-order")
    # vllm.image, as the engines get it (registry and digest included).
    assert main["image"] == f"registry.example.com/moonlease/vllm-connector@{digest}"
    assert main["args"] == ["--host=0.0.0.0", "--port=9000", "--capacity=4096"]
    assert main["ports"][0]["containerPort"] == 9000
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9000" and annotations["team"] == "kv"
    assert one(objects, "Service", "moonlease-fleet-order")["spec"]["ports"][0]["port"] == 9000
    own = render_objects(chart, {"fleetOrder": {"enabled": True, "image": {
        "repository": "example.org/connector", "tag": "0.2.0", "pullPolicy": "Always"}}})
    main = container(one(own, "Deployment", "moonlease-fleet-order"), "fleet-order")
    assert (main["image"], main["imagePullPolicy"]) == ("example.org/connector:0.2.0", "Always")
    with pytest.raises(helm.HelmError, match="fleetOrder.image.repository needs fleetOrder.image.tag or digest"):
        render_objects(chart, {"fleetOrder": {"enabled": True, "image": {"repository": "example.org/connector"}}})


def test_engines_with_evict_report_to_the_fleet_order_service(chart: helm.Chart) -> None:
    objects = render_objects(chart, _merged(EVICT, FLEET_ORDER))
    engines = _engines(objects)
    assert set(engines) == {"moonlease-prefill", "moonlease-decode"}
    for engine in engines.values():
        extra = _extra_config(engine)
        assert extra["mooncake_fleet_order_url"] == URL
        # What the connector reads at start-up: it validates the URL (a bad one stops it).
        assert MoonleaseConnectorConfig.from_sources(extra, {}).mooncake_fleet_order_url == URL
        # Beside the master's metrics, which evict still reads for the store's usage.
        assert extra["mooncake_master_metrics_url"].startswith("http://moonlease-mooncake-master.")
    # The URL names the Service, at its port, in the release namespace.
    service = one(objects, "Service", "moonlease-fleet-order")
    assert URL == f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc:" \
        f"{service['spec']['ports'][0]['port']}"
    elsewhere = render_objects(chart, _merged(EVICT, {"fleetOrder": {"enabled": True, "port": 9100}}),
                               name="kv", namespace="serving")
    for engine in _engines(elsewhere).values():
        assert _extra_config(engine)["mooncake_fleet_order_url"] == "http://kv-moonlease-fleet-order.serving.svc:9100"


def test_every_engine_gets_the_fleet_order_url_so_a_policy_can_turn_evict_on_live(chart: helm.Chart) -> None:
    """The URL is read at start-up, evict from the settings file the operator rewrites live: an
    arm without evict today gets the URL too (it reports nothing until evict is on)."""
    objects = render_objects(chart, _merged(FLEET_ORDER, {"vllm": {"arms": [
        {"name": "control"},
        {"name": "treatment", "retention": {"evict": True}, "managedByPolicy": False}]}}))
    engines = _engines(objects)
    assert len(engines) == 4
    for name, engine in engines.items():
        assert _extra_config(engine)["mooncake_fleet_order_url"] == URL, name
    # One service for the release: every arm shares the master, so one order.
    assert [o["metadata"]["name"] for o in find(objects, "Deployment", "moonlease-fleet-order")] == \
        ["moonlease-fleet-order"]
    notes = render(chart, _merged(FLEET_ORDER, {"vllm": {"arms": [{"name": "control"}]}}))[
        "moonlease/templates/NOTES.txt"]
    assert "No engine of this release has retention evict on" in notes


def test_an_explicit_fleet_order_url_wins(chart: helm.Chart) -> None:
    given = "http://fleet-order.kv-store.svc:8790"
    for extra in (FLEET_ORDER, {}):  # with the chart's service or without it
        objects = render_objects(chart, _merged(_merged(EVICT, extra), {"vllm": {"connector": {"extraConfig": {
            "mooncake_fleet_order_url": given}}}}))
        for engine in _engines(objects).values():
            assert _extra_config(engine)["mooncake_fleet_order_url"] == given


@pytest.mark.parametrize(("values", "message"), [
    ({"fleetOrder": {"port": 0}}, "at '/fleetOrder/port': minimum: got 0, want 1"),
    ({"fleetOrder": {"port": 70000}}, "at '/fleetOrder/port': maximum: got 70,000, want 65,535"),
    ({"fleetOrder": {"capacity": 0}}, "at '/fleetOrder/capacity': minimum: got 0, want 1"),
    ({"fleetOrder": {"capacity": "1Mi"}}, "at '/fleetOrder/capacity': got string, want integer"),
    ({"fleetOrder": {"replicas": 2}}, "at '/fleetOrder': additional properties 'replicas' not allowed"),
    ({"fleetOrder": {"image": {"digest": "latest"}}}, "at '/fleetOrder/image/digest': 'latest' does not match"),
    ({"vllm": {"connector": {"extraConfig": {"mooncake_fleet_order_url": "fleet-order:8790"}}}},
     "at '/vllm/connector/extraConfig/mooncake_fleet_order_url': 'fleet-order:8790' does not match"),
])
def test_bad_fleet_order_values_are_refused(chart: helm.Chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as refused:
        chart.validate_schema(values)
    assert message in str(refused.value)


def test_helm_lint_strict_is_clean_with_the_fleet_order_service() -> None:
    values = _merged(_merged(EVICT, FLEET_ORDER), {"monitoring": {"podMonitor": {"enabled": True}}})
    report = helm.lint(CHART_DIR, values, strict=True, kube_version=KUBE_VERSION, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # 2 warning, 3 error


def test_fleet_order_manifests_pass_kubernetes_validate_strict(chart: helm.Chart, tmp_path: Path) -> None:
    objects = _fleet_order_objects(render_objects(chart, _merged(FLEET_ORDER, {"fleetOrder": {
        "nodeSelector": {"pool": "cpu"}, "extraEnv": [{"name": "EXTRA", "value": "1"}],
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}]}})))
    assert {o["kind"] for o in objects} == {"Deployment", "Service"}
    kubernetes_validate_strict(objects, tmp_path / "fleet-order.yaml")


@pytest.mark.parametrize("enabled", [False, True])
def test_notes_name_the_fleet_order_service_instead_of_warning_about_evict(chart: helm.Chart, enabled: bool) -> None:
    values = _merged(EVICT, {"fleetOrder": {"enabled": enabled}, "vllm": {"prefill": {"replicas": 4}}})
    notes = render(chart, values)["moonlease/templates/NOTES.txt"]
    assert (URL in notes) is enabled
    assert ("WARNING: retention evict is on and 5 vLLM engines share this store" in notes) is not enabled
    assert ("in the order the fleet order service\n   (moonlease-fleet-order) keeps" in notes) is enabled
    if not enabled:
        assert "fleetOrder.enabled=true" in notes
