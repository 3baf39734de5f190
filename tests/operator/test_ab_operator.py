"""Strategy ABTest end to end: kopf against the local API server, and the arms' metrics from
real exporters — through a real Prometheus, or scraped directly from the pods' /metrics.

Each arm's exporter serves vLLM's prefix-cache counters and TTFT histogram under their real names;
a background task plays steady traffic. The operator rolls the treatment out, measures every
interval, and promotes, rolls back or reports what stops it, with the evidence in the status.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from moonlease_dev.testbed.kube import CONFIGMAPS, DEPLOYMENTS, LocalApiServer, deployment_manifest, is_rollout_complete
from moonlease_settings.settings_file import SETTINGS_FILE_NAME
from moonlease_operator.core.connector_delivery import settings_config_map_name
from moonlease_dev.testbed.prometheus import PrometheusServer
from moonlease_operator.runner import OperatorThread
from tests.fixtures.kube import FAST_OPTIONS
from tests.operator.fleet import MASTER, NS, condition, phase, policy, reasons, status
from tests.operator.test_ab_metric_sources import ArmExporter

def settings_file(kube: LocalApiServer, name: str) -> str | None:
    """The connector settings file a workload's pods read."""
    return ((kube.get(CONFIGMAPS, NS, settings_config_map_name(name)) or {}).get("data") or {}).get(SETTINGS_FILE_NAME)


pytestmark = pytest.mark.prometheus

CONTROL, TREATMENT = ["prefill-a", "decode-a"], ["prefill-b", "decode-b"]
WAIT = 60.0


def ab_policy(**ab: Any) -> dict[str, Any]:
    spec = {
        "master": {"name": "mooncake-master"},
        "connector": {"leaseMode": "selective"},
        "targets": [{"name": n, "role": n.split("-")[0], "container": "vllm", "mooncakeVersion": "0.3.14"}
                    for n in CONTROL + TREATMENT],
        "rollout": {"strategy": "ABTest", "stageTimeoutSeconds": 30, "abTest": {
            "control": {"workloads": CONTROL}, "treatment": {"workloads": TREATMENT},
            "intervalSeconds": 5, "warmupSeconds": 0, "minSamples": 3, "maxSamples": 6,
            "conditions": [{"metric": "externalHitRate", "minEffect": 0.05, "maxRegression": 0.05},
                           {"metric": "ttftP90", "direction": "LowerIsBetter", "maxRegression": 0.5,
                            "guardrail": True}],
            **ab}},
    }
    return policy("ab", spec)


async def create_arms(kube: LocalApiServer, ports: dict[str, int]) -> dict[str, dict[str, Any]]:
    """The master and four vLLM Deployments; each arm's pods say where their /metrics is."""
    await kube.create(copy.deepcopy(MASTER))
    for name in CONTROL + TREATMENT:
        manifest = deployment_manifest(name, replicas=1, containers=[
            {"name": "vllm", "image": "registry.local/vllm:0.9.1", "args": ["serve", "/models/tiny"]}])
        arm = "control" if name in CONTROL else "treatment"
        manifest["spec"]["template"]["metadata"]["annotations"] = {"prometheus.io/port": str(ports[arm])}
        await kube.create(manifest)
    names = ["mooncake-master", *CONTROL, *TREATMENT]
    await kube.wait_for(lambda: all(is_rollout_complete(kube.get(DEPLOYMENTS, NS, n) or {}) for n in names),
                        timeout=10, what="the arms to settle")
    return {n: copy.deepcopy((kube.get(DEPLOYMENTS, NS, n) or {})["spec"]["template"]) for n in names}


@contextlib.asynccontextmanager
async def traffic(control: ArmExporter, treatment: ArmExporter, *, control_rate: float,
                  treatment_rate: float) -> AsyncIterator[None]:
    """Both arms serve steady traffic (1000 tokens, 20 requests per arm every 0.5 s)."""
    async def play() -> None:
        tick = 0
        while True:
            jitter = 0.01 if tick % 2 else -0.01
            control.serve(hit_rate=control_rate + jitter)
            treatment.serve(hit_rate=treatment_rate - jitter)
            tick += 1
            await asyncio.sleep(0.5)

    task = asyncio.create_task(play())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def ab_status(kube: LocalApiServer) -> dict[str, Any]:
    return status(kube, "ab").get("abTest") or {}


