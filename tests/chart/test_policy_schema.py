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

from moonlease.testbed.kube import apply_schema_defaults, prune_unknown_fields, schema_errors
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
