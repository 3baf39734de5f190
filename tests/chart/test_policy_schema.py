"""The chart ships the generated CRD unchanged, and every MooncakeLeasePolicy we hand to users —
the one the chart renders, the examples — is one the API server and the operator accept.

The API server's checks are applied the way the local API server applies them (structural
schema: unknown fields, types, enums, bounds), then the operator's own parse, which mirrors the
CRD's CEL rules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from moonlease_dev.testbed.kube import apply_schema_defaults, prune_unknown_fields, schema_errors
from moonlease_operator.api import PolicySpecError, parse_spec
from moonlease_operator.crd import render_crd_yaml
from tests.chart.rendering import CHART_DIR, REPO, crd, crd_schema, find, render_objects, values_sets

pytestmark = pytest.mark.chart

SETS = values_sets()
EXAMPLES = sorted((REPO / "examples" / "policies").glob("*.yaml"))


def test_the_chart_ships_the_generated_crd_byte_for_byte() -> None:
    shipped = (CHART_DIR / "crds" / "mooncakeleasepolicies.yaml").read_bytes()
    assert shipped == (REPO / "crds" / "mooncakeleasepolicies.yaml").read_bytes(), \
        "charts/moonlease/crds/ is stale: run `make crds`"
    assert shipped.decode() == render_crd_yaml(), "crds/ is stale: run `make crds`"
    assert crd()["spec"]["names"]["kind"] == "MooncakeLeasePolicy"


def accepted_problems(obj: dict[str, Any]) -> list[str]:
    """Why the API server or the operator would refuse this policy (empty: accepted)."""
    schema = crd_schema()
    problems = [f"schema: {line}" for line in schema_errors(obj, schema)]
    _, dropped = prune_unknown_fields(obj, schema)
    problems += [f"unknown field (the API server would drop it): {path}" for path in dropped]
    if not problems:
        try:
            parse_spec(apply_schema_defaults(obj, schema)["spec"])
        except PolicySpecError as exc:
            problems += [f"operator/CEL: {p}" for p in exc.problems]
    return problems


@pytest.mark.parametrize("name", sorted(n for n, v in SETS.items() if v.get("policy", {}).get("enabled", True)))
def test_the_rendered_policy_is_accepted(chart: helm.Chart, name: str) -> None:
    policies = find(render_objects(chart, SETS[name]), "MooncakeLeasePolicy")
    assert len(policies) == 1
    assert accepted_problems(policies[0]) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_policy_is_accepted(path: Path) -> None:
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert [d["kind"] for d in documents] == ["MooncakeLeasePolicy"]
    assert accepted_problems(documents[0]) == []


def test_the_check_refuses_what_the_api_server_would(chart: helm.Chart) -> None:
    """The checks above can fail: a typo, a bad enum and a CEL violation are each caught."""
    policy = find(render_objects(chart, {}), "MooncakeLeasePolicy")[0]
    typo = yaml.safe_load(yaml.safe_dump(policy))
    typo["spec"]["connector"]["leaseMod"] = "selective"
    assert any("connector.leaseMod" in p for p in accepted_problems(typo))
    bad_enum = yaml.safe_load(yaml.safe_dump(policy))
    bad_enum["spec"]["connector"]["leaseMode"] = "sometimes"
    assert any(p.startswith("schema: spec.connector.leaseMode") for p in accepted_problems(bad_enum))
    cel = yaml.safe_load(yaml.safe_dump(policy))
    cel["spec"]["rollout"]["stages"] = ["prefill", "decode"]
    assert any("stages must include master" in p for p in accepted_problems(cel))


AB_VARIANTS: dict[str, dict[str, Any]] = {
    "ab-test set": SETS["ab-test"],
    "CRD defaults, renamed arms beside an unmanaged one": {
        "vllm": {"arms": [{"name": "a"}, {"name": "b"}, {"name": "canary", "leaseMode": "selective",
                                                         "managedByPolicy": False}]},
        "policy": {"abTest": {"enabled": True, "controlArm": "a", "treatmentArm": "b"}}},
    "scraping, held failures, a custom port": {
        "vllm": {"arms": [{"name": "control"}, {"name": "treatment"}]},
        "policy": {"abTest": {"enabled": True, "analysis": {
            "scrape": {"port": 9000, "path": "/metrics"}, "onFailure": "hold", "onSuccess": "hold",
            "onInconclusive": "rollback", "consecutiveErrorLimit": 0,
            "abort": {"putFailureGuard": False, "consecutiveIntervals": 3, "ttftQuantile": 0.9,
                      "ttftThresholdSeconds": 2.5},
            "prometheus": None}}}},
    "Prometheus with the user's matchers": {
        "operator": {"prometheusUrlAllowlist": ["https://prom.example:9090"]},
        "vllm": {"arms": [{"name": "control"}, {"name": "treatment"}]},
        "policy": {"abTest": {"enabled": True, "analysis": {"prometheus": {
            "url": "https://prom.example:9090", "selectors": {"control": 'job="vllm-a"', "treatment": 'job="vllm-b"'},
            "storeSelector": 'job="mooncake"', "podLabel": "kubernetes_pod_name",
            "namespaceLabel": "kubernetes_namespace"}}}}},
}


@pytest.mark.parametrize("case", sorted(AB_VARIANTS))
def test_a_rendered_ab_test_policy_is_valid_against_the_built_crd_and_parses(chart: helm.Chart, case: str) -> None:
    """The CRD as the operator builds it (strict: no unknown field anywhere), then the operator's
    parse, whose arms are exactly the chart's two arms' Deployments."""
    import jsonschema

    from moonlease_operator.api import RolloutStrategy
    from moonlease_operator.crd import build_crd, validation_schema

    values = AB_VARIANTS[case]
    if values["policy"]["abTest"].get("analysis", {}).get("prometheus", "") is None:
        values = yaml.safe_load(yaml.safe_dump(values))
        del values["policy"]["abTest"]["analysis"]["prometheus"]
    objects = render_objects(chart, values)
    (policy,) = find(objects, "MooncakeLeasePolicy")
    jsonschema.Draft4Validator(validation_schema(build_crd(), strict=True)).validate(policy)
    assert accepted_problems(policy) == []
    spec = parse_spec(policy["spec"])
    assert spec.rollout.strategy is RolloutStrategy.AB_TEST and spec.rollout.ab_test is not None
    ab = values["policy"]["abTest"]
    arms = {"control": ab.get("controlArm", "control"), "treatment": ab.get("treatmentArm", "treatment")}
    assert spec.rollout.ab_test.control.workloads == [f"moonlease-{r}-{arms['control']}" for r in ("prefill", "decode")]
    assert spec.rollout.ab_test.treatment.workloads == [f"moonlease-{r}-{arms['treatment']}"
                                                        for r in ("prefill", "decode")]
    deployments = {o["metadata"]["name"] for o in find(objects, "Deployment")}
    assert {t.name for t in spec.targets} <= deployments


def _shape(node: dict[str, Any]) -> Any:
    """Property names, recursively (through array items), and enums: what a values schema must
    mirror to accept exactly the fields the CRD has."""
    if node.get("type") == "array":
        return ["items", _shape(node["items"])]
    if "properties" in node:
        return {name: _shape(sub) for name, sub in node["properties"].items()}
    return node.get("enum")


def test_the_values_schema_of_the_ab_analysis_mirrors_the_crd() -> None:
    """policy.abTest.analysis is the CRD's spec.rollout.abTest without the arms (the chart fills
    those in): same fields, same enums, so no typo passes `helm install` and no field is missing."""
    import json

    values_schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    analysis = values_schema["properties"]["policy"]["properties"]["abTest"]["properties"]["analysis"]
    crd_ab = crd_schema()["properties"]["spec"]["properties"]["rollout"]["properties"]["abTest"]
    expected = _shape(crd_ab)
    del expected["control"], expected["treatment"]
    assert _shape(analysis) == expected