def template(kube: LocalApiServer, name: str) -> dict[str, Any]:
    return (kube.get(DEPLOYMENTS, NS, name) or {})["spec"]["template"]


@pytest.fixture
def exporters(metrics_exporter: Callable[[], tuple[CollectorRegistry, str]]) -> tuple[ArmExporter, ArmExporter]:
    return ArmExporter(*metrics_exporter()), ArmExporter(*metrics_exporter())


def port_of(exporter: ArmExporter) -> int:
    return int(exporter.address.rsplit(":", 1)[1])


async def test_prometheus_measured_win_promotes_the_treatment_to_the_control(
        kube: LocalApiServer, prometheus: Callable[..., PrometheusServer],
        exporters: tuple[ArmExporter, ArmExporter]) -> None:
    control, treatment = exporters
    server = prometheus({"control": [control.address], "treatment": [treatment.address]})
    await create_arms(kube, {"control": port_of(control), "treatment": port_of(treatment)})
    spec = ab_policy(prometheus={"url": server.url, "selectors": {"control": 'job="control"',
                                                                  "treatment": 'job="treatment"'}})
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS) as operator, \
            traffic(control, treatment, control_rate=0.3, treatment_rate=0.6):
        await kube.create(spec)
        await kube.wait_for(lambda: phase(kube, "ab") == "Analyzing", timeout=WAIT, what="measuring")
        # the control is untouched while the treatment runs the new configuration
        assert "moonlease.io/config-hash" not in (template(kube, "decode-a")["metadata"].get("annotations") or {})
        assert "moonlease.io/config-hash" in (template(kube, "decode-b")["metadata"].get("annotations") or {})
        await kube.wait_for(lambda: phase(kube, "ab") == "Ready", timeout=WAIT, what="promotion")
        await kube.wait_for(lambda: "ABTestPromoted" in reasons(kube, "ab"), timeout=5, what="the event")
    ab = ab_status(kube)
    assert ab["phase"] == "Promoted" and ab["verdict"] == "Success" and ab["samples"] >= 3
    assert ab["control"]["externalHitRate"] == pytest.approx(0.3, abs=0.03)
    assert ab["treatment"]["externalHitRate"] == pytest.approx(0.6, abs=0.03)
    assert ab["history"] and ab["analysis"]["samples"] == ab["samples"]
    # the reason quotes the measured rates; the traffic alternates ±0.01 and a slow tick can put
    # one more low tick than high into an interval, so the value is 0.6 give or take (not "0.6…")
    quoted = re.search(r"externalHitRate: treatment ([0-9.]+) vs control ([0-9.]+)", ab["reason"])
    assert quoted, ab["reason"]
    assert float(quoted[1]) == pytest.approx(0.6, abs=0.03) and float(quoted[2]) == pytest.approx(0.3, abs=0.03)
    for a, b in zip(CONTROL, TREATMENT):  # the same settings file, each mounted from its own ConfigMap
        assert settings_file(kube, a) == settings_file(kube, b) is not None
        assert template(kube, a)["spec"]["containers"] == template(kube, b)["spec"]["containers"]
    got = reasons(kube, "ab")
    for reason in ("ABTestStarted", "ABTestVerdict", "ABTestPromoting", "ABTestPromoted", "RolloutComplete"):
        assert reason in got, (reason, got)
    assert condition(kube, "ABTestConcluded", "ab")["reason"] == "ABTestPromoted"
    registry = operator.metrics.registry
    labels = {"namespace": NS, "policy": "ab"}
    assert registry.get_sample_value("moonlease_operator_ab_test_phase", {**labels, "phase": "Promoted"}) == 1
    assert registry.get_sample_value("moonlease_operator_ab_test_samples", labels) == ab["samples"]
    # Structured results: per condition, in the status and as gauges.
    assert ab["finalVerdict"] == "Success" and ab["progress"] == f"{ab['samples']}/6"
    hit_rate = next(c for c in ab["conditions"] if c["metric"] == "externalHitRate")
    # (the exporters serve exact rates: when every interval shows the same difference the
    # standard error is 0 and the interval has no width — certain, by `always_valid_p`)
    assert hit_rate["outcome"] == "Success" and 0 < hit_rate["lower"] <= hit_rate["effect"] <= hit_rate["upper"]
    assert hit_rate["effect"] == pytest.approx(0.3, abs=0.03)
    assert registry.get_sample_value("moonlease_operator_ab_test_verdict", {**labels, "verdict": "Success"}) == 1
    assert registry.get_sample_value("moonlease_operator_ab_test_effect", {
        **labels, "metric": "externalHitRate", "bound": "lower"}) == pytest.approx(hit_rate["lower"])


