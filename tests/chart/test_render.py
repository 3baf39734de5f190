"""The chart renders valid, secure Kubernetes objects for each values set, and each set renders
what it promises: the whole stack, no vLLM pods, an external master, an A/B pair, a namespaced
operator over RDMA.

Rendered by Helm's own engine (helm-python-sdk), linted by `helm lint --strict`, and every
built-in object checked by `kubernetes-validate --strict` against Kubernetes 1.34's schemas; the
policy is checked against the CRD in test_policy_schema.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from moonlease.cli import build_parser
from moonlease_settings.config import LEASE_MODE_KEY, SELECTIVE_LEASE_ENV, LeaseMode, MoonleaseConnectorConfig
from moonlease_settings.lease_modes import ALIAS_KEYS, strategy_of
from moonlease_settings.settings_file import SETTINGS_FILE_NAME, SETTINGS_FILE_PATH, parse_settings_file
from tests.chart.rendering import (
    CHART_DIR,
    KUBE_VERSION,
    NAMESPACE,
    kubernetes_validate_strict,
    container,
    env,
    find,
    kv_transfer_config,
    manifests,
    one,
    option,
    pod_specs,
    render,
    render_objects,
    values_sets,
)

pytestmark = pytest.mark.chart

SETS = values_sets()
MASTER_ADDRESS = f"moonlease-mooncake-master.{NAMESPACE}.svc:50051"


def running_settings(objects: list[dict[str, Any]], engine: dict[str, Any]) -> MoonleaseConnectorConfig:
    """What the engine's connector runs: its start-up defaults (extra config + env) with its
    settings file — the ConfigMap its settings volume mounts — over them, as the connector reads it."""
    startup = MoonleaseConnectorConfig.from_sources(kv_transfer_config(engine)["kv_connector_extra_config"],
                                                    {k: v for k, v in env(engine, "vllm").items()
                                                     if isinstance(v, str)})
    assert kv_transfer_config(engine)["kv_connector_extra_config"]["mooncake_settings_file"] == SETTINGS_FILE_PATH
    mounts = {m["name"]: m["mountPath"] for m in container(engine, "vllm")["volumeMounts"]}
    assert mounts["moonlease-connector-settings"] + "/" + SETTINGS_FILE_NAME == SETTINGS_FILE_PATH
    volume = next(v for v in engine["spec"]["template"]["spec"]["volumes"] if v["name"] == "moonlease-connector-settings")
    config_map = one(objects, "ConfigMap", volume["configMap"]["name"])
    assert config_map["metadata"]["labels"]["moonlease.io/connector-settings"] == "true"
    return parse_settings_file(config_map["data"][SETTINGS_FILE_NAME], startup)



def test_the_values_sets_are_the_ones_the_issue_names() -> None:
    assert set(SETS) == {"default", "no-vllm", "external-master", "ab", "ab-test", "namespaced-rdma"}


@pytest.mark.parametrize("name", sorted(SETS))
def test_helm_lint_strict_is_clean(name: str) -> None:
    report = helm.lint(CHART_DIR, SETS[name], strict=True, kube_version=KUBE_VERSION, namespace=NAMESPACE)
    assert report["errors"] == []
    findings = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert findings == []
    assert report["total_charts_linted"] == 1


@pytest.mark.parametrize("name", sorted(SETS))
def test_every_manifest_passes_kubernetes_validate_strict(chart: helm.Chart, name: str, tmp_path: Path) -> None:
    objects = render_objects(chart, SETS[name])
    report = kubernetes_validate_strict(objects, tmp_path / f"{name}.yaml")
    for obj in objects:
        line = f"{obj['kind'].lower()}/{obj['metadata']['name']} against version"
        if obj["apiVersion"].startswith(("moonlease.io/", "monitoring.coreos.com/", "kopf.dev/")):
            continue  # a custom resource: validated against its schema instead (test_policy_schema.py,
            # test_production.py; kopf's peering CRDs are free-form)
        assert f"passed for resource {line}" in report, (line, report)


def _probe_port(probe: dict[str, Any]) -> Any:
    return (probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")


@pytest.mark.parametrize("name", sorted(SETS))
def test_every_pod_runs_unprivileged_probed_and_sized(chart: helm.Chart, name: str) -> None:
    values = SETS[name]
    objects = render_objects(chart, values)
    rdma = values.get("mooncake", {}).get("protocol") == "rdma"
    assert list(pod_specs(objects)), "no workloads rendered"
    for workload, spec in pod_specs(objects):
        where = workload["metadata"]["name"]
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0 and pod["runAsGroup"] > 0, where
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, where
        # Only the operator talks to the API server.
        assert spec.get("automountServiceAccountToken", True) is (component == "operator"), where
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            # IPC_LOCK only where RDMA registers memory: the store pool and the engines.
            wants_lock = rdma and component in ("store-pool", "vllm-prefill", "vllm-decode")
            assert sc["capabilities"].get("add", []) == (["IPC_LOCK"] if wants_lock else []), where
            # Read-only root everywhere but vLLM, which compiles and caches at run time (README).
            expected_ro = values.get("vllm", {}).get("readOnlyRootFilesystem", False) \
                if component.startswith("vllm-") else True
            assert sc["readOnlyRootFilesystem"] is expected_ro, where
            assert ":" in c["image"] and not c["image"].endswith(":latest"), where
            ports = {p["name"] for p in c.get("ports", [])}
            probes = ("startupProbe", "readinessProbe", "livenessProbe") if component.startswith("vllm-") \
                else ("readinessProbe", "livenessProbe")
            for probe in probes:
                assert _probe_port(c[probe]) in ports, (where, probe)
            assert c["resources"]["requests"].get("cpu") and c["resources"]["requests"].get("memory"), where
            assert c["resources"]["limits"].get("memory"), where
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts, where  # writable scratch space on a read-only root


def test_defaults_render_the_whole_stack(chart: helm.Chart) -> None:
    objects = render_objects(chart, SETS["default"])
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == sorted([
        ("ServiceAccount", "moonlease-operator"), ("Role", "moonlease-operator"),
        ("RoleBinding", "moonlease-operator"), ("ClusterRole", "moonlease-operator-cluster"),
        ("ClusterRoleBinding", "moonlease-operator-cluster"), ("Deployment", "moonlease-operator"),
        ("Service", "moonlease-operator-metrics"), ("KopfPeering", "moonlease-operator"),
        ("Deployment", "moonlease-mooncake-master"), ("Service", "moonlease-mooncake-master"),
        ("Deployment", "moonlease-store-pool"), ("ConfigMap", "moonlease-store-config"),
        ("Deployment", "moonlease-prefill"), ("Service", "moonlease-prefill"),
        ("ConfigMap", "moonlease-prefill-moonlease"), ("ConfigMap", "moonlease-decode-moonlease"),
        ("Deployment", "moonlease-decode"), ("Service", "moonlease-decode"),
        ("MooncakeLeasePolicy", "moonlease"),
        ("PodDisruptionBudget", "moonlease-mooncake-master"), ("PodDisruptionBudget", "moonlease-store-pool"),
        ("PodDisruptionBudget", "moonlease-prefill"), ("PodDisruptionBudget", "moonlease-decode"),
    ])

    # The master: Mooncake's flag names; whole numbers never in exponent form.
    master = one(objects, "Deployment", "moonlease-mooncake-master")
    assert container(master)["command"] == ["mooncake_master"]
    assert container(master)["args"] == [
        "--rpc_address=$(POD_IP)", "--rpc_port=50051", "--metrics_port=9003", "--logtostderr=true",
        "--allow_evict_soft_pinned_objects=true", "--default_kv_lease_ttl=10000",
        "--default_kv_soft_pin_ttl=1800000", "--eviction_high_watermark_ratio=0.9", "--eviction_ratio=0.05"]
    assert master["spec"]["replicas"] == 1 and master["spec"]["strategy"] == {"type": "Recreate"}
    service = one(objects, "Service", "moonlease-mooncake-master")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"rpc": 50051, "metrics": 9003}
    assert service["spec"]["selector"].items() <= master["spec"]["template"]["metadata"]["labels"].items()

    # The store pool: segment and buffer from values, memory = segment + buffer + overhead.
    pool = one(objects, "Deployment", "moonlease-store-pool")
    args = container(pool)["args"]
    assert container(pool)["command"] == ["mooncake_client"]
    assert option(args, "--master_server_address") == MASTER_ADDRESS
    assert option(args, "--metadata_server") == "P2PHANDSHAKE" and option(args, "--protocol") == "tcp"
    assert option(args, "--global_segment_size") == "8192MB" and option(args, "--local_buffer_size") == "64MB"
    assert option(args, "--host") == "$(POD_IP)"
    resources = container(pool)["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == f"{8192 + 64 + 512}Mi"
    assert pool["spec"]["replicas"] == 2

    # The engines: the store config in standalone-store mode, pointing at the master Service.
    store = json.loads(one(objects, "ConfigMap", "moonlease-store-config")["data"]["mooncake.json"])
    assert store == {"metadata_server": "P2PHANDSHAKE", "master_server_address": MASTER_ADDRESS,
                     "protocol": "tcp", "device_name": "", "mode": "standalone-store",
                     "global_segment_size": 0, "local_buffer_size": "512MB"}
    for role in ("prefill", "decode"):
        vllm = one(objects, "Deployment", f"moonlease-{role}")
        assert container(vllm, "vllm")["command"] == ["vllm"]
        assert container(vllm, "vllm")["args"][:3] == ["serve", "Qwen/Qwen3-0.6B", "--port=8000"]
        assert kv_transfer_config(vllm) == {
            "kv_connector": "MooncakeStoreConnector", "kv_connector_module_path": "moonlease_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"mooncake_settings_file": SETTINGS_FILE_PATH}}
        assert running_settings(objects, vllm) == MoonleaseConnectorConfig.for_mode(
            MoonleaseConnectorConfig().lease_mode)
        variables = env(vllm, "vllm")
        assert SELECTIVE_LEASE_ENV not in variables  # the lease mode lives in the settings file
        assert variables["MOONCAKE_CONFIG_PATH"] == "/etc/mooncake/mooncake.json"
        assert variables["VLLM_HOST_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        mounts = {m["mountPath"]: m["name"] for m in container(vllm, "vllm")["volumeMounts"]}
        volumes = {v["name"]: v for v in vllm["spec"]["template"]["spec"]["volumes"]}
        assert volumes[mounts["/etc/mooncake"]]["configMap"]["name"] == "moonlease-store-config"
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert vllm["metadata"]["labels"]["moonlease.io/role"] == role
        assert vllm["spec"]["template"]["spec"]["enableServiceLinks"] is False
        service = one(objects, "Service", f"moonlease-{role}")
        assert service["spec"]["selector"].items() <= vllm["spec"]["template"]["metadata"]["labels"].items()

    # The operator: arguments the `moonlease` command accepts, the release namespace only, peering
    # through the chart's KopfPeering there (any number of replicas: one acts).
    operator = one(objects, "Deployment", "moonlease-operator")
    assert container(operator)["command"] == ["moonlease"]
    parsed = build_parser().parse_args(container(operator)["args"])
    assert (parsed.command, parsed.standalone, parsed.peering, parsed.all_namespaces, parsed.namespace) == \
        ("operator", False, "moonlease-operator", False, [NAMESPACE])
    assert one(objects, "KopfPeering", "moonlease-operator")["metadata"]["namespace"] == NAMESPACE
    # Least privilege: Deployments and ConfigMaps only in that namespace.
    assert one(objects, "Role", "moonlease-operator")["metadata"]["namespace"] == NAMESPACE
    cluster_rules = one(objects, "ClusterRole", "moonlease-operator-cluster")["rules"]
    assert sorted(r for rule in cluster_rules for r in rule["resources"]) == ["customresourcedefinitions", "namespaces"]
    everywhere = render_objects(chart, {"operator": {"watchNamespaces": ["*"]}})
    assert build_parser().parse_args(container(one(everywhere, "Deployment", "moonlease-operator"))["args"]
                                     ).all_namespaces is True
    assert not find(everywhere, "Role") and one(everywhere, "ClusterRole", "moonlease-operator")
    assert one(everywhere, "ClusterKopfPeering", "moonlease-operator")
    assert parsed.metrics_port == 9090 and parsed.reconcile_interval == 5.0
    assert parsed.liveness == "http://0.0.0.0:8080/healthz"
    assert parsed.prometheus_url_allow == []  # no Prometheus allowed unless the values name it
    allowing = render_objects(chart, {"operator": {"prometheusUrlAllowlist": ["http://prometheus-operated.monitoring:9090"]}})
    assert build_parser().parse_args(container(one(allowing, "Deployment", "moonlease-operator"))["args"]) \
        .prometheus_url_allow == ["http://prometheus-operated.monitoring:9090"]
    assert operator["spec"]["replicas"] == 1 and operator["spec"]["strategy"] == {"type": "RollingUpdate"}
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container(operator)["env"]
    two = one(render_objects(chart, {"operator": {"replicas": 2}}), "Deployment", "moonlease-operator")
    assert two["spec"]["replicas"] == 2
    assert operator["spec"]["template"]["spec"]["serviceAccountName"] == "moonlease-operator"
    metrics = one(objects, "Service", "moonlease-operator-metrics")
    assert metrics["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]


@pytest.mark.parametrize("name", sorted(SETS))
def test_each_engine_gets_a_connector_config_the_connector_accepts(chart: helm.Chart, name: str) -> None:
    """What the connector itself reads (start-up config, then its settings file) is the lease
    mode the values asked for."""
    values = SETS[name]
    objects = render_objects(chart, values)
    vllm = values.get("vllm", {})
    default = (vllm.get("connector", {}).get("leaseMode", "leaseAll"),
               vllm.get("connector", {}).get("junctionRetention", False))
    arms = {arm["name"]: (arm.get("leaseMode", default[0]), arm.get("junctionRetention", default[1]))
            for arm in vllm.get("arms", [])} or {"": default}
    engines = [o for o in find(objects, "Deployment") if "moonlease.io/role" in o["metadata"]["labels"]]
    assert len(engines) == (2 * len(arms) if vllm.get("enabled", True) else 0)
    for engine in engines:
        arm = engine["metadata"]["labels"].get("moonlease.io/arm", "")
        config = running_settings(objects, engine)
        assert (config.lease_mode.value, config.mooncake_junction_retention) == arms[arm], engine["metadata"]["name"]


@pytest.mark.parametrize("pieces", [{"retry": True}, {"skip": True}, {"pin": True, "retry": True},
                                    {"evict": True}])
def test_retention_values_reach_the_policy_and_every_engine_as_the_operator_renders_them(
        chart: helm.Chart, pieces: dict[str, bool]) -> None:
    """`vllm.connector.retention` turns the pieces on in the policy's spec.connector (only those
    on: an unchanged policy keeps its spec) and in each engine's settings file, with exactly
    the keys the operator writes for that spec (the same file, so the same config hash)."""
    from moonlease_settings.retention import RetentionSettings
    from moonlease_operator.api.policy import ConnectorSpec
    from moonlease_operator.core.settings import build_connector_settings

    objects = render_objects(chart, {"vllm": {"connector": {"retention": pieces}}})
    policy = one(objects, "MooncakeLeasePolicy", "moonlease")
    fields = {"skip": "retentionSkip", "pin": "retentionPin", "retry": "retentionRetry", "evict": "retentionEvict"}
    assert policy["spec"]["connector"] == {"leaseMode": "leaseAll", "junctionRetention": False,
                                           **{fields[piece]: True for piece in pieces}}
    watermark = policy["spec"]["master"]["evictionHighWatermarkRatio"]
    operator_file = build_connector_settings(ConnectorSpec.model_validate(policy["spec"]["connector"]),
                                             watermark).file
    engines = [o for o in find(objects, "Deployment") if "moonlease.io/role" in o["metadata"]["labels"]]
    assert len(engines) == 2
    for engine in engines:
        assert running_settings(objects, engine).retention == RetentionSettings(
            **pieces, **({"evict_watermark": watermark} if pieces.get("evict") else {}))
        volume = next(v for v in engine["spec"]["template"]["spec"]["volumes"]
                      if v["name"] == "moonlease-connector-settings")
        rendered = json.loads(one(objects, "ConfigMap", volume["configMap"]["name"])["data"][SETTINGS_FILE_NAME])
        assert {k: v for k, v in rendered.items() if k.startswith("mooncake_")} == dict(operator_file)


def test_retention_evict_reads_the_masters_metrics_at_its_service(chart: helm.Chart) -> None:
    """With evict on, each engine's start-up config names the master's /metrics (the chart's
    master service and metrics port, or externalAddress's host) unless extraConfig does, and its
    settings file carries the master's watermark."""
    objects = render_objects(chart, {"vllm": {"connector": {"retention": {"evict": True}}},
                                     "mooncake": {"master": {"metricsPort": 9100,
                                                             "settings": {"eviction_high_watermark_ratio": 0.85}}}})
    engines = [o for o in find(objects, "Deployment") if "moonlease.io/role" in o["metadata"]["labels"]]
    assert engines
    for engine in engines:
        extra = kv_transfer_config(engine)["kv_connector_extra_config"]
        assert extra["mooncake_master_metrics_url"] == "http://moonlease-mooncake-master.inference.svc:9100/metrics"
        assert running_settings(objects, engine).retention.evict_watermark == 0.85
    own = render_objects(chart, {"vllm": {"connector": {"retention": {"evict": True},
                                                        "extraConfig": {"mooncake_master_metrics_url": "http://m:1/metrics"}}}})
    for engine in [o for o in find(own, "Deployment") if "moonlease.io/role" in o["metadata"]["labels"]]:
        assert kv_transfer_config(engine)["kv_connector_extra_config"]["mooncake_master_metrics_url"] == "http://m:1/metrics"
    off = render_objects(chart, {})
    for engine in [o for o in find(off, "Deployment") if "moonlease.io/role" in o["metadata"]["labels"]]:
        assert "mooncake_master_metrics_url" not in kv_transfer_config(engine)["kv_connector_extra_config"]


def test_an_arm_the_policy_does_not_manage_runs_its_own_retention(chart: helm.Chart) -> None:
    """Per-arm retention: an unmanaged treatment arm with `retention: {evict: true, retry: true}`
    runs exactly those pieces (and gets the master's metrics address); the control arm runs
    vllm.connector.retention (none here); a managed arm may not differ from the policy."""
    from moonlease_settings.retention import RetentionSettings

    objects = render_objects(chart, {"vllm": {"arms": [
        {"name": "control"},
        {"name": "treatment", "retention": {"evict": True, "retry": True}, "managedByPolicy": False}]}})
    engines = [o for o in find(objects, "Deployment") if "moonlease.io/role" in o["metadata"]["labels"]]
    by_arm = {arm: [e for e in engines if e["metadata"]["labels"]["moonlease.io/arm"] == arm]
              for arm in ("control", "treatment")}
    assert len(by_arm["control"]) == len(by_arm["treatment"]) == 2
    for engine in by_arm["control"]:
        assert running_settings(objects, engine).retention == RetentionSettings()
        assert "mooncake_master_metrics_url" not in kv_transfer_config(engine)["kv_connector_extra_config"]
    for engine in by_arm["treatment"]:
        assert running_settings(objects, engine).retention == RetentionSettings(retry=True, evict=True,
                                                                               evict_watermark=0.9)
        assert "mooncake_master_metrics_url" in kv_transfer_config(engine)["kv_connector_extra_config"]
    policy = one(objects, "MooncakeLeasePolicy", "moonlease")
    assert "retentionEvict" not in policy["spec"]["connector"]  # the policy's targets run none
    with pytest.raises(Exception, match="sets retention skip=false,pin=false,retry=false,evict=true"):
        render_objects(chart, {"vllm": {"arms": [{"name": "control"},
                                                 {"name": "treatment", "retention": {"evict": True}}]}})


@pytest.mark.parametrize("mode", list(LeaseMode), ids=[m.value for m in LeaseMode])
@pytest.mark.parametrize("arm", [False, True], ids=["release", "arm"])
def test_each_lease_mode_renders_as_its_strategy_says(chart: helm.Chart, mode: LeaseMode, arm: bool) -> None:
    """`_validate.tpl` refuses a model not declared hybrid exactly for the modes whose strategy
    needs one (set on the release or on one arm), and the settings file carries the mode as
    `mooncake_lease_mode`, spelled as in the values (`moonlease_settings.lease_modes` is the one source)."""
    connector = {} if arm else {"leaseMode": mode.value}
    arms = {"arms": [{"name": "control"}, {"name": "treatment", "leaseMode": mode.value,
                                            "managedByPolicy": False}]} if arm else {}
    plain = {"vllm": {"connector": connector, **arms}}
    if strategy_of(mode).needs_hybrid_model:
        with pytest.raises(helm.HelmRenderError, match=f"leaseMode {mode.value} is for hybrid models"):
            render(chart, plain)
    else:
        render(chart, plain)
    objects = render_objects(chart, {"vllm": {"hybrid": True, "connector": connector, **arms}})
    engines = [o for o in find(objects, "Deployment") if "moonlease.io/role" in o["metadata"]["labels"]]
    ran = {running_settings(objects, engine).lease_mode for engine in engines}
    assert ran == ({LeaseMode.LEASE_ALL, mode} if arm else {mode})
    for config_map in find(objects, "ConfigMap"):
        if SETTINGS_FILE_NAME in config_map.get("data", {}):
            file = json.loads(config_map["data"][SETTINGS_FILE_NAME])
            assert file[LEASE_MODE_KEY] in {m.value for m in ran} and not set(file) & set(ALIAS_KEYS)


def test_a_hybrid_model_can_run_last_hit_only(chart: helm.Chart) -> None:
    """lastHitOnly reaches every engine as the connector's own switch, and the policy declares the
    targets hybrid (the operator's compatibility gate asks for it)."""
    objects = render_objects(chart, {"vllm": {"hybrid": True, "connector": {"leaseMode": "lastHitOnly"}}})
    engines = [o for o in find(objects, "Deployment") if "moonlease.io/role" in o["metadata"]["labels"]]
    assert len(engines) == 2
    for engine in engines:
        assert running_settings(objects, engine).lease_mode.value == "lastHitOnly"
    (policy,) = find(objects, "MooncakeLeasePolicy")
    assert policy["spec"]["connector"]["leaseMode"] == "lastHitOnly"
    assert all(target.get("hybrid") for target in policy["spec"]["targets"])


def test_no_vllm_set_renders_no_vllm_pods_and_a_policy_over_selected_workloads(chart: helm.Chart) -> None:
    objects = render_objects(chart, SETS["no-vllm"])
    components = {o["metadata"]["labels"]["app.kubernetes.io/component"] for o in objects}
    assert components == {"operator", "mooncake-master", "store-pool", "policy"}
    policy = one(objects, "MooncakeLeasePolicy", "moonlease")
    assert policy["spec"]["targets"] == SETS["no-vllm"]["policy"]["targets"]
    assert policy["spec"]["master"]["name"] == "moonlease-mooncake-master"
    # The store is never emptied unasked: approvals on, deletion keeps the master's settings.
    assert (policy["spec"]["master"]["requireApprovalForRestart"], policy["spec"]["master"]["onDelete"]) == (True, "keep")
    restore = one(render_objects(chart, {**SETS["no-vllm"], "policy": {**SETS["no-vllm"]["policy"],
                                                                         "masterOnDelete": "restore"}}),
                  "MooncakeLeasePolicy", "moonlease")
    assert restore["spec"]["master"]["onDelete"] == "restore"


def test_external_master_set_renders_no_master_and_points_everything_at_it(chart: helm.Chart) -> None:
    values = SETS["external-master"]
    address = values["mooncake"]["master"]["externalAddress"]
    rendered = render(chart, values)
    objects = manifests(rendered)
    assert not [o for o in objects if "mooncake-master" in o["metadata"]["name"]]
    assert not find(objects, "MooncakeLeasePolicy")
    pool = one(objects, "Deployment", "moonlease-store-pool")
    assert option(container(pool)["args"], "--master_server_address") == address
    assert pool["spec"]["replicas"] == 4
    assert container(pool)["resources"]["limits"]["memory"] == f"{32768 + 64 + 1024}Mi"
    store = json.loads(one(objects, "ConfigMap", "moonlease-store-config")["data"]["mooncake.json"])
    assert store["master_server_address"] == address
    notes = rendered["moonlease/templates/NOTES.txt"]
    assert address in notes and "kubectl -n inference get mooncakeleasepolicies" not in notes


def test_ab_set_renders_two_arms_of_each_role(chart: helm.Chart) -> None:
    objects = render_objects(chart, SETS["ab"])
    engines = {o["metadata"]["name"]: o for o in find(objects, "Deployment") if "moonlease.io/role" in
               o["metadata"]["labels"]}
    assert set(engines) == {"moonlease-prefill-control", "moonlease-decode-control",
                            "moonlease-prefill-treatment", "moonlease-decode-treatment"}
    for name, engine in engines.items():
        role, arm = name.split("-")[1:]
        labels = engine["spec"]["template"]["metadata"]["labels"]
        assert (labels["moonlease.io/role"], labels["moonlease.io/arm"]) == (role, arm)
        extra = kv_transfer_config(engine)["kv_connector_extra_config"]
        assert (running_settings(objects, engine).lease_mode is LeaseMode.SELECTIVE) is (arm == "treatment")
        assert extra["load_async"] is True  # upstream keys reach every arm
        # Each arm's Service selects its own pods and no other arm's.
        service = one(objects, "Service", name)
        for other_name, other in engines.items():
            selected = service["spec"]["selector"].items() <= other["spec"]["template"]["metadata"]["labels"].items()
            assert selected is (other_name == name), (name, other_name)
    assert engines["moonlease-decode-treatment"]["spec"]["replicas"] == 2
    assert engines["moonlease-decode-control"]["spec"]["replicas"] == 1
    # The policy manages the control arm only: the treatment's lease mode is pinned by values.
    policy = one(objects, "MooncakeLeasePolicy", "moonlease")
    assert [(t["name"], t["role"]) for t in policy["spec"]["targets"]] == [
        ("moonlease-prefill-control", "prefill"), ("moonlease-decode-control", "decode")]
    assert policy["spec"]["connector"]["leaseMode"] == "leaseAll"


def test_pod_annotations_of_an_arm_override_its_roles_and_the_scrape_port(chart: helm.Chart) -> None:
    """Each arm's own `podAnnotations` (its metrics port, say) override the role's, which
    override the scrape annotations: one value per key, never a key rendered twice."""
    values = {"vllm": {"decode": {"podAnnotations": {"team": "serving", "prometheus.io/port": "9100"}},
                       "arms": [{"name": "control"},
                                {"name": "treatment", "podAnnotations": {"prometheus.io/port": "9200",
                                                                          "team": "research"}}]}}
    objects = render_objects(chart, values)  # refuses a key given twice in one mapping
    annotations = {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["annotations"]
                   for o in find(objects, "Deployment") if "moonlease.io/role" in o["metadata"]["labels"]}
    port_and_team = {name: (a["prometheus.io/port"], a.get("team")) for name, a in annotations.items()}
    assert port_and_team == {"moonlease-prefill-control": ("8000", None), "moonlease-prefill-treatment": ("9200", "research"),
                             "moonlease-decode-control": ("9100", "serving"), "moonlease-decode-treatment": ("9200", "research")}
    assert all(a["prometheus.io/scrape"] == "true" and a["checksum/store-config"] for a in annotations.values())
    with pytest.raises(helm.HelmError, match="podAnnotations"):
        chart.validate_schema({"vllm": {"arms": [{"name": "treatment", "podAnnotations": {"port": 9200}}]}})


def test_ab_test_set_renders_an_ab_test_policy_over_the_two_managed_arms(chart: helm.Chart) -> None:
    """Strategy ABTest: both arms are targets, each arm's Deployments are its workloads (named as
    the chart names them), and the analysis values reach spec.rollout.abTest unchanged."""
    values = SETS["ab-test"]
    objects = render_objects(chart, values)
    policy = one(objects, "MooncakeLeasePolicy", "moonlease")
    rollout = policy["spec"]["rollout"]
    assert rollout["strategy"] == "ABTest"
    deployments = {o["metadata"]["name"] for o in find(objects, "Deployment")}
    for side, arm in (("control", "control"), ("treatment", "treatment")):
        workloads = rollout["abTest"][side]["workloads"]
        assert workloads == [f"moonlease-prefill-{arm}", f"moonlease-decode-{arm}"]
        assert set(workloads) <= deployments
        for name in workloads:
            labels = one(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
            assert labels["moonlease.io/arm"] == arm
    assert sorted(t["name"] for t in policy["spec"]["targets"]) == sorted(
        rollout["abTest"]["control"]["workloads"] + rollout["abTest"]["treatment"]["workloads"])
    analysis = {k: v for k, v in rollout["abTest"].items() if k not in ("control", "treatment")}
    assert analysis == values["policy"]["abTest"]["analysis"]
    # Both arms run what the policy declares: the operator finds the release in sync.
    for name in deployments & {f"moonlease-{r}-{a}" for r in ("prefill", "decode") for a in ("control", "treatment")}:
        assert running_settings(objects, one(objects, "Deployment", name)).lease_mode is LeaseMode.LEASE_ALL


def test_an_ab_test_with_defaults_renders_only_the_arms(chart: helm.Chart) -> None:
    """An empty `analysis` leaves every knob to the CRD's defaults; other arm names work."""
    values = {"vllm": {"arms": [{"name": "a"}, {"name": "b"}, {"name": "canary", "leaseMode": "selective",
                                                                 "managedByPolicy": False}]},
              "policy": {"abTest": {"enabled": True, "controlArm": "b", "treatmentArm": "a"}}}
    rollout = one(render_objects(chart, values), "MooncakeLeasePolicy", "moonlease")["spec"]["rollout"]
    assert rollout["abTest"] == {"control": {"workloads": ["moonlease-prefill-b", "moonlease-decode-b"]},
                                 "treatment": {"workloads": ["moonlease-prefill-a", "moonlease-decode-a"]}}
    assert one(render_objects(chart, {}), "MooncakeLeasePolicy", "moonlease")["spec"]["rollout"]["strategy"] == \
        "Staged"


def test_namespaced_rdma_set(chart: helm.Chart) -> None:
    values = SETS["namespaced-rdma"]
    objects = render_objects(chart, values)
    # RBAC: a Role in the watched namespace, cluster-wide only what kopf reads there.
    assert [(o["kind"], o["metadata"].get("namespace")) for o in find(objects, "Role")] == [("Role", NAMESPACE)]
    cluster_rules = one(objects, "ClusterRole", "moonlease-operator-cluster")["rules"]
    assert sorted(r for rule in cluster_rules for r in rule["resources"]) == ["customresourcedefinitions", "namespaces"]
    assert [(o["kind"], o["metadata"].get("namespace")) for o in find(objects, "KopfPeering")] == [
        ("KopfPeering", NAMESPACE)]
    parsed = build_parser().parse_args(container(one(objects, "Deployment", "moonlease-operator"))["args"])
    assert (parsed.namespace, parsed.all_namespaces) == ([NAMESPACE], False)
    # RDMA devices reach the pool and the engines.
    pool = one(objects, "Deployment", "moonlease-store-pool")
    assert option(container(pool)["args"], "--protocol") == "rdma"
    assert option(container(pool)["args"], "--device_names") == "mlx5_0,mlx5_1"
    assert container(pool)["resources"]["requests"]["rdma/hca"] == 1
    store = json.loads(one(objects, "ConfigMap", "moonlease-store-config")["data"]["mooncake.json"])
    assert (store["protocol"], store["device_name"]) == ("rdma", "mlx5_0,mlx5_1")
    # Master settings: a null drops the flag (and the policy's field), extras are appended.
    master_args = container(one(objects, "Deployment", "moonlease-mooncake-master"))["args"]
    assert option(master_args, "--default_kv_soft_pin_ttl") is None
    assert option(master_args, "--eviction_high_watermark_ratio") == "0.95"
    assert option(master_args, "--client_active_ttl_sec") == "30"
    assert master_args[-1] == "--rpc_thread_num=8"
    policy = one(objects, "MooncakeLeasePolicy", "moonlease")
    assert "defaultKvSoftPinTtlMs" not in policy["spec"]["master"]
    assert policy["spec"]["master"]["evictionHighWatermarkRatio"] == 0.95
    assert policy["spec"]["rollout"]["stages"] == ["master", "decode", "prefill"]
    # The engines: a quote inside a JSON string survives YAML, tokens and caches wired in.
    prefill = one(objects, "Deployment", "moonlease-prefill")
    extra = kv_transfer_config(prefill)["kv_connector_extra_config"]
    assert extra["cache_prefix"] == "team's fleet" and extra["mooncake_max_lease_rounds"] == 5
    running = running_settings(objects, prefill)
    assert running.mooncake_junction_retention is True and running.lease_mode is LeaseMode.SELECTIVE
    assert policy["spec"]["connector"] == {"leaseMode": "selective", "junctionRetention": True}
    assert "--tensor-parallel-size=2" in container(prefill, "vllm")["args"]
    assert "--served-model-name=llama" in container(prefill, "vllm")["args"]
    assert env(prefill, "vllm")["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    volumes = {v["name"]: v for v in prefill["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model-cache"] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}}
    for workload, spec in pod_specs(objects):
        assert spec["imagePullSecrets"] == [{"name": "regcred"}], workload["metadata"]["name"]
    for obj in objects:
        assert obj["metadata"]["labels"]["team"] == "inference", obj["metadata"]["name"]


@pytest.mark.parametrize("name", sorted(SETS))
def test_notes_tell_the_user_what_to_do_next(chart: helm.Chart, name: str) -> None:
    values = SETS[name]
    notes = render(chart, values)["moonlease/templates/NOTES.txt"]
    assert "kubectl -n inference get pods -l app.kubernetes.io/instance=moonlease" in notes
    assert "Helm does not upgrade CRDs" in notes
    if values.get("policy", {}).get("enabled", True):
        assert "kubectl -n inference get mooncakeleasepolicies moonlease" in notes
    if values.get("vllm", {}).get("enabled", True):
        assert "/v1/completions" in notes
    if values.get("policy", {}).get("requireApprovalForRestart"):
        assert "moonlease.io/approve-master-restart" in notes
    if values.get("policy", {}).get("abTest", {}).get("enabled"):
        assert "kubectl -n inference get mlp moonlease -w" in notes
        assert "moonlease.io/ab-decision=promote:" in notes and "Analyzing" in notes
    else:
        assert "ab-decision" not in notes


def test_every_annotate_command_in_the_notes_works_a_second_time(chart: helm.Chart) -> None:
    """An approval or a decision is an annotation the policy keeps: without `--overwrite` the
    second approval (the next master restart) fails with `already has a value`."""
    values = {"policy": {"requireApprovalForRestart": True}}
    for notes in (render(chart, values)["moonlease/templates/NOTES.txt"],
                  render(chart, SETS["ab-test"])["moonlease/templates/NOTES.txt"]):
        commands = " ".join(notes.split("\\\n")).splitlines()  # continuation lines joined
        annotating = [c for c in commands if " annotate " in c]
        assert annotating
        for command in annotating:
            assert "--overwrite" in command.split(), command


def test_operator_log_format_and_level_reach_its_command_line(chart: helm.Chart) -> None:
    def parsed(values: dict[str, Any]) -> Any:
        operator = one(render_objects(chart, values), "Deployment", "moonlease-operator")
        return build_parser().parse_args(container(operator)["args"])

    assert (parsed({}).log_format, parsed({}).log_level) == ("text", "info")
    chosen = parsed({"operator": {"logFormat": "json", "logLevel": "debug"}})
    assert (chosen.log_format, chosen.log_level) == ("json", "debug")
    for wrong in ({"logFormat": "yaml"}, {"logLevel": "trace"}):
        with pytest.raises(helm.HelmError, match="log(Format|Level)"):
            render(chart, {"operator": wrong})
