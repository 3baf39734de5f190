"""The demo's pure pieces: the arms' workload, reading a Deployment's connector settings, and
the example policy as the demo applies it."""

from __future__ import annotations

import json

import pytest

from moonlease.demo import DemoOptions, container_settings, policy_for
from moonlease.demo_arm import AgenticWorkload
from moonlease_operator.api import parse_spec

pytestmark = pytest.mark.unit


def test_the_workload_is_deterministic_and_shares_prefixes_across_sessions() -> None:
    def run(seed: int) -> list[tuple[int, list[int]]]:
        workload = AgenticWorkload(seed=seed)
        served = []
        for _ in range(300):
            index, prompt = workload.next_prompt()
            served.append((index, prompt))
            workload.answered(index, [7] * 8)
        return served

    first = run(1)
    assert first == run(1) and first != run(2)
    prompts = [p for _, p in first]
    systems = {tuple(p[:160]) for p in prompts}
    assert len(systems) == 2  # every prompt starts with one of the two system prompts
    assert all(len(p) <= 1200 for p in prompts)
    # resumed sessions grow: a later prompt extends an earlier one (answer included)
    extended = sum(1 for i, p in enumerate(prompts) if any(
        len(q) < len(p) and p[:len(q)] == q and p[len(q):len(q) + 8] == [7] * 8 for q in prompts[max(0, i - 50):i]))
    assert extended > 100


def test_container_settings_read_the_kv_transfer_config_and_moonlease_env() -> None:
    config = {"kv_connector": "MooncakeStoreConnector", "kv_connector_extra_config": {"mooncake_selective_lease": True}}
    deployment = {"metadata": {"name": "d"}, "spec": {"template": {"spec": {"containers": [
        {"name": "sidecar", "args": ["--kv-transfer-config", "{}"]},
        {"name": "vllm", "args": ["serve", "m", f"--kv-transfer-config={json.dumps(config)}"],
         "env": [{"name": "VLLM_MOONCAKE_STORE_SELECTIVE_LEASE", "value": "1"}, {"name": "HF_HOME", "value": "/x"}]},
    ]}}}}
    assert container_settings(deployment) == (config, {"VLLM_MOONCAKE_STORE_SELECTIVE_LEASE": "1"})


def test_the_demo_policy_is_the_example_with_demo_timing_and_stays_valid() -> None:
    options = DemoOptions.quick()
    policy = policy_for(options)
    ab = policy["spec"]["rollout"]["abTest"]
    assert (ab["intervalSeconds"], ab["minSamples"], ab["maxSamples"]) == (5, 3, 4)
    assert [c["metric"] for c in ab["conditions"]] == ["externalHitRate"]
    assert ab["consecutiveErrorLimit"] >= 300 // 5 - 1  # engines warm up before their /metrics answer
    spec = parse_spec(policy["spec"])
    assert spec.rollout.ab_test is not None and spec.connector.lease_mode.value == "selective"
