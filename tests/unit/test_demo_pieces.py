"""The demo's pure pieces: the arms' workload, reading a Deployment's connector settings, the
example policy as the demo applies it, act 2's bad change, the plot's series, the events counted
after the verdict, and the two-line summary."""

from __future__ import annotations

import json
import math

import helm_python as helm
import pytest
import yaml

from moonlease_dev.demo import (
    CHART_DIR,
    BadChangeOutcome,
    DemoOptions,
    StoreState,
    StoryOutcome,
    bad_change_patch,
    container_settings,
    count_events_after,
    demo_values,
    describe_connector,
    interval_series,
    policy_for,
    summarize,
)
from moonlease_dev.demo_arm import AgenticWorkload
from moonlease_operator.core.connector_delivery import SETTINGS_PORT_ANNOTATION
from moonlease_operator.api import LeaseMode, StageName, parse_spec
from moonlease_operator.core.compatibility import VersionSource, evaluate_compatibility
from moonlease_dev.testbed.tiny_models import model_dir

pytestmark = pytest.mark.unit


def serve(workload: AgenticWorkload, requests: int) -> list[tuple[int, list[int]]]:
    served = []
    for _ in range(requests):
        index, prompt = workload.next_prompt()
        served.append((index, prompt))
        workload.answered(index, [7] * 8)
    return served


def test_the_workload_is_deterministic_and_its_sessions_are_siblings_of_unaligned_system_prompts() -> None:
    first = serve(AgenticWorkload(seed=1), 300)
    assert first == serve(AgenticWorkload(seed=1), 300) and first != serve(AgenticWorkload(seed=2), 300)
    prompts = [p for _, p in first]
    systems = {tuple(p[:176]) for p in prompts}
    assert len(systems) == 2  # every prompt starts with one of the two system prompts
    assert 176 % 32 != 0  # a system prompt ends inside a block: siblings share whole blocks up to 160 only
    assert all(len(p) <= 1200 for p in prompts)
    # resumed sessions grow: a later prompt extends an earlier one (answer included)
    extended = sum(1 for i, p in enumerate(prompts) if any(
        len(q) < len(p) and p[:len(q)] == q and p[len(q):len(q) + 8] == [7] * 8 for q in prompts[max(0, i - 50):i]))
    assert extended > 120


@pytest.mark.parametrize("p_new", [0.4, 0.25])
def test_new_sessions_come_at_a_steady_pace_so_every_few_requests_carry_the_same_mix(p_new: float) -> None:
    workload = AgenticWorkload(seed=3, p_new=p_new)
    new = [len(prompt) == 176 + 40 for _, prompt in serve(workload, 200)]
    assert sum(new) == pytest.approx(200 * p_new, abs=1)
    window = 10
    for start in range(0, 200 - window, window):
        assert abs(sum(new[start:start + window]) - window * p_new) <= 1


def test_sessions_end_after_their_last_turn() -> None:
    workload = AgenticWorkload(seed=4, max_turns=2)
    served = serve(workload, 100)
    assert max(len(p) for _, p in served) == 176 + 40 + 8 + 24  # no third turn
    # what is left open has had one turn (system prompt, task, answer): the second one ends it
    assert workload.sessions and all(len(s) == 176 + 40 + 8 for s in workload.sessions)


def test_container_settings_read_the_kv_transfer_config_and_moonlease_env() -> None:
    config = {"kv_connector": "MooncakeStoreConnector", "kv_connector_extra_config": {"mooncake_selective_lease": True}}
    deployment = {"metadata": {"name": "d"}, "spec": {"template": {"spec": {"containers": [
        {"name": "sidecar", "args": ["--kv-transfer-config", "{}"]},
        {"name": "vllm", "args": ["serve", "m", f"--kv-transfer-config={json.dumps(config)}"],
         "env": [{"name": "VLLM_MOONCAKE_STORE_SELECTIVE_LEASE", "value": "1"}, {"name": "HF_HOME", "value": "/x"}]},
    ]}}}}
    assert container_settings(deployment) == (config, {"VLLM_MOONCAKE_STORE_SELECTIVE_LEASE": "1"})


def test_the_demo_installs_two_arms_whose_pods_name_their_engines_ports() -> None:
    """The values `helm install` gets: valid for the chart, two leaseAll arms and the master, no
    operator, policy or pool; each arm's pods carry its engine's metrics and settings ports."""
    ports, settings_ports = {"control": 4101, "treatment": 4102}, {"control": 4201, "treatment": 4202}
    values = demo_values(DemoOptions.quick(), ports, settings_ports)
    chart = helm.Chart.load(CHART_DIR)
    chart.validate_schema(values)
    rendered = chart.render(values, name="moonlease", namespace="inference", is_install=True)
    objects = [doc for path, text in rendered.items() if not path.endswith("NOTES.txt")
               for doc in yaml.safe_load_all(text) if doc]
    notes = next(text for path, text in rendered.items() if path.endswith("NOTES.txt"))
    assert str(model_dir(DemoOptions.quick().model)) in notes and "Qwen" not in notes
    pods = {o["metadata"]["name"]: o["spec"]["template"]["metadata"] for o in objects if o["kind"] == "Deployment"}
    assert set(pods) == {"moonlease-mooncake-master"} | {f"moonlease-{role}-{arm}" for role in ("prefill", "decode")
                                                          for arm in ports}
    assert not [o for o in objects if o["kind"] in ("MooncakeLeasePolicy", "StatefulSet")]
    for name, pod in pods.items():
        arm = pod["labels"].get("moonlease.io/arm")
        if arm:
            assert (pod["annotations"]["prometheus.io/port"], pod["annotations"][SETTINGS_PORT_ANNOTATION]) == (
                str(ports[arm]), str(settings_ports[arm])), name
    decode = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "moonlease-decode-treatment")
    assert container_settings(decode)[0]["kv_connector_extra_config"]["mooncake_settings_file"]


