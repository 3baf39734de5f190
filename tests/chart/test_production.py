"""What a production cluster expects of the chart (issue 19), each rendered by Helm's engine:

* a chart-version-only upgrade leaves every pod template byte-identical (no restarts: a new
  master pod empties the store);
* PodDisruptionBudgets for the master (minAvailable 1), the store pool (maxUnavailable 1) and
  each vLLM role of each arm, selecting exactly their pods;
* per-component scheduling (priorityClassName, topologySpreadConstraints, nodeSelector,
  tolerations, affinity), extra env/volumes/mounts, extraObjects;
* image digests and a global registry;
* `prometheus.io/*` annotations; opt-in PodMonitors, a ServiceMonitor and a PrometheusRule,
  validated against the Prometheus Operator's own CRD types (`cloudcoil-models-prometheus-operator`,
  pydantic models generated from the operator's CRDs: types, required fields, and no field
  the CRD does not know), against tests/chart/data/prometheus-operator-schemas.json (minimal
  schemas written for these tests: what this chart relies on, see its $comment) and, for the
  rules, by Prometheus' own `promtool`;
* vLLM pods get what their arguments need (GPUs for tensor parallelism, the RDMA device).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import helm_python as helm
import jsonschema
import pytest
import yaml

from tests.chart.rendering import (
    CHART_DIR,
    NAMESPACE,
    JsonObj,
    container,
    env,
    find,
    one,
    option,
    pod_specs,
    render_objects,
    values_sets,
)

pytestmark = pytest.mark.chart

SETS = values_sets()
PROMETHEUS_OPERATOR_SCHEMAS = json.loads(
    (Path(__file__).parent / "data" / "prometheus-operator-schemas.json").read_text())
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")


def _selects(selector: JsonObj, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels + matchExpressions) against a label set."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _pod_labels(workload: JsonObj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


# ---- upgrades --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SETS))
def test_a_chart_version_bump_leaves_every_pod_template_byte_identical(name: str, tmp_path: Path) -> None:
    bumped_dir = tmp_path / "moonlease"
    shutil.copytree(CHART_DIR, bumped_dir)
    chart_yaml = yaml.safe_load((bumped_dir / "Chart.yaml").read_text())
    chart_yaml.update(version="9.8.7", appVersion="9.8.7")
    (bumped_dir / "Chart.yaml").write_text(yaml.safe_dump(chart_yaml, sort_keys=False))
    with helm.Chart.load(CHART_DIR) as current, helm.Chart.load(bumped_dir) as bumped:
        before = render_objects(current, SETS[name])
        after = render_objects(bumped, SETS[name])
    templates_before = {o["metadata"]["name"]: yaml.safe_dump(o["spec"]["template"]) for o in before
                        if o["kind"] in WORKLOADS}
    templates_after = {o["metadata"]["name"]: yaml.safe_dump(o["spec"]["template"]) for o in after
                       if o["kind"] in WORKLOADS}
    assert templates_before and templates_before == templates_after
    # The bump did reach the objects' own labels (so the comparison above could have failed).
    assert {o["metadata"]["labels"]["helm.sh/chart"] for o in after if o["kind"] in WORKLOADS} == {"moonlease-9.8.7"}


# ---- disruption budgets ----------------------------------------------------------------------


def test_disruption_budgets_keep_the_master_up_and_take_pool_and_engines_one_at_a_time(chart: helm.Chart) -> None:
    objects = render_objects(chart, SETS["ab"])
    budgets = {o["metadata"]["name"]: o for o in find(objects, "PodDisruptionBudget")}
    assert budgets["moonlease-mooncake-master"]["spec"]["minAvailable"] == 1
    assert "maxUnavailable" not in budgets["moonlease-mooncake-master"]["spec"]
    assert budgets["moonlease-store-pool"]["spec"]["maxUnavailable"] == 1
    vllm = sorted(n for n in budgets if n not in ("moonlease-mooncake-master", "moonlease-store-pool"))
    assert vllm == ["moonlease-decode-control", "moonlease-decode-treatment",
                    "moonlease-prefill-control", "moonlease-prefill-treatment"]
    workloads = [o for o in objects if o["kind"] in WORKLOADS]
    for name, budget in budgets.items():
        selected = [w["metadata"]["name"] for w in workloads if _selects(budget["spec"]["selector"], _pod_labels(w))]
        assert selected == [name], (name, selected)  # each budget covers exactly its workload's pods


def test_disruption_budgets_can_be_turned_off(chart: helm.Chart) -> None:
    off = {"enabled": False}
    objects = render_objects(chart, {"mooncake": {"master": {"podDisruptionBudget": off},
                                                  "storePool": {"podDisruptionBudget": off}},
                                     "vllm": {"prefill": {"podDisruptionBudget": off}}})
    assert [o["metadata"]["name"] for o in find(objects, "PodDisruptionBudget")] == ["moonlease-decode"]


# ---- scheduling, extras, images ------------------------------------------------------------------

COMPONENT_VALUES = {  # workload -> path of its values
    "moonlease-operator": ("operator",),
    "moonlease-mooncake-master": ("mooncake", "master"),
    "moonlease-store-pool": ("mooncake", "storePool"),
    "moonlease-prefill": ("vllm", "prefill"),
    "moonlease-decode": ("vllm", "decode"),
    "moonlease-fleet-order": ("fleetOrder",),
}
#: The values that render every component of COMPONENT_VALUES (the fleet order service is opt-in).
EVERY_COMPONENT: JsonObj = {"fleetOrder": {"enabled": True}}


def _nested(path: tuple[str, ...], leaf: JsonObj) -> JsonObj:
    out: JsonObj = leaf
    for key in reversed(path):
        out = {key: out}
    return out


def _merge(a: JsonObj, b: JsonObj) -> JsonObj:
    merged = dict(a)
    for key, value in b.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def test_each_component_is_scheduled_by_its_own_values(chart: helm.Chart) -> None:
    values: JsonObj = EVERY_COMPONENT
    for workload, path in COMPONENT_VALUES.items():
        values = _merge(values, _nested(path, {
            "priorityClassName": f"pc-{workload}",
            "nodeSelector": {"pool": workload},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": workload, "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": [workload]}]}]}}},
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"},
                {"maxSkew": 2, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule",
                 "labelSelector": {"matchLabels": {"mine": workload}}}],
        }))
    objects = render_objects(chart, values)
    for workload, _ in COMPONENT_VALUES.items():
        obj = one(objects, "Deployment", workload)
        spec = obj["spec"]["template"]["spec"]
        assert spec["priorityClassName"] == f"pc-{workload}"
        assert spec["nodeSelector"] == {"pool": workload}
        assert spec["tolerations"][0]["value"] == workload
        assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [workload]
        filled, own = spec["topologySpreadConstraints"]
        # Without a labelSelector a constraint spreads this component's pods, and only them.
        assert filled["labelSelector"]["matchLabels"] == obj["spec"]["selector"]["matchLabels"]
        assert own["labelSelector"] == {"matchLabels": {"mine": workload}}


def test_extra_env_volumes_and_mounts_reach_each_component(chart: helm.Chart) -> None:
    """Extra variables join each container's own `env:` list: a second `env:` key (which YAML
    and the apply resolve by keeping the last) would drop the chart's, e.g. the operator's
    POD_ID, and kopf would then crash naming its peer (`getpwuid(): uid not found`)."""
    own = {workload: set(env(one(render_objects(chart, EVERY_COMPONENT), "Deployment", workload)))
           for workload in COMPONENT_VALUES}
    assert "POD_ID" in own["moonlease-operator"]
    values: JsonObj = EVERY_COMPONENT
    for path in COMPONENT_VALUES.values():
        if path[0] == "vllm":
            path = ("vllm",)
        values = _merge(values, _nested(path, {
            "extraEnv": [{"name": "EXTRA", "value": "1"}],
            "extraVolumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
            "extraVolumeMounts": [{"name": "certs", "mountPath": "/etc/extra", "readOnly": True}],
        }))
    objects = render_objects(chart, values)
    for workload in COMPONENT_VALUES:
        obj = one(objects, "Deployment", workload)
        assert env(obj)["EXTRA"] == "1", workload
        assert set(env(obj)) == own[workload] | {"EXTRA"}, workload
        volumes = {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}
        assert volumes["certs"]["secret"] == {"secretName": "ca"}, workload
        assert {"name": "certs", "mountPath": "/etc/extra", "readOnly": True} in container(obj)["volumeMounts"]


def test_digests_replace_tags_and_a_global_registry_prefixes_every_image(chart: helm.Chart) -> None:
    digest = "sha256:" + "ab" * 32
    objects = render_objects(chart, {"global": {"imageRegistry": "registry.example.com:5000/"},
                                     "mooncake": {"image": {"digest": digest}}, **EVERY_COMPONENT})
    images = {w["metadata"]["name"]: c["image"] for w, spec in pod_specs(objects) for c in spec["containers"]}
    assert images["moonlease-mooncake-master"] == f"registry.example.com:5000/moonlease/mooncake@{digest}"
    assert images["moonlease-store-pool"] == images["moonlease-mooncake-master"]
    assert images["moonlease-operator"] == "registry.example.com:5000/moonlease/operator:0.1.0"
    assert images["moonlease-prefill"] == "registry.example.com:5000/moonlease/vllm-connector:0.1.0-vllm0.33.0"
    assert images["moonlease-fleet-order"] == images["moonlease-prefill"]  # the service is the connector's
    with pytest.raises(Exception, match="digest"):
        render_objects(chart, {"operator": {"image": {"digest": "latest"}}})


def test_extra_objects_are_installed_and_strings_templated(chart: helm.Chart) -> None:
    objects = render_objects(chart, {"extraObjects": [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "extra-plain"}, "data": {"a": "b"}},
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: '{{ .Release.Name }}-extra'\n"
        "data:\n  namespace: '{{ .Release.Namespace }}'\n"]})
    assert one(objects, "ConfigMap", "extra-plain")["data"] == {"a": "b"}
    assert one(objects, "ConfigMap", "moonlease-extra")["data"] == {"namespace": NAMESPACE}


# ---- metrics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SETS))
def test_every_pod_announces_its_metrics_port(chart: helm.Chart, name: str) -> None:
    for workload, spec in pod_specs(render_objects(chart, SETS[name])):
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        ports = {p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
        assert int(annotations["prometheus.io/port"]) in ports, workload["metadata"]["name"]


def test_prometheus_operator_objects_are_opt_in(chart: helm.Chart) -> None:
    objects = render_objects(chart, SETS["default"])
    assert not [o for o in objects if o["apiVersion"].startswith("monitoring.coreos.com/")]


@pytest.mark.parametrize("name", sorted(SETS))
def test_monitors_validate_and_scrape_every_metrics_port(chart: helm.Chart, name: str) -> None:
    values = _merge(SETS[name], {"monitoring": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True},
                                                "prometheusRule": {"enabled": True}}, **EVERY_COMPONENT})
    objects = render_objects(chart, values)
    assert find(objects, "Deployment", "moonlease-fleet-order")
    monitoring = [o for o in objects if o["apiVersion"].startswith("monitoring.coreos.com/")]
    for obj in monitoring:
        jsonschema.validate(obj, PROMETHEUS_OPERATOR_SCHEMAS[obj["kind"]])
        _validate_against_crd_types(obj)
    # Every pod's announced metrics port is scraped by exactly one PodMonitor endpoint, by name.
    pod_monitors = find(objects, "PodMonitor")
    for workload, spec in pod_specs(objects):
        if workload["metadata"]["name"] == "moonlease-operator":
            continue  # scraped through its Service (below)
        port = int(workload["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])
        named = {p["name"] for c in spec["containers"] for p in c.get("ports", []) if p["containerPort"] == port}
        scraping = [(m["metadata"]["name"], e["port"]) for m in pod_monitors
                    if _selects(m["spec"]["selector"], _pod_labels(workload))
                    for e in m["spec"]["podMetricsEndpoints"] if e["port"] in named]
        assert len(scraping) == 1, (workload["metadata"]["name"], scraping)
    if find(objects, "Deployment", "moonlease-operator"):
        monitor = one(objects, "ServiceMonitor", "moonlease-operator")
        service = one(objects, "Service", "moonlease-operator-metrics")
        assert _selects(monitor["spec"]["selector"], service["metadata"]["labels"])
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == [p["name"] for p in service["spec"]["ports"]]
        # The operator's series name the policy's namespace; the target's would replace it.
        assert all(e.get("honorLabels") is True for e in monitor["spec"]["endpoints"])


def _validate_against_crd_types(obj: JsonObj) -> None:
    """The object parses as the Prometheus Operator's CRD type of its kind and survives a round
    trip unchanged: a wrong type or a field the CRD does not have (which the model would drop)
    fails."""
    # Imported here: the models take about 3 s to import, which every collection (`make
    # test-fast` too) would pay.
    from cloudcoil.models.prometheus_operator import v1 as prometheus_operator_v1

    model = getattr(prometheus_operator_v1, obj["kind"]).model_validate(obj)
    assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == obj, obj["kind"]


def test_the_crd_type_check_refuses_unknown_fields_and_wrong_types() -> None:
    good = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "m"},
            "spec": {"selector": {"matchLabels": {"a": "b"}}, "podMetricsEndpoints": [{"port": "http"}]}}
    _validate_against_crd_types(good)
    with pytest.raises(AssertionError):
        _validate_against_crd_types({**good, "spec": {**good["spec"], "podMetricsEndpoints": [{"prot": "http"}]}})
    with pytest.raises(ValueError):
        _validate_against_crd_types({**good, "spec": {**good["spec"], "podMetricsEndpoints": [{"port": 9}]}})


def test_the_ab_test_set_works_with_prometheus_operator_out_of_the_box(chart: helm.Chart) -> None:
    """kube-prometheus-stack selects monitors by its `release` label; the A/B test's default
    queries select series by `namespace` and `pod`, which PodMonitor targets carry by default."""
    objects = render_objects(chart, SETS["ab-test"])
    for kind in ("PodMonitor", "ServiceMonitor", "PrometheusRule"):
        assert find(objects, kind), kind
        for obj in find(objects, kind):
            assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    prometheus = one(objects, "MooncakeLeasePolicy", "moonlease")["spec"]["rollout"]["abTest"]["prometheus"]
    assert prometheus.get("podLabel", "pod") == "pod" and prometheus.get("namespaceLabel", "namespace") == "namespace"
    for monitor in find(objects, "PodMonitor"):
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert "relabelings" not in endpoint  # nothing renames or drops `pod`/`namespace`


def test_alert_rules_pass_promtool_and_cover_what_the_issue_names(chart: helm.Chart, tmp_path: Path) -> None:
    objects = render_objects(chart, {"monitoring": {"prometheusRule": {"enabled": True, "stuckFor": "2h"}}})
    rule = one(objects, "PrometheusRule", "moonlease")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"MoonleasePolicyDegraded", "MoonleasePolicyAwaitingApproval",
                           "MoonleasePolicyAwaitingDecision", "MoonleaseABTestMeasurementErrors",
                           "MoonleaseOperatorReconcileErrors", "MoonleaseConnectorStoreErrors",
                           "MoonleaseDecodeRecomputesPrompts",
                           "MoonleaseStoreNearlyFull",
                           "MoonleaseFleetOrderUnreachable"}  # MoonleaseOperatorDown needs the ServiceMonitor
    assert alerts["MoonleasePolicyAwaitingApproval"]["for"] == "2h"
    # Each alert reads a metric the project exports (operator or connector; the connector's in
    # either spelling, tests/chart/test_alert_rules.py) or the master's.
    exported = _exported_metric_names() | {"master_allocated_bytes", "master_total_capacity_bytes"}
    for name, alert in alerts.items():
        used = set(re.findall(r"\bmoonlease_operator_[a-z_]+|\bmaster_[a-z_]+", alert["expr"])) | \
            {f"vllm:{m}" for m in re.findall(r"vllm\[:_\]([a-z_]+)", alert["expr"])}
        assert used and used <= exported, (name, used - exported)


def _exported_metric_names() -> set[str]:
    """Metric names in the operator's and the connector's sources (counters with `_total`, the
    connector's histograms with their `_bucket`, `_sum` and `_count` series)."""
    names: set[str] = set()
    root = CHART_DIR.parents[1]
    operator = (root / "operator" / "moonlease_operator" / "adapters" / "metrics.py").read_text()
    for kind, name in re.findall(r"(Counter|Gauge|Histogram)\(\"([a-z_]+)\"", operator):
        names.add(name + "_total" if kind == "Counter" else name)
    connector = (root / "connector" / "moonlease_connector" / "adapters" / "vllm_metrics.py").read_text()
    names.update(re.findall(r"name=\"(vllm:[a-z_]+)\"", connector))
    for histogram in re.findall(r"histogram\(\s*name=\"(vllm:[a-z_]+)\"", connector):
        names.update(histogram + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


# ---- engines get what their arguments need -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SETS))
def test_vllm_pods_have_the_gpus_and_rdma_devices_their_engines_use(chart: helm.Chart, name: str) -> None:
    objects = render_objects(chart, SETS[name])
    pool = find(objects, "Deployment", "moonlease-store-pool")
    pool_rdma = {k for k in container(pool[0])["resources"]["limits"] if k.startswith("rdma/")} if pool else set()
    for workload, _spec in pod_specs(objects):
        if not workload["metadata"]["labels"]["app.kubernetes.io/component"].startswith("vllm-"):
            continue
        vllm = container(workload, "vllm")
        tensor_parallel = int(option(vllm["args"], "--tensor-parallel-size") or 1)
        assert int(vllm["resources"]["limits"].get("nvidia.com/gpu", 0)) == tensor_parallel, workload["metadata"]["name"]
        assert {k for k in vllm["resources"]["limits"] if k.startswith("rdma/")} == pool_rdma, workload["metadata"]["name"]


def test_the_grafana_dashboard_is_opt_in_and_every_query_parses(chart: helm.Chart, tmp_path: Path) -> None:
    assert not [o for o in render_objects(chart, {}) if o["metadata"]["name"] == "moonlease-dashboard"]
    objects = render_objects(chart, {"monitoring": {"grafanaDashboard": {"enabled": True}}})
    config_map = one(objects, "ConfigMap", "moonlease-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label
    dashboard = json.loads(config_map["data"]["moonlease.json"])
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 10
    # Prometheus' own parser: each query as a recording rule, the $namespace variable at "All".
    rules = [{"record": f"moonlease:dashboard_query_{i}", "expr": e.replace("$namespace", ".*")}
             for i, e in enumerate(exprs)]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # Ours (operator, connector) are the names our code exports; upstream vLLM's and the master's
    # are the ones the A/B test reads too (operator core/ab_samples.py).
    ab_samples = (CHART_DIR.parents[1] / "operator" / "moonlease_operator" / "core" / "ab_samples.py").read_text()
    upstream = set(re.findall(r"\"((?:vllm:|master_)[a-z_]+)\"", ab_samples))
    known = _exported_metric_names() | upstream
    text = " ".join(exprs)
    ours = set(re.findall(r"\bmoonlease_operator_[a-z_]+", text)) | \
        {f"vllm:{m}" for m in re.findall(r"vllm\[:_\]([a-z_]+)", text)} | set(re.findall(r"\bmaster_[a-z_]+", text))
    assert ours and ours <= known, ours - known
    # The panels the issue asks for, by what they read.
    for metric in ("external_prefix_cache_hits_total", "moonlease_lookups_total", "moonlease_lookup_keys_total",
                   "time_to_first_token_seconds_bucket", "master_evicted_key_count",
                   "master_put_start_alloc_failures_total", "moonlease_operator_policy_phase",
                   "moonlease_operator_ab_test_effect"):
        assert metric in text, metric


# ---- documentation matches the grants ----------------------------------------------------------


def test_both_readmes_name_the_configmap_verbs_the_role_grants(chart: helm.Chart) -> None:
    """A reviewer approves the install from the docs: the Helm and operator pages and the chart's
    README must name every verb the Role gives on ConfigMaps (named namespaces) and the
    ClusterRole (`watchNamespaces: ["*"]`)."""
    for values in ({}, {"operator": {"watchNamespaces": ["*"]}}):
        objects = render_objects(chart, values)
        roles = find(objects, "Role") + find(objects, "ClusterRole")
        verbs = {tuple(rule["verbs"]) for role in roles for rule in role["rules"] if "configmaps" in rule["resources"]}
        assert len(verbs) == 1, verbs
    granted = ", ".join(f"`{v}`" for v in verbs.pop())
    root = CHART_DIR.parents[1]
    for readme in (root / "docs" / "helm.md", root / "docs" / "operator.md", CHART_DIR / "README.md"):
        text = " ".join(readme.read_text().split())  # one line: the sentence may wrap anywhere
        assert granted in text, (readme, granted)
        assert "by name only" not in text and "never `list`" not in text and "no `list`" not in text, readme
