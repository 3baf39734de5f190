"""Which policies a watch event wakes, and how long a policy rests (issue 16): pure rules."""

from __future__ import annotations

import pytest

from moonlease_operator.api import Phase, PolicyStatus, StageName, StagePhase, StageStatus, parse_spec
from moonlease_operator.core.slots import POLICY_LABEL, policy_label_value
from moonlease_operator.core.wakeups import (
    is_verifying,
    policies_concerned,
    seconds_until_next_reconcile,
    settings_owner,
    wakes_on_policy_change,
)

pytestmark = pytest.mark.unit

SPEC = parse_spec({"master": {"name": "master", "configMap": {"name": "master-file", "key": "m.json"}},
                   "targets": [{"name": "prefill", "role": "prefill"},
                               {"role": "decode", "selector": {"matchLabels": {"tier": "decode"}}}]})


def obj(kind: str, name: str, labels: dict[str, str] | None = None) -> dict:
    return {"kind": kind, "metadata": {"name": name, "labels": labels or {}}}


@pytest.mark.parametrize(("kind", "objects", "expected"), [
    ("Deployment", [obj("Deployment", "master")], {"p"}),
    ("Deployment", [obj("Deployment", "prefill")], {"p"}),
    ("Deployment", [obj("Deployment", "d1", {"tier": "decode"})], {"p"}),
    ("Deployment", [obj("Deployment", "d1", {"tier": "decode"}), obj("Deployment", "d1")], {"p"}),  # leaves
    ("Deployment", [None, obj("Deployment", "d1", {"tier": "decode"})], {"p"}),  # joins
    ("StatefulSet", [obj("StatefulSet", "prefill")], set()),  # another kind of the same name
    ("Deployment", [obj("Deployment", "other")], set()),
    ("Deployment", [obj("Deployment", "other", {POLICY_LABEL: policy_label_value("invalid")})], {"invalid"}),
    ("ConfigMap", [obj("ConfigMap", "master-file")], {"p"}),
    ("ConfigMap", [obj("ConfigMap", "prefill-moonlease")], {"p"}),
    ("ConfigMap", [obj("ConfigMap", "d1-moonlease"), obj("Deployment", "d1", {"tier": "decode"})], {"p"}),
    ("ConfigMap", [obj("ConfigMap", "unrelated")], set()),
])
def test_a_change_wakes_the_policies_it_concerns(kind: str, objects: list, expected: set[str]) -> None:
    assert policies_concerned(kind, objects, {"p": SPEC, "invalid": None}) == expected


def test_settings_owner_and_status_writes_and_rest() -> None:
    assert settings_owner("llama-decode-moonlease") == "llama-decode" and settings_owner("moonlease") is None
    base = {"metadata": {"generation": 1, "annotations": {"a": "1"}}, "status": {"phase": "Ready"}}
    assert not wakes_on_policy_change(base, {**base, "status": {"phase": "Progressing"}})  # our own write
    assert wakes_on_policy_change(base, {"metadata": {"generation": 2, "annotations": {"a": "1"}}})
    assert wakes_on_policy_change(base, {"metadata": {"generation": 1, "annotations": {"a": "2"}}})
    assert wakes_on_policy_change(None, base) and wakes_on_policy_change(base, None)

    verifying = PolicyStatus(phase=Phase.PROGRESSING,
                             stages=[StageStatus(name=StageName.PREFILL, phase=StagePhase.PROGRESSING)])
    assert is_verifying(verifying) and is_verifying({"stages": [{"phase": "RollingBack"}]})
    assert not is_verifying({"stages": [{"phase": "Succeeded"}]})
    rest = {"reconcile_interval": 5.0, "resync_interval": 300.0}
    assert seconds_until_next_reconcile(verifying, ab_due_in=None, **rest) == 5.0
    assert seconds_until_next_reconcile(PolicyStatus(phase=Phase.READY), ab_due_in=None, **rest) == 300.0
    assert seconds_until_next_reconcile(PolicyStatus(phase=Phase.ANALYZING), ab_due_in=42.0, **rest) == 42.0