async def test_scraped_regression_rolls_the_treatment_back(
        kube: LocalApiServer, exporters: tuple[ArmExporter, ArmExporter]) -> None:
    control, treatment = exporters
    originals = await create_arms(kube, {"control": port_of(control), "treatment": port_of(treatment)})
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS), \
            traffic(control, treatment, control_rate=0.6, treatment_rate=0.3):
        await kube.create(ab_policy())  # no Prometheus: the pods' /metrics, on their prometheus.io/port
        await kube.wait_for(lambda: phase(kube, "ab") == "Degraded", timeout=WAIT, what="rollback")
        await kube.wait_for(lambda: all(template(kube, n) == originals[n] for n in TREATMENT), timeout=WAIT,
                            what="the treatment restored")
        await kube.wait_for(lambda: "ABTestRolledBack" in reasons(kube, "ab"), timeout=5, what="the event")
    ab = ab_status(kube)
    assert ab["phase"] == "RolledBack" and ab["verdict"] == "Failure"
    assert all(template(kube, n) == originals[n] for n in CONTROL + TREATMENT)
    degraded = condition(kube, "Degraded", "ab")
    assert degraded["reason"] == "ABTestRolledBack" and "externalHitRate" in degraded["message"]
    got = reasons(kube, "ab")
    assert got.index("ABTestVerdict") < got.index("ABTestRollingBack") < got.index("ABTestRolledBack")


async def test_prometheus_down_then_back_resumes_measuring_and_decides(
        kube: LocalApiServer, prometheus: Callable[..., PrometheusServer],
        exporters: tuple[ArmExporter, ArmExporter]) -> None:
    control, treatment = exporters
    server = prometheus({"control": [control.address], "treatment": [treatment.address]})
    await create_arms(kube, {"control": port_of(control), "treatment": port_of(treatment)})
    spec = ab_policy(prometheus={"url": server.url, "selectors": {"control": 'job="control"',
                                                                  "treatment": 'job="treatment"'}},
                     consecutiveErrorLimit=1, minSamples=3, maxSamples=10)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS), \
            traffic(control, treatment, control_rate=0.3, treatment_rate=0.6):
        await kube.create(spec)
        await kube.wait_for(lambda: ab_status(kube).get("lastMeasuredAt") is not None, timeout=WAIT,
                            what="the baseline")
        server.stop()  # Prometheus restarts: reads fail
        await kube.wait_for(lambda: ab_status(kube).get("verdict") == "Error", timeout=WAIT,
                            what="the Error verdict")
        concluded = condition(kube, "ABTestConcluded", "ab")
        assert concluded["reason"] == "MeasurementFailed" and server.url in concluded["message"]
        assert "measuring resumes when the metric source answers" in concluded["message"]
        assert phase(kube, "ab") == "Analyzing" and ab_status(kube).get("finalVerdict") is None
        errors = [h["error"] for h in ab_status(kube)["history"] if h.get("error")]
        assert errors and all(len(e) <= 120 and "\n" not in e for e in errors)
        server.start()  # back: the same test resumes and decides on good measurements
        await kube.wait_for(lambda: phase(kube, "ab") == "Ready", timeout=2 * WAIT, what="promotion after the outage")
    ab = ab_status(kube)
    assert ab["verdict"] == "Success" and ab["samples"] >= 3 and ab["consecutiveErrors"] == 0
    assert "MeasurementFailed" in reasons(kube, "ab")


async def test_the_baseline_waits_out_the_warm_up(kube: LocalApiServer,
                                                  exporters: tuple[ArmExporter, ArmExporter]) -> None:
    control, treatment = exporters
    await create_arms(kube, {"control": port_of(control), "treatment": port_of(treatment)})
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS), \
            traffic(control, treatment, control_rate=0.3, treatment_rate=0.6):
        await kube.create(ab_policy(warmupSeconds=6))  # scraping the pods
        await kube.wait_for(lambda: ab_status(kube).get("startedAt") is not None, timeout=WAIT, what="measuring")
        await asyncio.sleep(3)
        assert ab_status(kube).get("lastMeasuredAt") is None  # still warming up
        await kube.wait_for(lambda: ab_status(kube).get("lastMeasuredAt") is not None, timeout=WAIT,
                            what="the baseline")
    ab = ab_status(kube)
    started, baseline = (datetime.datetime.fromisoformat(ab[k].replace("Z", "+00:00"))
                         for k in ("startedAt", "lastMeasuredAt"))
    assert (baseline - started).total_seconds() >= 6
    assert any("after a 6s warm-up" in (e.get("message") or "") for e in kube.events(NS, involved_name="ab"))


