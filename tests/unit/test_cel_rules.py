"""The CRD's CEL rules, evaluated by cel-python, agree with their pydantic mirrors.

The API server evaluates `x-kubernetes-validations` (the local one too: moonlease_dev.testbed.kube.cel);
jsonschema does not, and a CRD may be installed without its rules, so the operator mirrors each
rule in a validator. Here every rule is compiled and run as the API server would (on the defaulted
object, `self` bound to the node that declares the rule, once per list item), against the
hand-made violations of test_policy_api and against generated specs.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moonlease_dev.testbed.kube import apply_schema_defaults
from moonlease_dev.testbed.kube.cel import rule_errors
from moonlease_operator.api import PolicySpecError, parse_spec
from moonlease_operator.crd import build_crd, validation_schema
from tests.unit.test_policy_api import AB_ROLLOUT, CEL_VIOLATIONS, VALID, doc, with_changes


CRD = build_crd()
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
SCHEMA = jsonschema.Draft4Validator(validation_schema(CRD, strict=True))
_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _program(rule: str) -> Any:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule))
    return _PROGRAMS[rule]


def failed_rules(spec: dict[str, Any]) -> list[str]:
    """Messages of the rules that do not evaluate to true (an evaluation error fails too), as the
    local API server evaluates them at admission."""
    defaulted = apply_schema_defaults(copy.deepcopy(spec), SPEC_SCHEMA)
    return [error.detail for error in rule_errors(defaulted, SPEC_SCHEMA)]


def mirror_accepts(spec: dict[str, Any]) -> bool:
    try:
        parse_spec(spec)
    except PolicySpecError:
        return False
    return True


def all_rules() -> list[dict[str, str]]:
    found: list[dict[str, str]] = []

    def walk(schema: dict[str, Any]) -> None:
        found.extend(schema.get("x-kubernetes-validations", []))
        for sub in schema.get("properties", {}).values():
            walk(sub)
        if isinstance(schema.get("items"), dict):
            walk(schema["items"])

    walk(SPEC_SCHEMA)
    return found


@pytest.mark.unit
def test_every_rule_compiles_and_is_covered_by_a_violation() -> None:
    rules = all_rules()
    assert len(rules) == len(CEL_VIOLATIONS) >= 9
    for rule in rules:
        _program(rule["rule"])
    assert {r["message"] for r in rules} == set(CEL_VIOLATIONS)


@pytest.mark.unit
@pytest.mark.parametrize("message", CEL_VIOLATIONS)
def test_each_violation_trips_exactly_its_rule(message: str) -> None:
    spec = CEL_VIOLATIONS[message]
    assert SCHEMA.is_valid(doc(spec))
    assert failed_rules(spec) == [message]
    assert not mirror_accepts(spec)


@pytest.mark.unit
def test_valid_specs_pass_every_rule() -> None:
    edge = with_changes(**{"master.kind": "StatefulSet", "master.name": "llama-decode",
                           "targets.1": {"name": "llama-prefill", "kind": "StatefulSet", "role": "decode"}})
    edge["targets"].append({"role": "decode", "selector": {"matchExpressions": [{"key": "t", "operator": "Exists"}]}})
    hybrid = with_changes(**{"connector.leaseMode": "lastHitOnly", "targets.0.hybrid": True, "targets.1.hybrid": True})
    ab_test = with_changes(rollout=AB_ROLLOUT)
    for spec in (VALID, edge, hybrid, ab_test):
        assert failed_rules(spec) == [] and mirror_accepts(spec)


# Mostly well-formed pieces, with each kind of mistake mixed in, so that both verdicts occur often.
_names = st.sampled_from(["a", "b", "c", "d", "mooncake-master"])
_expression = st.one_of(
    st.fixed_dictionaries({"key": st.just("x"), "operator": st.sampled_from(["In", "NotIn"]),
                           "values": st.lists(st.just("v"), min_size=1, max_size=2)}),
    st.fixed_dictionaries({"key": st.just("x"), "operator": st.sampled_from(["Exists", "DoesNotExist"])}),
    st.fixed_dictionaries({"key": st.just("x"), "operator": st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist"]),
                           "values": st.lists(st.just("v"), max_size=2)}),
)
_selector = st.one_of(
    st.fixed_dictionaries({"matchLabels": st.dictionaries(st.sampled_from(["x", "y"]), st.just("1"),
                                                          min_size=1, max_size=2)}),
    st.fixed_dictionaries({"matchExpressions": st.lists(_expression, min_size=1, max_size=2)}),
    st.just({"matchLabels": {}}),
)
_common = {"role": st.sampled_from(["prefill", "decode"]), "kind": st.sampled_from(["Deployment", "StatefulSet"]),
           "hybrid": st.booleans()}
_target = st.one_of(
    st.fixed_dictionaries({"name": _names, **_common}),
    st.fixed_dictionaries({"selector": _selector, **_common}),
    st.fixed_dictionaries({"name": _names, **_common}),
    st.fixed_dictionaries({"name": _names, "selector": _selector, **_common}),  # both: refused
)
_stages = st.one_of(st.permutations(["master", "prefill", "decode"]),
                    st.lists(st.sampled_from(["master", "prefill", "decode"]), min_size=1, max_size=3))
_spec = st.fixed_dictionaries({
    "master": st.fixed_dictionaries({"name": _names, "kind": st.sampled_from(["Deployment", "StatefulSet"])}),
    "connector": st.fixed_dictionaries({"leaseMode": st.sampled_from(["leaseAll", "selective", "lastHitOnly"])}),
    "targets": st.lists(_target, min_size=1, max_size=3),
    "rollout": st.fixed_dictionaries({"stages": _stages.map(list)}),
})


@pytest.mark.parametrize("examples", [pytest.param(100, marks=pytest.mark.unit, id="100-examples"),
                                      pytest.param(400, marks=pytest.mark.slow, id="400-examples")])
def test_cel_and_the_mirrors_agree_on_generated_specs(examples: int) -> None:
    """100 generated specs in the fast loop, 400 in the `slow` tier (cel-python takes about
    20 ms a spec)."""

    @settings(max_examples=examples, deadline=None)
    @given(spec=_spec)
    def agree(spec: dict[str, Any]) -> None:
        if not SCHEMA.is_valid(doc(spec)):
            return  # the API server refuses it before any rule runs
        assert (failed_rules(spec) == []) == mirror_accepts(spec), (failed_rules(spec), spec)

    agree()
