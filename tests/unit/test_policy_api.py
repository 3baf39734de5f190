"""The MooncakeLeasePolicy API: the models, the generated CRD, the examples, and the acceptance
decision. Pure: schema validation with jsonschema, CEL rules through their pydantic mirrors."""

from __future__ import annotations

import copy
import datetime
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from moonlease_operator.api import (
    CelRule,
    ConditionStatus,
    LabelSelector,
    LeaseMode,
    MasterSpec,
    Phase,
    PolicySpec,
    PolicySpecError,
    PolicyStatus,
    RolloutSpec,
    StageName,
    build_master_flags,
    read_spec,
    parse_spec,
)
from moonlease_operator.api.abtest import QUERY_TEMPLATE_PATTERN
from moonlease_operator.api.common import LABEL_KEY_PATTERN, LABEL_VALUE_PATTERN, ApiModel, LabelSelectorRequirement
from moonlease_operator.api.policy import TargetSpec
from moonlease_operator.core.rollout import Observed, PolicyRef, plan_reconcile
from moonlease_operator.core.status import dump_status, read_status
from moonlease_operator.core.conditions import set_condition
from moonlease_operator.crd import build_crd, render_crd_yaml, validation_schema

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "mooncakeleasepolicies.yaml"
EXAMPLES = sorted((ROOT / "examples" / "policies").glob("*.yaml"))
T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)

VALID: dict[str, Any] = {
    "master": {"name": "mooncake-master"},
    "targets": [{"name": "llama-prefill", "role": "prefill"}, {"name": "llama-decode", "role": "decode"}],
}


#: An A/B test of the two VALID targets: prefill is the control, decode the treatment.
AB_ROLLOUT: dict[str, Any] = {"strategy": "ABTest", "abTest": {
    "control": {"workloads": ["llama-prefill"]}, "treatment": {"workloads": ["llama-decode"]}}}


def doc(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "moonlease.io/v1alpha1", "kind": "MooncakeLeasePolicy",
            "metadata": {"name": "p", "namespace": "ns"}, "spec": spec}


def with_changes(**changes: Any) -> dict[str, Any]:
    """VALID with dotted-path changes, e.g. with_changes(**{"master.evictionRatio": 0})."""
    spec = copy.deepcopy(VALID)
    for path, value in changes.items():
        node = spec
        *parents, leaf = path.split(".")
        for part in parents:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        node[int(leaf) if leaf.isdigit() else leaf] = value
    return spec


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return build_crd()


@pytest.fixture(scope="module")
def validator(crd: dict[str, Any]) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(validation_schema(crd, strict=True))


def schema_accepts(validator: jsonschema.Draft4Validator, spec: dict[str, Any]) -> bool:
    return validator.is_valid(doc(spec))


def model_accepts(spec: dict[str, Any]) -> bool:
    try:
        parse_spec(spec)
    except PolicySpecError:
        return False
    return True


# ---- the committed CRD --------------------------------------------------------------------------

def test_committed_crd_yaml_is_fresh() -> None:
    assert CRD_FILE.read_text(encoding="utf-8") == render_crd_yaml(), (
        "crds/mooncakeleasepolicies.yaml is stale: regenerate it with `make crds`")


