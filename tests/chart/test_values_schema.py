"""values.schema.json describes every value and refuses bad ones with a message that names the
value and the rule; what the schema cannot express fails the render with a message saying
what to change; the documentation's values reference is the one generated from the schema."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.chart.rendering import CHART_DIR, REPO, render, values_sets
from tools.chart_values_doc import END, START, table

pytestmark = pytest.mark.chart

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
SETS = values_sets()


def leaves(value: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    if isinstance(value, Mapping) and value:
        for key, sub in value.items():
            yield from leaves(sub, (*path, key))
    elif isinstance(value, list) and value:
        for index, sub in enumerate(value):
            yield from leaves(sub, (*path, index))
    else:
        yield path, value


def schema_for(path: tuple[str | int, ...]) -> Mapping[str, Any] | None:
    """The schema node that describes the value at `path`, or None when nothing does. A
    free-form object (no `properties`, no `additionalProperties`: e.g. a toleration, or a
    policy target, which the CRD checks) describes everything inside it."""
    node: Mapping[str, Any] = SCHEMA
    for part in path:
        if node.get("type") == "object" and "properties" not in node and "additionalProperties" not in node:
            return node
        if isinstance(part, int):
            node = node.get("items")  # type: ignore[assignment]
        elif part in node.get("properties", {}):
            node = node["properties"][part]
        else:
            node = node.get("additionalProperties")  # type: ignore[assignment]
        if not isinstance(node, Mapping):
            return None
    return node


def walk_schema(node: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from walk_schema(sub, f"{path}.{name}")
    if isinstance(node.get("items"), Mapping):
        yield from walk_schema(node["items"], f"{path}[]")


@pytest.mark.parametrize("name", ["values.yaml", *sorted(SETS)])
def test_the_schema_describes_every_value(name: str) -> None:
    values = DEFAULTS if name == "values.yaml" else SETS[name]
    undescribed = [".".join(map(str, path)) for path, _ in leaves(values) if schema_for(path) is None]
    assert undescribed == []


def test_every_object_in_the_schema_is_closed_and_every_value_explained() -> None:
    """No typo slips through (`additionalProperties: false` unless a map is free-form on
    purpose), and every value has the description the docs' values table shows."""
    for path, node in walk_schema(SCHEMA):
        if node.get("type") == "object" and "properties" in node and path != ".global":
            # (Helm's `global` is shared with parent charts: it stays open.)
            assert node.get("additionalProperties") is False, path
        if path and not path.endswith("[]") and path != ".global":
            assert node.get("description"), path
    free_form = {path for path, node in walk_schema(SCHEMA)
                 if node.get("type") == "object" and "properties" not in node}
    assert all(p.split(".")[-1] in {"commonLabels", "annotations", "podAnnotations", "nodeSelector", "affinity",
                                    "requests", "limits", "global", "customQueries", "labels"} or p.endswith("[]")
               for p in free_form), free_form


@pytest.mark.parametrize("name", ["values.yaml", *sorted(SETS)])
def test_the_defaults_and_every_values_set_pass(chart: helm.Chart, name: str) -> None:
    chart.validate_schema(DEFAULTS if name == "values.yaml" else SETS[name])


BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "typo in a master flag": ({"mooncake": {"master": {"settings": {"eviction_ratioo": 0.1}}}},
                              "at '/mooncake/master/settings': additional properties 'eviction_ratioo' not allowed"),
    "ratio above 1": ({"mooncake": {"master": {"settings": {"eviction_high_watermark_ratio": 1.5}}}},
                      "at '/mooncake/master/settings/eviction_high_watermark_ratio': maximum: got 1.5, want 1"),
    "lease of zero ms": ({"mooncake": {"master": {"settings": {"default_kv_lease_ttl": 0}}}},
                         "at '/mooncake/master/settings/default_kv_lease_ttl': minimum: got 0, want 1"),
    "segment as a string": ({"mooncake": {"storePool": {"globalSegmentSizeMiB": "8Gi"}}},
                            "at '/mooncake/storePool/globalSegmentSizeMiB': got string, want integer"),
    "unknown protocol": ({"mooncake": {"protocol": "udp"}},
                         "at '/mooncake/protocol': value must be one of 'tcp', 'rdma'"),
    "an unknown lease mode": (
        {"vllm": {"connector": {"leaseMode": "leaseNone"}}},
        "at '/vllm/connector/leaseMode': value must be one of 'leaseAll', 'selective', 'lastHitOnly'"),
    "an unknown settings owner": (
        {"vllm": {"connector": {"settingsOwner": "argocd"}}},
        "at '/vllm/connector/settingsOwner': value must be one of 'chart', 'policy'"),
    "a lease switch set by hand": (
        {"vllm": {"connector": {"extraConfig": {"mooncake_selective_lease": True}}}},
        "at '/vllm/connector/extraConfig': additional properties 'mooncake_selective_lease' not allowed"),
    "an arm without a name": ({"vllm": {"arms": [{"leaseMode": "selective"}]}},
                              "at '/vllm/arms/0': missing property 'name'"),
    "negative replicas": ({"vllm": {"decode": {"replicas": -1}}},
                          "at '/vllm/decode/replicas': minimum: got -1, want 0"),
    "a namespace that cannot exist": ({"operator": {"watchNamespaces": ["Team_A"]}},
                                      "at '/operator/watchNamespaces/0': 'Team_A' does not match pattern"),
    "an address with a scheme": ({"mooncake": {"master": {"externalAddress": "http://master:50051"}}},
                                 "at '/mooncake/master/externalAddress': 'http://master:50051' does not match"),
    "a port out of range": ({"vllm": {"port": 70000}}, "at '/vllm/port': maximum: got 70,000, want 65,535"),
    "unknown rollout failure policy": ({"policy": {"rollout": {"onFailure": "retry"}}},
                                       "at '/policy/rollout/onFailure': value must be one of 'rollback', 'halt'"),
    "a stage twice": ({"policy": {"rollout": {"stages": ["master", "master"]}}},
                      "at '/policy/rollout/stages': items at 0 and 1 are equal"),
    "an unknown top-level value": ({"vllmm": {"enabled": False}}, "at '': additional properties 'vllmm' not allowed"),
    "a typo in the A/B analysis": (
        {"policy": {"abTest": {"analysis": {"minSample": 3}}}},
        "at '/policy/abTest/analysis': additional properties 'minSample' not allowed"),
    "arms set inside the A/B analysis": (
        {"policy": {"abTest": {"analysis": {"control": {"workloads": ["x"]}}}}},
        "at '/policy/abTest/analysis': additional properties 'control' not allowed"),
    "an A/B confidence of 1": (
        {"policy": {"abTest": {"analysis": {"confidence": 1}}}},
        "at '/policy/abTest/analysis/confidence': exclusiveMaximum"),
    "an unknown A/B action": (
        {"policy": {"abTest": {"analysis": {"onSuccess": "rollback"}}}},
        "at '/policy/abTest/analysis/onSuccess': value must be one of 'promote', 'hold'"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_are_refused_with_clear_messages(chart: helm.Chart, case: str) -> None:
    values, message = BAD_VALUES[case]
    with pytest.raises(helm.HelmValuesError) as refused:
        chart.validate_schema(values)
    assert message in str(refused.value)
    with pytest.raises(helm.HelmValuesError):  # `helm install` checks the schema before rendering
        render(chart, values)


INCONSISTENT: dict[str, tuple[dict[str, Any], str]] = {
    "external master without an address": (
        {"mooncake": {"master": {"enabled": False}}, "policy": {"enabled": False}},
        "mooncake.master.externalAddress (host:port) is required when mooncake.master.enabled is false"),
    "an address for the chart's own master": (
        {"mooncake": {"master": {"externalAddress": "master.kv:50051"}}},
        "mooncake.master.externalAddress is for a master outside this release"),
    "a policy without a master to manage": (
        {"mooncake": {"master": {"enabled": False, "externalAddress": "master.kv:50051"}}},
        "policy.masterWorkload is required when mooncake.master.enabled is false"),
    "pool memory set by hand": (
        {"mooncake": {"storePool": {"resources": {"limits": {"memory": "4Gi"}}}}},
        "mooncake.storePool.resources.limits.memory must not be set"),
    "two arms of one name": (
        {"vllm": {"arms": [{"name": "a"}, {"name": "a"}]}}, 'vllm.arms: the arm name "a" is used twice'),
    "a managed arm with its own lease mode": (
        {"vllm": {"arms": [{"name": "control"}, {"name": "treatment", "leaseMode": "selective"}]}},
        'vllm.arms: arm "treatment" sets leaseMode selective but the policy'),
    "a managed arm with its own junction setting": (
        {"vllm": {"arms": [{"name": "control"}, {"name": "treatment", "junctionRetention": True}]}},
        'vllm.arms: arm "treatment" sets junctionRetention true but the policy'),
    "retention pin on a master that never evicts pinned objects": (
        {"vllm": {"connector": {"retention": {"pin": True}}},
         "mooncake": {"master": {"settings": {"allow_evict_soft_pinned_objects": False}}}},
        "vllm.connector.retention.pin needs mooncake.master.settings.allow_evict_soft_pinned_objects true"),
    "retention evict without the master's watermark": (
        {"vllm": {"connector": {"retention": {"evict": True}}},
         "mooncake": {"master": {"settings": {"eviction_high_watermark_ratio": None}}}},
        "vllm.connector.retention.evict keeps the store under the master's eviction watermark"),
    "a policy with no targets": (
        {"vllm": {"enabled": False}}, "policy.enabled needs at least one target"),
    "a rollout without the master stage": (
        {"policy": {"rollout": {"stages": ["prefill", "decode"]}}}, "policy.rollout.stages must include master"),
    "a rollout without a stage for the chart's targets": (
        {"policy": {"rollout": {"stages": ["master", "decode"]}}}, "policy.rollout.stages must include prefill"),
    "last-hit-only on a model not declared hybrid": (
        {"vllm": {"connector": {"leaseMode": "lastHitOnly"}}},
        "leaseMode lastHitOnly is for hybrid models (full attention + align-mode Mamba): set vllm.hybrid=true"),
    "an A/B test without vLLM": (
        {"vllm": {"enabled": False}, "policy": {"targets": [{"name": "x", "role": "decode"}],
                                                "abTest": {"enabled": True}}},
        "policy.abTest compares two of the chart's vllm.arms: set vllm.enabled=true"),
    "an A/B test without arms": (
        {"policy": {"abTest": {"enabled": True}}},
        'policy.abTest.controlArm: vllm.arms has no arm named "control" (arms: none)'),
    "an A/B test of a missing arm": (
        {"vllm": {"arms": [{"name": "control"}, {"name": "b"}]}, "policy": {"abTest": {"enabled": True}}},
        'policy.abTest.treatmentArm: vllm.arms has no arm named "treatment" (arms: control, b)'),
    "an A/B test of one arm against itself": (
        {"vllm": {"arms": [{"name": "control"}]},
         "policy": {"abTest": {"enabled": True, "treatmentArm": "control"}}},
        'policy.abTest: controlArm and treatmentArm are both "control"'),
    "an A/B arm the policy does not manage": (
        {"vllm": {"arms": [{"name": "control"}, {"name": "treatment", "leaseMode": "selective",
                                                 "managedByPolicy": False}]},
         "policy": {"abTest": {"enabled": True}}},
        'policy.abTest.treatmentArm: arm "treatment" sets managedByPolicy: false, but both A/B arms must be targets'),
    "a third managed arm beside an A/B test": (
        {"vllm": {"arms": [{"name": "control"}, {"name": "treatment"}, {"name": "extra"}]},
         "policy": {"abTest": {"enabled": True}}},
        'vllm.arms: arm "extra" is managed by the policy but is neither policy.abTest.controlArm nor treatmentArm'),
    "more targets beside an A/B test": (
        {"vllm": {"arms": [{"name": "control"}, {"name": "treatment"}]},
         "policy": {"targets": [{"name": "other", "role": "decode"}], "abTest": {"enabled": True}}},
        "policy.targets must be empty with policy.abTest"),
    "an A/B test without the policy": (
        {"vllm": {"arms": [{"name": "control"}, {"name": "treatment"}]},
         "policy": {"enabled": False, "abTest": {"enabled": True}}},
        "policy.abTest.enabled needs policy.enabled"),
    "every namespace and named ones": (
        {"operator": {"watchNamespaces": ["*", "inference"]}},
        "operator.watchNamespaces: \"*\" (every namespace) stands alone"),
    "a Prometheus the operator may not read": (
        {"vllm": {"arms": [{"name": "control"}, {"name": "treatment"}]},
         "policy": {"abTest": {"enabled": True, "analysis": {"prometheus": {"url": "http://prom.monitoring:9090"}}}}},
        "policy.abTest.analysis.prometheus.url http://prom.monitoring:9090 must be allowed by "
        "operator.prometheusUrlAllowlist"),
    "an operator that does not watch the policy": (
        {"operator": {"watchNamespaces": ["other"]}},
        "operator.watchNamespaces must include the release namespace inference"),
}


@pytest.mark.parametrize("case", sorted(INCONSISTENT))
def test_inconsistent_values_fail_the_render_with_what_to_change(chart: helm.Chart, case: str) -> None:
    values, message = INCONSISTENT[case]
    chart.validate_schema(values)  # each value is fine on its own
    with pytest.raises(helm.HelmRenderError) as failed:
        render(chart, values)
    assert message in str(failed.value)


@pytest.mark.parametrize("readme_path", ["docs/helm.md", "charts/moonlease/README.md"])
def test_the_readme_values_reference_is_generated_from_the_schema(readme_path: str) -> None:
    """The docs site's Helm page and the chart's own README (`helm show readme`) hold the generated table."""
    readme = (REPO / readme_path).read_text()
    assert START in readme and END in readme
    section = readme.split(START, 1)[1].split(END, 1)[0]
    assert section == "\n" + table(), f"{readme_path}'s values reference is stale: run `make chart-docs`"
    documented = {line.split("`")[1] for line in table().splitlines()[2:]}
    values_in_defaults = {".".join(str(p) for p in path) for path, _ in leaves(DEFAULTS)}
    # Every default value has its row (map-valued ones under their map's row).
    assert all(any(v == d or v.startswith(d + ".") for d in documented) for v in values_in_defaults), \
        values_in_defaults - documented