async def refused_before_any_fetch(kube: LocalApiServer, exporters: tuple[ArmExporter, ArmExporter],
                                   policies: dict[str, tuple[dict[str, Any], str]], *,
                                   cel_rules: bool = True) -> dict[str, dict[str, Any]]:
    """Creates each policy ({name: (body, the reason expected)}) with kopf running, waits until
    each is Invalid with its reason's event, checks that nothing was measured or rolled out, and
    returns each one's Invalid condition. `cel_rules` False: the API server stores what breaks a
    CEL rule, so the operator's mirror must refuse it."""
    control, treatment = exporters
    await create_arms(kube, {"control": port_of(control), "treatment": port_of(treatment)})
    if not cel_rules:
        kube.emulator.cel_rules = False
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        for name, (body, _) in policies.items():
            body["metadata"]["name"] = name
            await kube.create(body)
        await kube.wait_for(lambda: all(phase(kube, n) == "Invalid" for n in policies), timeout=WAIT,
                            what="every policy refused")
        await kube.wait_for(lambda: all(reason in reasons(kube, n) for n, (_, reason) in policies.items()),
                            timeout=5, what="events")
    for name in policies:
        assert not status(kube, name).get("abTest", {}).get("lastMeasuredAt")
    assert all("moonlease.io/config-hash" not in (template(kube, n)["metadata"].get("annotations") or {})
               for n in CONTROL + TREATMENT)  # nothing rolled out
    return {name: condition(kube, "Invalid", name) for name in policies}


async def test_a_query_with_a_stray_dollar_or_a_foreign_prometheus_is_refused_before_any_fetch(
        kube: LocalApiServer, exporters: tuple[ArmExporter, ArmExporter]) -> None:
    dollar = ab_policy(prometheus={"url": "http://127.0.0.1:9", "customQueries": {
        "ttft": "histogram_quantile(0.9, sum by (le) (rate(x_bucket{$selector}[$__rate_interval])))"}})
    foreign = ab_policy(prometheus={"url": "http://169.254.169.254/latest"})
    # the stray $ breaks a CEL rule: here the operator's mirror must refuse it
    refused = await refused_before_any_fetch(kube, exporters, {
        "ab": (dollar, "InvalidSpec"), "ab-foreign": (foreign, "PrometheusUrlNotAllowed")}, cel_rules=False)
    assert refused["ab"]["reason"] == "InvalidSpec" and "write $$ for a literal $" in refused["ab"]["message"]
    assert refused["ab-foreign"]["reason"] == "PrometheusUrlNotAllowed"
    assert "169.254.169.254" in refused["ab-foreign"]["message"]
    assert "--prometheus-url-allow" in refused["ab-foreign"]["message"]


async def test_a_raw_counter_query_and_reordered_arm_selectors_are_refused_before_any_fetch(
        kube: LocalApiServer, exporters: tuple[ArmExporter, ArmExporter]) -> None:
    """Issue 26 item 6, the operator's own refusals (the API server's CEL on: these pass it)."""
    counter = ab_policy(prometheus={"url": "http://127.0.0.1:9", "customQueries": {
        "hits": "sum(vllm:prefix_cache_hits_total{$selector})"}},
        conditions=[{"metric": "hits", "minEffect": 1}])
    same = ab_policy(prometheus={"url": "http://127.0.0.1:9", "selectors": {
        "control": 'job="vllm", ns="a"', "treatment": 'ns="a", job="vllm"'}})
    refused = await refused_before_any_fetch(kube, exporters, {
        "ab-counter": (counter, "CounterWithoutRate"), "ab-same": (same, "IdenticalArmSelectors")})
    assert refused["ab-counter"]["reason"] == "CounterWithoutRate"
    assert "increase(vllm:prefix_cache_hits_total{$selector}[5s])" in refused["ab-counter"]["message"]
    assert refused["ab-same"]["reason"] == "IdenticalArmSelectors"
    assert "give each arm its own matchers" in refused["ab-same"]["message"]