def test_the_demo_policy_is_the_junction_retention_example_with_demo_timing_and_stays_valid() -> None:
    options = DemoOptions.quick()
    policy = policy_for(options)
    ab = policy["spec"]["rollout"]["abTest"]
    assert (ab["intervalSeconds"], ab["minSamples"], ab["maxSamples"]) == (5, 3, 24)
    assert [c["metric"] for c in ab["conditions"]] == ["externalHitRate"]
    spec = parse_spec(policy["spec"])
    assert spec.rollout.ab_test is not None and spec.connector.lease_mode is LeaseMode.LEASE_ALL
    assert spec.connector.junction_retention
    assert describe_connector(policy["spec"]["connector"]) == "leaseAll + junction retention"


def _sources(spec_targets: int) -> list[VersionSource]:
    return [VersionSource(StageName.MASTER, "Deployment", "moonlease-mooncake-master", "0.3.14", None),
            *(VersionSource(StageName.DECODE, "Deployment", f"t{i}", "0.3.14", None) for i in range(spec_targets))]


def test_the_bad_change_passes_the_operators_gates_so_only_the_connectors_can_refuse_it() -> None:
    options = DemoOptions.quick()
    policy = policy_for(options)
    patch = bad_change_patch(policy, options)
    changed = {**policy["spec"], **patch["spec"],
               "rollout": {**policy["spec"]["rollout"], **patch["spec"]["rollout"]}}
    spec = parse_spec(changed)  # the CRD's rules (lastHitOnly needs targets declared hybrid) hold
    assert spec.connector.lease_mode is LeaseMode.LAST_HIT_ONLY and spec.connector.junction_retention
    assert all(t.hybrid for t in spec.targets)
    assert spec.rollout.stage_timeout_seconds == options.bad_stage_timeout_seconds
    assert spec.rollout.ab_test == parse_spec(policy["spec"]).rollout.ab_test  # the same test, a new config
    assert evaluate_compatibility(spec, _sources(len(spec.targets))) == []
    assert "master" not in patch["spec"]  # the store is never restarted by this change


def test_interval_series_leave_gaps_where_nothing_was_measured() -> None:
    history = [
        {"control": {"externalHitRate": 0.5, "ttftP90Seconds": 0.2}, "treatment": {"externalHitRate": 0.75}},
        {"error": "source down", "control": None, "treatment": None},
        {"control": {"externalHitRate": 0.0}, "treatment": None},
    ]
    control = interval_series(history, "control", "externalHitRate", 100)
    treatment = interval_series(history, "treatment", "externalHitRate", 100)
    ttft = interval_series(history, "treatment", "ttftP90Seconds", 1000)
    assert control[0] == 50 and math.isnan(control[1]) and control[2] == 0  # a measured 0 stays 0
    assert treatment[0] == 75 and math.isnan(treatment[1]) and math.isnan(treatment[2])
    assert all(math.isnan(v) for v in ttft)
    assert len(control) == len(history)  # failed intervals keep their place on the x axis


def test_events_after_the_verdict_are_counted_by_resource_version() -> None:
    def event(version: int, reason: str) -> dict[str, object]:
        return {"reason": reason, "metadata": {"resourceVersion": str(version)}}

    events = [event(5, "MeasurementFailed"), event(9, "ABTestVerdict"), event(12, "MeasurementFailed"),
              event(14, "StageFailed")]
    assert count_events_after(events, 9, "MeasurementFailed") == 1
    assert count_events_after(events, 12, "MeasurementFailed") == 0


def test_the_summary_says_in_two_lines_what_happened_and_what_to_run_next() -> None:
    store = StoreState(keys=480, master_pid=42)
    bad = BadChangeOutcome(phase="Degraded", reason="RolledBack", message="", refusal="model_unsupported",
                           seconds=31.0, before=store, after=store)
    outcome = StoryOutcome(ab_phase="Promoted", verdict="Success", decided_after_s=95.0,
                           hit_rates={"control": 0.548, "treatment": 0.765}, bad_change=bad)
    happened, then = summarize(outcome, "leaseAll + junction retention")
    assert happened.startswith("What happened: leaseAll + junction retention won the A/B (store hits 76.5% vs 54.8%)")
    assert "promoted 95 s after" in happened
    assert "refused by the treatment's connectors (model_unsupported), rolled back in 31 s" in happened
    assert "480 keys before and after" in happened
    assert then.startswith("Next: ") and "\n" not in happened + then
    harmed = StoryOutcome(ab_phase="AwaitingDecision", verdict="Inconclusive", decided_after_s=300.0,
                          hit_rates={"control": None, "treatment": None},
                          bad_change=BadChangeOutcome(phase="Degraded", reason="RolledBack", message="", refusal=None,
                                                      seconds=20.0, before=store,
                                                      after=StoreState(keys=0, master_pid=43)))
    happened, then = summarize(harmed, "x")
    assert "held for a human" in happened and "0 keys (before: 480)" in happened
    assert "--max-samples" in then