def _walk(node: Any, path: str = "$"):
    yield path, node
    if isinstance(node, dict):
        for key, value in node.get("properties", {}).items():
            yield from _walk(value, f"{path}.{key}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                yield from _walk(node[key], f"{path}[{key}]")


def test_schema_is_structural(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    text = yaml.safe_dump(schema)
    for forbidden in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "title", "null", "additionalProperties: false",
                      "patternProperties", "propertyNames"):  # the API server refuses the last two
        assert forbidden not in text, forbidden
    for path, node in _walk(schema):
        assert "type" in node, f"{path} has no type"
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path
        if "default" in node and node["type"] == "object":
            assert isinstance(node["default"], dict), path


def test_crd_identity_printer_columns_and_status(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "mooncakeleasepolicies.moonlease.io"
    assert (spec["group"], spec["scope"]) == ("moonlease.io", "Namespaced")
    assert spec["names"]["kind"] == "MooncakeLeasePolicy" and spec["names"]["shortNames"] == ["mlp"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["storage"] and version["served"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Mode": ".spec.connector.leaseMode", "Phase": ".status.phase", "Stage": ".status.currentStage",
        "Ready": '.status.conditions[?(@.type=="Ready")].status', "A/B": ".status.abTest.phase",
        "Verdict": ".status.abTest.finalVerdict", "Age": ".metadata.creationTimestamp",
        "Samples": ".status.abTest.progress", "Reason": ".status.abTest.reason",
    }
    # `kubectl get -o wide` only: the A/B test's samples (n/max) and its reason
    assert [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority") == 1] == ["Samples", "Reason"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert "x-kubernetes-preserve-unknown-fields" not in yaml.safe_dump(status)
    assert status["properties"]["conditions"]["x-kubernetes-list-map-keys"] == ["type"]


def _models() -> list[type[ApiModel]]:
    found, todo = [], [PolicySpec, PolicyStatus]
    while todo:
        model = todo.pop()
        if model in found:
            continue
        found.append(model)
        for info in model.model_fields.values():
            for arg in _type_args(info.annotation):
                if isinstance(arg, type) and issubclass(arg, ApiModel):
                    todo.append(arg)
    return found


def _type_args(tp: Any) -> list[Any]:
    args = [tp]
    for sub in getattr(tp, "__args__", ()) or ():
        args.extend(_type_args(sub))
    return args


def test_every_cel_rule_in_the_crd_comes_from_a_model_mirror(crd: dict[str, Any]) -> None:
    in_crd = [(r["rule"], r["message"]) for _, node in _walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
              for r in node.get("x-kubernetes-validations", [])]
    declared = [(r.rule, r.message) for m in _models() for r in m.cel_rules]
    assert sorted(in_crd) == sorted(declared)
    assert len(in_crd) == len(CEL_VIOLATIONS) == len(set(in_crd))


# ---- examples -----------------------------------------------------------------------------------

def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path: Path, validator: jsonschema.Draft4Validator) -> None:
    example = yaml.safe_load(path.read_text(encoding="utf-8"))
    validator.validate(example)
    spec = parse_spec(example["spec"])
    assert spec.targets


# ---- the schema refuses bad policies, and so does the model -------------------------------------

BAD_BY_SCHEMA = {
    "ratio zero": with_changes(**{"master.evictionRatio": 0}),
    "ratio above one": with_changes(**{"master.evictionHighWatermarkRatio": 1.5}),
    "ratio as string": with_changes(**{"master.evictionRatio": "0.5"}),
    "ttl zero": with_changes(**{"master.defaultKvLeaseTtlMs": 0}),
    "ttl fractional": with_changes(**{"master.defaultKvSoftPinTtlMs": 1.5}),
    "no master": {"targets": VALID["targets"]},
    "bad master kind": with_changes(**{"master.kind": "DaemonSet"}),
    "bad master name": with_changes(**{"master.name": "Not_A_Name"}),
    "bad version": with_changes(**{"master.version": "latest"}),
    "approval as string": with_changes(**{"master.requireApprovalForRestart": "yes"}),
    "unknown lease mode": with_changes(**{"connector.leaseMode": "leaseNone"}),
    "no targets": with_changes(targets=[]),
    "missing targets": {"master": VALID["master"]},
    "bad role": with_changes(**{"targets.0.role": "both"}),
    "bad target kind": with_changes(**{"targets.0.kind": "Pod"}),
    "bad container name": with_changes(**{"targets.0.container": "VLLM"}),
    "bad selector operator": with_changes(**{"targets.0": {"role": "prefill", "selector": {
        "matchExpressions": [{"key": "a", "operator": "Like", "values": ["b"]}]}}}),
    "timeout zero": with_changes(**{"rollout.stageTimeoutSeconds": 0}),
    "timeout as string": with_changes(**{"rollout.stageTimeoutSeconds": "600"}),
    "negative pause": with_changes(**{"rollout.pauseBetweenStagesSeconds": -1}),
    "unknown stage": with_changes(**{"rollout.stages": ["master", "canary"]}),
    "no stages": with_changes(**{"rollout.stages": []}),
    "unknown strategy": with_changes(**{"rollout.strategy": "BlueGreen"}),
    "unknown on failure": with_changes(**{"rollout.onFailure": "retry"}),
    "unknown field": with_changes(**{"master.evictionWatermark": 0.9}),
    "non-ASCII label value": with_changes(**{"targets.0": {"role": "prefill", "selector": {
        "matchLabels": {"app": "vllmø"}}}}),
    "non-ASCII expression key": with_changes(**{"targets.0": {"role": "prefill", "selector": {
        "matchExpressions": [{"key": "røle", "operator": "Exists"}]}}}),
    "non-ASCII expression value": with_changes(**{"targets.0": {"role": "prefill", "selector": {
        "matchExpressions": [{"key": "role", "operator": "In", "values": ["decodé"]}]}}}),
}


def test_valid_base_passes(validator: jsonschema.Draft4Validator) -> None:
    assert schema_accepts(validator, VALID) and model_accepts(VALID)


@pytest.mark.parametrize("case", BAD_BY_SCHEMA)
def test_schema_and_model_refuse(case: str, validator: jsonschema.Draft4Validator) -> None:
    spec = BAD_BY_SCHEMA[case]
    assert not schema_accepts(validator, spec)
    assert not model_accepts(spec)


def test_unknown_fields_are_pruned_not_refused_without_strict_validation(crd: dict[str, Any]) -> None:
    lenient = jsonschema.Draft4Validator(validation_schema(crd, strict=False))
    assert lenient.is_valid(doc(BAD_BY_SCHEMA["unknown field"]))


# Every CEL rule with a spec the schema accepts but the rule (and so the model) refuses.
CEL_VIOLATIONS: dict[str, dict[str, Any]] = {
    "exactly one of name or selector must be set": with_changes(**{"targets.0": {
        "name": "x", "role": "prefill", "selector": {"matchLabels": {"a": "b"}}}}),
    "a selector must match on at least one label (an empty selector selects everything)": with_changes(**{
        "targets.0": {"role": "prefill", "selector": {"matchLabels": {}}}}),
    "matchLabels keys must be Kubernetes label keys: ASCII letters, digits, '-', '_' and '.'"
    " (an optional DNS prefix and '/' before them)": with_changes(**{
        "targets.0": {"role": "prefill", "selector": {"matchLabels": {"røle": "prefill"}}}}),
    "values must be non-empty for In and NotIn, and empty for Exists and DoesNotExist": with_changes(**{
        "targets.0": {"role": "prefill", "selector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}}),
    "each stage may appear only once": {"master": VALID["master"], "targets": [VALID["targets"][1]],
                                        "rollout": {"stages": ["master", "decode", "decode"]}},
    "stages must include master": with_changes(**{"rollout.stages": ["prefill", "decode"]}),
    "every target role must have a stage in rollout.stages": with_changes(**{"rollout.stages": ["master", "decode"]}),
    "leaseMode lastHitOnly needs every target to be hybrid (full attention + align-mode Mamba)": with_changes(**{
        "connector.leaseMode": "lastHitOnly", "targets.0.hybrid": True}),
    "connector.retentionPin needs master.allowEvictSoftPinnedObjects true (Mooncake's default):"
    " with false, pinned objects leave only when their pin expires and puts fail for lack of space":
        with_changes(**{"connector.retentionPin": True, "master.allowEvictSoftPinnedObjects": False}),
    "connector.retentionEvict keeps the store under the master's eviction watermark:"
    " declare master.evictionHighWatermarkRatio (Mooncake's default is 0.9)":
        with_changes(**{"connector.retentionEvict": True}),
    "the master workload cannot also be a target": with_changes(**{"targets.0.name": "mooncake-master"}),
    "each named target may appear only once": with_changes(**{"targets.1": {"name": "llama-prefill", "role": "decode"}}),
    "abTest must be set exactly when strategy is ABTest": with_changes(**{"rollout.strategy": "ABTest"}),
    "a workload cannot be in both arms": with_changes(**{"rollout": {**AB_ROLLOUT, "abTest": {
        "control": {"workloads": ["llama-prefill", "llama-decode"]}, "treatment": {"workloads": ["llama-decode"]}}}}),
    "maxSamples must be at least minSamples": with_changes(**{"rollout": {**AB_ROLLOUT, "abTest": {
        **AB_ROLLOUT["abTest"], "minSamples": 10, "maxSamples": 5}}}),
    "every A/B arm workload must be a named target": with_changes(**{"rollout": {**AB_ROLLOUT, "abTest": {
        "control": {"workloads": ["llama-prefill"]}, "treatment": {"workloads": ["llama-decode", "other"]}}}}),
    "each condition's metric must be built in or named in prometheus.customQueries": with_changes(**{
        "rollout": {**AB_ROLLOUT, "abTest": {**AB_ROLLOUT["abTest"], "conditions": [{"metric": "queueDepth"}]}}}),
    "customQueries names start with a letter and hold only letters, digits and underscores (at most 63)":
        with_changes(**{"rollout": {**AB_ROLLOUT, "abTest": {**AB_ROLLOUT["abTest"], "prometheus": {
            "url": "http://prometheus:9090", "customQueries": {"queue-depth": "sum(q{$selector})"}}}}}),
    "customQueries are ASCII text that may use only the placeholder $selector (or ${selector});"
    " write $$ for a literal $":
        with_changes(**{"rollout": {**AB_ROLLOUT, "abTest": {**AB_ROLLOUT["abTest"], "prometheus": {
            "url": "http://prometheus:9090",
            "customQueries": {"ttft": "sum(rate(x{$selector}[$__rate_interval]))"}}}}}),
    "evictions and putAllocFailures compare the arms' masters: they need prometheus.storeSelectors "
    "(one master per arm); with one shared master both arms read the same series": with_changes(**{
        "rollout": {**AB_ROLLOUT, "abTest": {**AB_ROLLOUT["abTest"], "conditions": [
            {"metric": "evictions", "direction": "LowerIsBetter"}], "prometheus": {"url": "http://prometheus:9090"}}}}),
    "selectors.control and selectors.treatment must differ: with the same matchers both arms read "
    "the same series and no condition can ever fail": with_changes(**{
        "rollout": {**AB_ROLLOUT, "abTest": {**AB_ROLLOUT["abTest"], "prometheus": {
            "url": "http://prometheus:9090", "selectors": {"control": 'job="vllm"', "treatment": 'job="vllm"'}}}}}),
    "storeSelectors.control and storeSelectors.treatment must differ (one master per arm); "
    "for one master shared by both arms use storeSelector": with_changes(**{
        "rollout": {**AB_ROLLOUT, "abTest": {**AB_ROLLOUT["abTest"], "prometheus": {
            "url": "http://prometheus:9090", "storeSelectors": {"control": 'job="m"', "treatment": 'job="m"'}}}}}),
    "every customQueries entry must use $selector (or ${selector}) to pick the arm's series: without it"
    " both arms read the same number and the condition can never fail": with_changes(**{
        "rollout": {**AB_ROLLOUT, "abTest": {**AB_ROLLOUT["abTest"], "prometheus": {
            "url": "http://prometheus:9090", "customQueries": {"queued": "sum(vllm:num_requests_waiting)"}}}}}),
    "a built-in metric's direction is fixed: set direction: LowerIsBetter for ttftP50, ttftP90, ttftP99,"
    " putFailedKeys, putAllocFailures, evictions (the default, HigherIsBetter, would promote a slower or failing"
    " treatment); prefixCacheHitRate and externalHitRate are HigherIsBetter": with_changes(**{
        "rollout": {**AB_ROLLOUT, "abTest": {**AB_ROLLOUT["abTest"], "conditions": [
            {"metric": "externalHitRate", "minEffect": 0.02},
            {"metric": "ttftP90", "maxRegression": 0.05, "guardrail": True}]}}}),
    "at least one condition must be primary (not a guardrail): guardrails alone would promote "
    "any treatment that is merely no worse": with_changes(**{
        "rollout": {**AB_ROLLOUT, "abTest": {**AB_ROLLOUT["abTest"], "conditions": [
            {"metric": "ttftP90", "direction": "LowerIsBetter", "maxRegression": 0.05, "guardrail": True}]}}}),
    "with strategy ABTest every target must be named and in one arm": with_changes(**{
        "rollout": AB_ROLLOUT, "targets": [*VALID["targets"], {"name": "extra", "role": "decode"}]}),
}


@pytest.mark.parametrize("message", CEL_VIOLATIONS)
def test_cel_mirror_refuses_what_only_the_rule_catches(message: str, validator: jsonschema.Draft4Validator) -> None:
    spec = CEL_VIOLATIONS[message]
    assert schema_accepts(validator, spec), "the case must get past the schema to test the CEL rule"
    with pytest.raises(PolicySpecError) as exc:
        parse_spec(spec)
    assert any(p.endswith(message) for p in exc.value.problems), exc.value.problems


def test_cel_mirrors_accept_the_edges() -> None:
    # A selector target next to a named one; the same name under another kind; a master of
    # another kind with a target's name; lastHitOnly when every target is hybrid.
    spec = with_changes(**{
        "master.kind": "StatefulSet", "master.name": "llama-decode",
        "targets.1": {"name": "llama-prefill", "kind": "StatefulSet", "role": "decode"},
    })
    spec["targets"].append({"role": "decode", "selector": {
        "matchExpressions": [{"key": "tier", "operator": "Exists"}]}})
    assert model_accepts(spec)
    hybrid = with_changes(**{"connector.leaseMode": "lastHitOnly", "targets.0.hybrid": True, "targets.1.hybrid": True})
    assert model_accepts(hybrid)
    only_decode = {"master": VALID["master"], "targets": [VALID["targets"][1]], "rollout": {"stages": ["master", "decode"]}}
    assert model_accepts(only_decode)


def test_problems_name_the_field() -> None:
    with pytest.raises(PolicySpecError) as exc:
        parse_spec(with_changes(**{"master.evictionRatio": 0, "rollout.stageTimeoutSeconds": "600"}))
    problems = exc.value.problems
    assert any(p.startswith("spec.master.evictionRatio:") for p in problems), problems
    assert any(p.startswith("spec.rollout.stageTimeoutSeconds:") for p in problems), problems


# ---- schema bounds and model bounds agree (property) --------------------------------------------

@settings(max_examples=150, deadline=None)
@given(
    field=st.sampled_from(["evictionRatio", "evictionHighWatermarkRatio", "defaultKvLeaseTtlMs",
                           "defaultKvSoftPinTtlMs"]),
    value=st.one_of(st.floats(min_value=-2, max_value=3, allow_nan=False), st.integers(-5, 10**9),
                    st.sampled_from([0, 1, 0.0, 1.0, 1e-9, -0.0])),
)
def test_master_bounds_agree(field: str, value: float, validator: jsonschema.Draft4Validator) -> None:
    spec = with_changes(**{f"master.{field}": value})
    assert schema_accepts(validator, spec) == model_accepts(spec)


@settings(max_examples=150, deadline=None)
@given(
    timeout=st.one_of(st.integers(-3, 5), st.just("600")), pause=st.integers(-3, 3),
    stages=st.lists(st.sampled_from(["master", "prefill", "decode"]), max_size=4),
)
def test_rollout_bounds_agree_except_cel(timeout: Any, pause: int, stages: list[str],
                                         validator: jsonschema.Draft4Validator) -> None:
    spec = with_changes(**{"rollout.stageTimeoutSeconds": timeout, "rollout.pauseBetweenStagesSeconds": pause,
                           "rollout.stages": stages})
    by_schema, by_model = schema_accepts(validator, spec), model_accepts(spec)
    assert by_schema or not by_model  # the model never accepts what the schema refuses
    cel_ok = len(set(stages)) == len(stages) and {"master", "prefill", "decode"} <= set(stages)
    assert by_model == (by_schema and cel_ok)


# ---- model behaviour ----------------------------------------------------------------------------

def test_defaults_match_the_tracker() -> None:
    spec = parse_spec(VALID)
    assert spec.connector.lease_mode is LeaseMode.LEASE_ALL and spec.connector.junction_retention is False
    assert spec.rollout.stages == [StageName.MASTER, StageName.PREFILL, StageName.DECODE]
    assert (spec.rollout.stage_timeout_seconds, spec.rollout.pause_between_stages_seconds) == (600, 0)
    assert spec.rollout.on_failure.value == "rollback" and spec.rollout.strategy.value == "Staged"
    assert spec.rollout.paused is False
    # Issue 15: the store is never emptied unasked, and deletion keeps the master's settings.
    assert spec.master.require_approval_for_restart is True and spec.master.on_delete.value == "keep"


def test_crd_defaults_equal_model_defaults(crd: dict[str, Any]) -> None:
    # What the API server fills in must be what the model assumes when a field is absent.
    from moonlease_dev.testbed.kube import apply_schema_defaults  # the API server's defaulting, emulated

    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    defaulted = apply_schema_defaults(copy.deepcopy(VALID), schema)
    assert parse_spec(defaulted) == parse_spec(VALID)
    assert defaulted == parse_spec(VALID).model_dump(mode="json", by_alias=True, exclude_none=True)


def test_master_flags_use_mooncake_names() -> None:
    master = MasterSpec(name="m", eviction_high_watermark_ratio=0.95, eviction_ratio=0.1,
                        default_kv_lease_ttl_ms=5000, default_kv_soft_pin_ttl_ms=60000,
                        allow_evict_soft_pinned_objects=False)
    assert build_master_flags(master) == {
        "eviction_high_watermark_ratio": "0.95", "eviction_ratio": "0.1", "default_kv_lease_ttl": "5000",
        "default_kv_soft_pin_ttl": "60000", "allow_evict_soft_pinned_objects": "false",
    }
    assert build_master_flags(MasterSpec(name="m")) == {}


def test_decided_once_boolean_flags_from_types_and_one_lease_mode_enum() -> None:
    from moonlease_settings.config import LeaseMode as ConnectorLeaseMode
    from moonlease_operator.api.policy import BOOLEAN_MASTER_FLAGS

    assert BOOLEAN_MASTER_FLAGS == {"allow_evict_soft_pinned_objects"}
    assert LeaseMode is ConnectorLeaseMode  # the CRD's enum is the connector's settings enum


@pytest.mark.parametrize(("selector", "labels", "expected"), [
    ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
    ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]}, {"a": "2"}, True),
    ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
    ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {"a": "1"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {"a": ""}, True),
    ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {"a": ""}, False),
    ({"matchLabels": {"a": "1"}, "matchExpressions": [{"key": "b", "operator": "Exists"}]}, {"a": "1"}, False),
])
def test_label_selector_matches(selector: dict[str, Any], labels: dict[str, str], expected: bool) -> None:
    assert LabelSelector.model_validate(selector).matches(labels) is expected


def test_models_are_frozen_and_snake_case_in_python() -> None:
    target = TargetSpec(name="x", role="decode")
    with pytest.raises(ValueError):
        target.name = "y"  # type: ignore[misc]
    assert RolloutSpec().model_dump(by_alias=True)["stageTimeoutSeconds"] == 600
    assert LabelSelectorRequirement(key="a", operator="Exists").values is None


def test_cel_rule_schema_entry() -> None:
    assert CelRule("self.a", "m", ".a").as_schema() == {"rule": "self.a", "message": "m", "fieldPath": ".a"}


# ---- status and the acceptance decision ---------------------------------------------------------

def test_set_condition_keeps_transition_time_while_status_holds() -> None:
    first = set_condition([], type_="Ready", status=ConditionStatus.FALSE, reason="Accepted", message="a",
                          generation=1, now=T0)
    later = T0 + datetime.timedelta(minutes=5)
    same = set_condition(first, type_="Ready", status=ConditionStatus.FALSE, reason="Other", message="b",
                         generation=2, now=later)
    flipped = set_condition(same, type_="Ready", status=ConditionStatus.TRUE, reason="Done", message="c",
                            generation=2, now=later)
    assert same[0].last_transition_time == T0 and same[0].reason == "Other" and same[0].observed_generation == 2
    assert flipped[0].last_transition_time == later and len(flipped) == 1


def judge(spec: dict[str, Any], *, generation: int, previous: PolicyStatus, now: datetime.datetime) -> Any:
    """The operator's verdict on a spec whose workloads do not exist (yet)."""
    return plan_reconcile(spec=read_spec(spec), policy=PolicyRef("p", "ns", generation, "2026-01-01T00:00:00Z"),
                          previous=previous, observed=Observed(workloads={}), now=now)


def test_a_valid_spec_waits_for_its_workloads() -> None:
    plan = judge(VALID, generation=3, previous=PolicyStatus(), now=T0)
    assert plan.changes == () and [e.reason for e in plan.events] == ["WorkloadNotFound"]
    status = plan.status
    assert (status.phase, status.observed_generation, status.last_transition_time) == (Phase.PENDING, 3, T0)
    ready, invalid = status.condition("Ready"), status.condition("Invalid")
    assert ready is not None and (ready.status, ready.reason) == (ConditionStatus.FALSE, "WorkloadNotFound")
    assert "Deployment/mooncake-master (master) not found" in ready.message
    assert invalid is not None and (invalid.status, invalid.reason) == (ConditionStatus.FALSE, "SpecValid")


def test_refusal_warns_once_per_generation_and_recovers() -> None:
    bad = CEL_VIOLATIONS["exactly one of name or selector must be set"]
    first = judge(bad, generation=1, previous=PolicyStatus(), now=T0)
    assert first.status.phase is Phase.INVALID and first.changes == ()
    assert [(e.type, e.reason, e.message) for e in first.events] == [
        ("Warning", "InvalidSpec", "spec.targets[0]: exactly one of name or selector must be set")]
    invalid = first.status.condition("Invalid")
    assert invalid is not None and (invalid.status, invalid.reason) == (ConditionStatus.TRUE, "InvalidSpec")

    # A resume re-judges the same generation: same status, no second event.
    later = T0 + datetime.timedelta(hours=1)
    again = judge(bad, generation=1, previous=read_status(dump_status(first.status)), now=later)
    assert again.events == () and again.status == first.status

    # A new, still invalid generation warns again; a fixed one is accepted.
    newer = judge(bad, generation=2, previous=first.status, now=later)
    assert [e.reason for e in newer.events] == ["InvalidSpec"]
    fixed = judge(VALID, generation=3, previous=newer.status, now=later)
    assert fixed.status.phase is Phase.PENDING and fixed.status.last_transition_time == later
    fixed_invalid = fixed.status.condition("Invalid")
    assert fixed_invalid is not None and fixed_invalid.status is ConditionStatus.FALSE


def test_dumped_status_matches_the_crd_and_nulls_stale_fields(crd: dict[str, Any]) -> None:
    plan = judge(VALID, generation=1, previous=PolicyStatus(), now=T0)
    dumped = dump_status(plan.status)
    assert dumped["currentStage"] is None and dumped["appliedConfigHash"] is None
    present = {k: v for k, v in dumped.items() if v is not None}
    jsonschema.Draft4Validator(validation_schema(crd, strict=True)).validate(
        {**doc(VALID), "status": present})
    assert present["conditions"][0]["lastTransitionTime"] == "2026-01-01T12:00:00Z"
    assert read_status(dumped) == plan.status
    assert read_status({"phase": "Nonsense"}) == PolicyStatus()


# ---- one validator per rule: the API server's RE2 and the operator's `re` agree ------------------

PATTERN_CORPUS = ["sum(q{$selector})", "sum(q{${selector}})", "x{$selector,a=\"b\"}", "a$$b", "$selectorø",
                  "$selectorx", "sum(ø{$selector})", "rate(x{$selector}[5m])\n", "$selector_", "$",
                  "app", "røle", "moonlease.io/role", "a.b/c_d", "-a", "vllmø", "ø", "a\u00e9", "x" * 63]


@pytest.mark.parametrize("pattern", [QUERY_TEMPLATE_PATTERN, LABEL_KEY_PATTERN, LABEL_VALUE_PATTERN])
def test_cel_patterns_read_the_same_in_ascii_and_unicode_engines(pattern: str) -> None:
    """RE2 (the API server's CEL `matches`) reads `\\b` and classes as ASCII, Python's `re` as
    Unicode: our patterns admit only ASCII, so both readings agree on every text, `$selectorø`
    included (refused by both)."""
    for text in PATTERN_CORPUS:
        assert bool(re.match(pattern, text)) == bool(re.match(pattern, text, re.ASCII)), (pattern, text)
    assert not re.match(QUERY_TEMPLATE_PATTERN, "$selectorø", re.ASCII)
    assert not re.match(LABEL_VALUE_PATTERN, "vllmø") and not re.match(LABEL_KEY_PATTERN, "røle")


def test_a_non_ascii_query_is_refused_with_the_rules_message() -> None:
    spec = with_changes(**{"rollout": {**AB_ROLLOUT, "abTest": {**AB_ROLLOUT["abTest"], "prometheus": {
        "url": "http://prometheus:9090", "customQueries": {"ttft": "sum(x{$selectorø})"}}}}})
    with pytest.raises(PolicySpecError, match="customQueries are ASCII text"):
        parse_spec(spec)