async def test_missing_metrics_give_no_decision_and_a_clear_condition(
        kube: LocalApiServer, metrics_exporter: Callable[[], tuple[CollectorRegistry, str]]) -> None:
    # vLLM without a KV connector exposes no external (store) prefix-cache counters
    control, treatment = ArmExporter(*metrics_exporter(), external=False), ArmExporter(*metrics_exporter(), external=False)
    await create_arms(kube, {"control": port_of(control), "treatment": port_of(treatment)})
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS), \
            traffic(control, treatment, control_rate=0.3, treatment_rate=0.9):
        await kube.create(ab_policy(maxSamples=4))
        await kube.wait_for(lambda: condition(kube, "ABTestConcluded", "ab").get("reason") == "ABTestNoData",
                            timeout=WAIT, what="the NoData condition")
        message = condition(kube, "ABTestConcluded", "ab")["message"]
        assert "externalHitRate: no data for control and treatment" in message
        assert phase(kube, "ab") == "Analyzing"
        await kube.wait_for(lambda: phase(kube, "ab") == "AwaitingDecision", timeout=WAIT, what="holding")
    ab = ab_status(kube)
    assert ab["verdict"] == "NoData" and ab["action"] == "Hold"
    assert ab["treatment"].get("externalHitRate") is None and ab["treatment"]["prefixHitRate"] > 0.8
    assert "moonlease.io/config-hash" not in (template(kube, "decode-a")["metadata"].get("annotations") or {})


@pytest.mark.parametrize("next_attempt", ["retry", "new configuration"])
async def test_a_retried_test_starts_at_zero_and_waits_out_its_warm_up(
        kube: LocalApiServer, exporters: tuple[ArmExporter, ArmExporter], next_attempt: str) -> None:
    """After `moonlease retry`, or a new configuration, the test used to show the previous
    attempt's counts and be decided after one interval, its first interval read seconds after the
    start — the status merge patch left the old attempt's nested fields in place."""
    from moonlease_operator.api import VERB_ANNOTATION
    from moonlease_operator.core.verbs import Verb, build_verb_value

    control, treatment = exporters
    await create_arms(kube, {"control": port_of(control), "treatment": port_of(treatment)})
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS), \
            traffic(control, treatment, control_rate=0.6, treatment_rate=0.3):
        await kube.create(ab_policy(warmupSeconds=4))
        await kube.wait_for(lambda: phase(kube, "ab") == "Degraded", timeout=WAIT, what="the first attempt rolled back")
        first = ab_status(kube)
        assert first["samples"] >= 3 and first["analysis"]["samples"] == first["samples"]
        policy_status = status(kube, "ab")
        if next_attempt == "retry":
            await kube.patch("mlp", NS, "ab", {"metadata": {"annotations": {VERB_ANNOTATION: build_verb_value(
                Verb.RETRY, policy_status["revision"], policy_status["desiredConfigHash"])}}})
        else:
            await kube.patch("mlp", NS, "ab", {"spec": {"connector": {"leaseMode": "selective",
                                                                      "junctionRetention": True}}})
        await kube.wait_for(lambda: ab_status(kube).get("startedAt") not in (None, first["startedAt"]),
                            timeout=WAIT, what="the retried test measuring")
        fresh = ab_status(kube)
        assert fresh["samples"] == 0 and fresh.get("analysis") is None and fresh.get("lastMeasuredAt") is None
        assert fresh.get("verdict") is None and not fresh.get("history") and not fresh.get("conditions")
        await kube.wait_for(lambda: ab_status(kube).get("lastMeasuredAt") is not None, timeout=WAIT,
                            what="the retried test's baseline")
        baseline = ab_status(kube)
        started, read = (datetime.datetime.fromisoformat(baseline[k].replace("Z", "+00:00"))
                         for k in ("startedAt", "lastMeasuredAt"))
        assert (read - started).total_seconds() >= 4 and baseline["samples"] == 0
        await kube.wait_for(lambda: ab_status(kube).get("samples", 0) >= 1, timeout=WAIT, what="a first interval")
        one = ab_status(kube)
        assert one["analysis"]["samples"] == one["samples"] and one["progress"] == f"{one['samples']}/6"
