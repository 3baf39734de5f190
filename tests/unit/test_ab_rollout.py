"""Strategy ABTest through the rollout state machine: the treatment rolls out stage by stage while
the control is held untouched, measured intervals decide, and the decision is carried out by the
same staged machinery — promotion rolls the treatment's configuration out to the control,
rollback restores the treatment (never the shared master), a hold waits for an annotation.

The cluster is test_rollout_plan's `Cluster`; the handler's measurements are played by readings
handed to `reconcile` when the planner says one is due.
"""

from __future__ import annotations

import copy
import datetime
from typing import Any

import pytest

from moonlease_operator.api import AB_DECISION_ANNOTATION, ABTestPhase, Phase, read_spec
from moonlease_operator.core.ab_plan import ABReading
from moonlease_operator.core.analysis import ArmSample, IntervalSample
from moonlease_settings.settings_file import SETTINGS_FILE_NAME
from moonlease_operator.core.connector_delivery import settings_config_map_name
from tests.unit.test_rollout_plan import Cluster, deployment, master_deployment, template

pytestmark = pytest.mark.unit

CONTROL, TREATMENT = ["prefill-a", "decode-a"], ["prefill-b", "decode-b"]
SPEC: dict[str, Any] = {
    "master": {"name": "mooncake-master", "evictionRatio": 0.1, "requireApprovalForRestart": False},
    "connector": {"leaseMode": "selective"},
    "targets": [{"name": n, "role": n.split("-")[0], "mooncakeVersion": "0.3.14"} for n in CONTROL + TREATMENT],
    "rollout": {"strategy": "ABTest", "stageTimeoutSeconds": 60, "abTest": {
        "control": {"workloads": CONTROL}, "treatment": {"workloads": TREATMENT},
        "intervalSeconds": 10, "warmupSeconds": 0, "minSamples": 3, "maxSamples": 6,
        "conditions": [{"metric": "externalHitRate", "minEffect": 0.05, "maxRegression": 0.05}]}},
}


def ab_spec(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["rollout"]["abTest"].update(changes)
    return spec


def ab_fleet() -> Cluster:
    return Cluster(master_deployment(), *(deployment(n) for n in CONTROL + TREATMENT))


def reading(cluster: Cluster, control_rate: float | None, treatment_rate: float, i: int) -> ABReading:
    """An interval ending now (control_rate None: the control's series were missing)."""
    def arm(rate: float) -> ArmSample:
        return ArmSample(external_hits=rate * 1000 + (i % 2) * 5, external_queries=1000)

    end = cluster.now.timestamp()
    control = arm(control_rate) if control_rate is not None else None
    return ABReading(cluster.now, IntervalSample(end - 10, end, control, arm(treatment_rate),
                                                 error=None if control is not None else "no series for the control arm"))


def runs(cluster: Cluster, name: str) -> tuple[Any, Any]:
    """What a workload's pods run: the settings file its connector reads (live settings), and
    whether its pod template mounts it (not the workload's own labels or ConfigMap name)."""
    data = (cluster.config_maps.get(settings_config_map_name(name)) or {}).get("data") or {}
    volumes = template(cluster, name)["spec"].get("volumes") or []
    return data.get(SETTINGS_FILE_NAME), [v["name"] for v in volumes]


def deploy_treatment(cluster: Cluster, spec: dict[str, Any]) -> None:
    cluster.run(spec)
    assert cluster.status.ab_test is not None and cluster.status.ab_test.phase is ABTestPhase.MEASURING


def measure(cluster: Cluster, spec: dict[str, Any], rates: list[tuple[float | None, float]]) -> None:
    """The baseline, then one interval per (control, treatment) pair, each settled and reconciled."""
    cluster.reconcile(spec, ab_reading=ABReading(cluster.now, None))
    for i, (control, treatment) in enumerate(rates):
        cluster.now += datetime.timedelta(seconds=10)
        cluster.reconcile(spec, ab_reading=reading(cluster, control, treatment, i))
        for key in cluster.workloads:
            cluster.settle(key[1])


def test_the_treatment_rolls_out_while_the_control_is_held_untouched() -> None:
    cluster = ab_fleet()
    originals = {n: copy.deepcopy(template(cluster, n)) for n in CONTROL}
    deploy_treatment(cluster, SPEC)
    status = cluster.status
    assert status.phase is Phase.ANALYZING and status.ab_test is not None
    assert {n: template(cluster, n) for n in CONTROL} == originals
    assert all(runs(cluster, n) != runs(cluster, c) for n, c in zip(TREATMENT, CONTROL))
    assert status.targets_total == 1 + len(TREATMENT)  # the master and the treatment: the control is held
    assert status.applied_config_hash is None  # only the treatment runs it
    concluded = status.condition("ABTestConcluded")
    assert concluded is not None and (concluded.status.value, concluded.reason) == ("False", "ABTestMeasuring")
    assert "ABTestStarted" in cluster.reasons()
    # measuring reconciles write nothing to the workloads
    writes = len(cluster.writes)
    measure(cluster, SPEC, [(0.5, 0.5)])
    assert len(cluster.writes) == writes and cluster.status.ab_test.samples == 1


def test_a_clear_win_promotes_the_treatment_to_the_control_stage_by_stage() -> None:
    cluster = ab_fleet()
    deploy_treatment(cluster, SPEC)
    measure(cluster, SPEC, [(0.4, 0.7)] * 2)
    # While measuring: structured per-condition results, no final verdict (the VERDICT column is empty).
    measuring = cluster.status.ab_test
    assert measuring.final_verdict is None and measuring.verdict == "Inconclusive" and measuring.progress == "2/6"
    # Both arms move together (the same +5 every other interval): the paired difference is exact
    # already, yet the verdict waits for minSamples.
    [hit_rate] = measuring.conditions
    assert (hit_rate.metric, hit_rate.outcome) == ("externalHitRate", "Success")
    assert hit_rate.effect == pytest.approx(0.3, abs=0.01) and hit_rate.control == pytest.approx(0.4, abs=0.01)
    assert hit_rate.lower is not None and hit_rate.upper is not None and hit_rate.lower <= hit_rate.effect <= hit_rate.upper
    assert hit_rate.paired and hit_rate.samples == 2 and hit_rate.threshold == pytest.approx(0.05)  # SPEC's minEffect
    assert hit_rate.level == pytest.approx(0.05) and 0 <= hit_rate.p_value <= 1
    cluster.now += datetime.timedelta(seconds=10)
    plan = cluster.reconcile(SPEC, ab_reading=reading(cluster, 0.4, 0.7, 2))
    decided = cluster.status.ab_test
    assert decided.final_verdict == "Success" and decided.progress == "3/6"
    assert decided.conditions[0].outcome == "Success" and decided.conditions[0].lower > 0
    assert cluster.status.ab_test.phase is ABTestPhase.PROMOTING
    assert [c.name for c in plan.changes] == ["prefill-a-moonlease", "prefill-a"]  # the control's first stage
    assert any("promoting the A/B treatment's configuration" in m for _, _, m in cluster.events)
    status = cluster.run(SPEC)
    assert status.phase is Phase.READY and status.ab_test.phase is ABTestPhase.PROMOTED
    assert status.applied_config_hash == status.desired_config_hash
    assert runs(cluster, "prefill-a") == runs(cluster, "prefill-b")
    assert runs(cluster, "decode-a") == runs(cluster, "decode-b")
    assert cluster.reasons().count("ABTestPromoted") == 1
    verdict = [m for _, r, m in cluster.events if r == "ABTestVerdict"]
    assert verdict and verdict[-1].startswith("Success after 3 samples: externalHitRate: treatment 0.70")
    assert status.ab_test.control.external_hit_rate == pytest.approx(0.4, abs=0.01)
    assert [h.treatment.external_hit_rate for h in status.ab_test.history][:1] == [0.7]
    concluded = status.condition("ABTestConcluded")
    assert concluded is not None and (concluded.status.value, concluded.reason) == ("True", "ABTestPromoted")


def test_a_regression_rolls_the_treatment_back_but_never_the_shared_master() -> None:
    cluster = ab_fleet()
    originals = {n: copy.deepcopy(template(cluster, n)) for n in CONTROL + TREATMENT}
    deploy_treatment(cluster, SPEC)
    master = copy.deepcopy(template(cluster, "mooncake-master"))
    measure(cluster, SPEC, [(0.7, 0.4)] * 3)
    status = cluster.run(SPEC)
    assert status.phase is Phase.DEGRADED and status.ab_test.phase is ABTestPhase.ROLLED_BACK
    assert {n: template(cluster, n) for n in CONTROL + TREATMENT} == originals
    assert template(cluster, "mooncake-master") == master
    assert {s.name.value: s.phase.value for s in status.stages} == {
        "master": "Succeeded", "prefill": "RolledBack", "decode": "RolledBack"}
    degraded = status.condition("Degraded")
    assert degraded is not None and degraded.reason == "ABTestRolledBack" and "Failure" in degraded.message
    assert [r for r in cluster.reasons() if r.startswith("ABTest")][-3:] == [
        "ABTestVerdict", "ABTestRollingBack", "ABTestRolledBack"]
    assert "MasterRestart" not in cluster.reasons()[cluster.reasons().index("ABTestRollingBack"):]
    # at rest: nothing more is written, and the verdict stays
    writes = len(cluster.writes)
    cluster.run(SPEC)
    assert len(cluster.writes) == writes and cluster.status.phase is Phase.DEGRADED


def test_rollback_happens_even_when_staged_failures_halt() -> None:
    cluster = ab_fleet()
    spec = ab_spec()
    spec["rollout"]["onFailure"] = "halt"
    originals = {n: copy.deepcopy(template(cluster, n)) for n in TREATMENT}
    deploy_treatment(cluster, spec)
    measure(cluster, spec, [(0.7, 0.4)] * 3)
    cluster.run(spec)
    assert {n: template(cluster, n) for n in TREATMENT} == originals


def test_an_inconclusive_test_holds_until_an_annotation_decides_it() -> None:
    cluster = ab_fleet()
    deploy_treatment(cluster, SPEC)
    measure(cluster, SPEC, [(0.5, 0.5)] * 6)
    status = cluster.run(SPEC)
    assert status.phase is Phase.AWAITING_DECISION and status.ab_test.verdict == "Inconclusive"
    ready = status.condition("Ready")
    config_hash = status.ab_test.config_hash
    assert ready is not None and f"{AB_DECISION_ANNOTATION}=promote:{config_hash}" in ready.message
    cluster.annotations[AB_DECISION_ANNOTATION] = "promote:stale"
    assert cluster.run(SPEC).phase is Phase.AWAITING_DECISION
    cluster.annotations[AB_DECISION_ANNOTATION] = f"promote:{config_hash}"
    status = cluster.run(SPEC)
    assert status.phase is Phase.READY and status.ab_test.phase is ABTestPhase.PROMOTED
    assert runs(cluster, "decode-a") == runs(cluster, "decode-b")


def test_failed_measurements_are_reported_and_never_decide() -> None:
    cluster = ab_fleet()
    deploy_treatment(cluster, ab_spec(consecutiveErrorLimit=2))
    spec = ab_spec(consecutiveErrorLimit=2)
    measure(cluster, spec, [(None, 0.9)] * 2)
    status = cluster.status
    assert status.phase is Phase.ANALYZING and status.ab_test.samples == 0
    concluded = status.condition("ABTestConcluded")
    assert concluded is not None and concluded.reason == "MeasurementFailed"
    assert cluster.reasons().count("MeasurementFailed") == 2
    measure(cluster, spec, [(None, 0.9)])
    status = cluster.run(spec)
    assert status.ab_test.verdict == "Error" and status.phase is Phase.ANALYZING  # still measuring
    concluded = status.condition("ABTestConcluded")
    assert concluded is not None and concluded.reason == "MeasurementFailed"
    assert "measuring resumes when the metric source answers" in concluded.message
    # the source is back: the test resumes, and decides on good measurements only
    measure(cluster, spec, [(0.4, 0.7)] * 3)
    status = cluster.run(spec)
    assert status.ab_test.verdict == "Success" and status.ab_test.samples == 3
    assert any("Measuring again" in message for _, _, message in cluster.events)


def test_a_new_configuration_starts_a_new_test_and_the_promoted_control_is_kept_meanwhile() -> None:
    cluster = ab_fleet()
    deploy_treatment(cluster, SPEC)
    measure(cluster, SPEC, [(0.4, 0.7)] * 3)
    cluster.run(SPEC)
    promoted = copy.deepcopy(runs(cluster, "decode-a"))
    spec = copy.deepcopy(SPEC)
    spec["connector"]["junctionRetention"] = True
    status = cluster.run(spec)
    assert status.ab_test.phase is ABTestPhase.MEASURING and status.ab_test.samples == 0
    assert runs(cluster, "decode-a") == promoted  # held, not released back to the original
    assert runs(cluster, "decode-b") != promoted


def test_switching_to_staged_mid_test_rolls_the_configuration_out_to_everyone() -> None:
    cluster = ab_fleet()
    deploy_treatment(cluster, SPEC)
    staged = copy.deepcopy(SPEC)
    staged["rollout"] = {"stageTimeoutSeconds": 60}
    status = cluster.run(staged)
    assert status.phase is Phase.READY and status.ab_test is None
    assert status.condition("ABTestConcluded") is None
    assert runs(cluster, "decode-a") == runs(cluster, "decode-b")


def test_every_ab_status_fits_the_crd() -> None:
    import jsonschema

    from moonlease_operator.crd import build_crd, validation_schema

    validator = jsonschema.Draft4Validator(validation_schema(build_crd(), strict=True))
    seen = set()
    for rates in ([(0.4, 0.7)] * 3, [(0.7, 0.4)] * 3, [(None, 0.5)] + [(0.5, 0.5)] * 6):
        cluster = ab_fleet()
        deploy_treatment(cluster, SPEC)
        measure(cluster, SPEC, rates)
        cluster.run(SPEC)
        present = {k: v for k, v in cluster.status_json.items() if v is not None}
        validator.validate({"apiVersion": "moonlease.io/v1alpha1", "kind": "MooncakeLeasePolicy",
                            "metadata": {"name": "fleet"}, "spec": SPEC, "status": present})
        seen.add(cluster.status.ab_test.phase)
    assert seen == {ABTestPhase.PROMOTED, ABTestPhase.ROLLED_BACK, ABTestPhase.AWAITING_DECISION}


def test_arms_of_different_roles_are_refused_with_a_message() -> None:
    cluster = ab_fleet()
    spec = ab_spec(control={"workloads": ["prefill-a", "decode-a"]}, treatment={"workloads": ["decode-b"]})
    spec["targets"] = [t for t in spec["targets"] if t["name"] != "prefill-b"]
    status = cluster.run(spec)
    assert status.phase is Phase.INVALID
    invalid = status.condition("Invalid")
    assert invalid is not None and invalid.reason == "MismatchedArms"
    assert "control has decode, prefill, treatment has decode" in invalid.message
    assert "MismatchedArms" in cluster.reasons() and not cluster.writes


@pytest.mark.parametrize("query, refused", [
    ("sum(rate(x{$selector}[5m]))", True),  # read every 10 s: every interval re-counts 5 minutes
    ("sum(increase(x{$selector}[10s]))", False),
    ("max_over_time(rate(x{$selector}[5s])[1m:5s])", True),  # a subquery's range counts
    ("sum(x{$selector})", False),
])
def test_a_custom_query_reading_past_the_interval_is_refused(query: str, refused: bool) -> None:
    cluster = ab_fleet()
    spec = ab_spec(prometheus={"url": "http://prometheus:9090", "customQueries": {"m": query}},
                   conditions=[{"metric": "m", "minEffect": 0.05}])
    status = cluster.run(spec)
    invalid = status.condition("Invalid")
    if refused:
        assert status.phase is Phase.INVALID and invalid is not None and invalid.reason == "OverlappingQueryWindows"
        assert "prometheus.customQueries.m reads a" in invalid.message and "longer than intervalSeconds (10s)" in invalid.message
        assert not cluster.writes
    else:
        assert status.phase is not Phase.INVALID


@pytest.mark.parametrize("query, counter", [
    ("sum(vllm:prefix_cache_hits_total{$selector})", "vllm:prefix_cache_hits_total"),
    ("sum(increase(a_total{$selector}[10s])) / sum(a_total{$selector})", "a_total"),
    ("histogram_quantile(0.9, sum by (le) (x_bucket{$selector}))", "x_bucket"),
    ('sum({__name__=~"vllm[:_]prefix_cache_queries_total", $selector})', "vllm[:_]prefix_cache_queries_total"),
    ("sum(increase(vllm:prefix_cache_hits_total{$selector}[10s]))", None),
    ("histogram_quantile(0.9, sum by (le) (rate(x_bucket{$selector}[10s])))", None),
    ("sum(vllm:num_requests_waiting{$selector})", None),  # a gauge
    ("sum(master_key_count{$selector})", None),  # a gauge despite its suffix: _count is not checked
    ("sum by (x_total) (irate(y_total{$selector}[10s]))", None),  # a label list, a rated counter
])
def test_a_custom_query_over_a_raw_counter_is_refused(query: str, counter: str | None) -> None:
    """Issue 26: a counter read without rate()/increase() is its total since the engine started:
    the arms would be compared on their uptime."""
    cluster = ab_fleet()
    spec = ab_spec(prometheus={"url": "http://prometheus:9090", "customQueries": {"m": query}},
                   conditions=[{"metric": "m", "minEffect": 0.05}])
    status = cluster.run(spec)
    invalid = status.condition("Invalid")
    if counter is None:
        assert status.phase is not Phase.INVALID, invalid
        return
    assert status.phase is Phase.INVALID and invalid is not None and invalid.reason == "CounterWithoutRate"
    assert f"prometheus.customQueries.m reads the counter {counter} without rate()" in invalid.message
    assert f"increase({counter}{{$selector}}[10s])" in invalid.message  # what to write instead
    assert "CounterWithoutRate" in cluster.reasons() and not cluster.writes


@pytest.mark.parametrize("field, control, treatment, refused", [
    ("selectors", 'job="vllm", ns="a"', 'ns = "a",job="vllm"', True),  # the same matchers, reordered
    ("selectors", "job='vllm'", 'job="vllm"', True),
    ("selectors", 'job="vllm-a"', 'job="vllm-b"', False),
    ("storeSelectors", 'job="m",  pod="x"', 'pod="x", job="m"', True),
])
def test_arm_selectors_that_pick_the_same_series_are_refused(field: str, control: str, treatment: str,
                                                              refused: bool) -> None:
    """The API server refuses identical text; the operator refuses the same matchers written
    differently (both arms would read the same numbers: no condition could ever fail)."""
    cluster = ab_fleet()
    spec = ab_spec(prometheus={"url": "http://prometheus:9090", field: {"control": control, "treatment": treatment}})
    if field == "storeSelectors":
        spec["rollout"]["abTest"]["conditions"] = [
            {"metric": "externalHitRate", "minEffect": 0.05},
            {"metric": "evictions", "direction": "LowerIsBetter", "maxRegression": 5, "guardrail": True}]
    status = cluster.run(spec)
    invalid = status.condition("Invalid")
    if not refused:
        assert status.phase is not Phase.INVALID, invalid
        return
    assert status.phase is Phase.INVALID and invalid is not None and invalid.reason == "IdenticalArmSelectors"
    assert f"prometheus.{field}.control" in invalid.message and "give each arm its own matchers" in invalid.message
    assert not cluster.writes


@pytest.mark.parametrize("replicas, warned", [
    ({"prefill-a": 1, "decode-a": 4, "prefill-b": 4, "decode-b": 1}, True),  # 1:4 against 4:1
    ({"prefill-a": 1, "decode-a": 2, "prefill-b": 2, "decode-b": 2}, False),  # 1:2 against 1:1, within 2x
    ({"prefill-a": 2, "decode-a": 2, "prefill-b": 2, "decode-b": 2}, False),
])
def test_arms_with_different_prefill_decode_mixes_are_warned_about(replicas: dict[str, int], warned: bool) -> None:
    """Issue 26: arms whose prefill:decode replica ratios differ measure the mix, not the settings.
    A warning (the mix may be deliberate): an event when measuring starts, and the
    ABTestConcluded condition says it while the test measures."""
    cluster = Cluster(master_deployment(), *(deployment(n, replicas=replicas[n]) for n in CONTROL + TREATMENT))
    deploy_treatment(cluster, SPEC)
    warnings = [m for kind, reason, m in cluster.events if reason == "UnbalancedArms"]
    concluded = cluster.status.condition("ABTestConcluded")
    assert concluded is not None and cluster.status.phase is Phase.ANALYZING  # measured all the same
    if not warned:
        assert not warnings and "UnbalancedArms" not in concluded.message
        return
    assert [kind for kind, reason, _ in cluster.events if reason == "UnbalancedArms"] == ["Warning"]
    assert "control 1 prefill : 4 decode replicas, treatment 4 : 1" in warnings[0]
    assert "give both arms about the same prefill:decode ratio" in warnings[0]
    assert "Warning (UnbalancedArms): the arms' prefill/decode mixes differ" in concluded.message
    measure(cluster, SPEC, [(0.5, 0.5)])
    assert len([r for _, r, _ in cluster.events if r == "UnbalancedArms"]) == 1  # announced once
    assert "UnbalancedArms" in cluster.status.condition("ABTestConcluded").message


def test_a_retried_test_starts_fresh_and_waits_out_its_warmup() -> None:
    """Issue 26: the retried test inherited the rolled-back one's samples, sums and last reading
    (a merge patch left them in place), and was decided after one interval without a warm-up.
    The cluster here stores the status as the API server does: merge-patched."""
    from moonlease_operator.api import VERB_ANNOTATION
    from moonlease_operator.core.ab_plan import measurement_due
    from moonlease_operator.core.verbs import Verb, build_verb_value

    cluster = ab_fleet()
    spec = ab_spec(warmupSeconds=20)
    deploy_treatment(cluster, spec)
    cluster.now += datetime.timedelta(seconds=20)
    measure(cluster, spec, [(0.7, 0.4)] * 3)
    status = cluster.run(spec)
    assert status.ab_test.phase is ABTestPhase.ROLLED_BACK and status.ab_test.samples == 3
    cluster.annotations[VERB_ANNOTATION] = build_verb_value(Verb.RETRY, status.revision, status.desired_config_hash)
    status = cluster.run(spec)
    ab = status.ab_test
    assert ab.phase is ABTestPhase.MEASURING and ab.samples == 0 and ab.analysis is None
    assert ab.last_measured_at is None and ab.verdict is None and ab.history == [] and ab.progress == ""
    stored = cluster.status_json["abTest"]
    assert "analysis" not in stored and "lastMeasuredAt" not in stored and "decidedAt" not in stored
    parsed = read_spec(spec).rollout.ab_test
    assert not measurement_due(ab, parsed, cluster.now)  # the warm-up first
    assert measurement_due(ab, parsed, cluster.now + datetime.timedelta(seconds=20))
