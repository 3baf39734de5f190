"""`plan_preview` (the dry run behind `moonlease plan -f`): the operator's own planner asked what
a spec would do to test_rollout_plan's fleet, without changing it."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from moonlease_operator.api import Phase, StageName
from moonlease_operator.core.rollout import Observed, PolicyPreview, PolicyRef, plan_preview
from moonlease_operator.core.status import read_status
from tests.unit.test_ab_rollout import SPEC as AB_SPEC, ab_fleet
from tests.unit.test_rollout_plan import SPEC, T0, Cluster, fleet, spec_with

pytestmark = pytest.mark.unit


def preview(cluster: Cluster, spec: dict[str, Any]) -> PolicyPreview:
    before = json.dumps(list(cluster.workloads.values()), sort_keys=True, default=str)
    result = plan_preview(raw_spec=spec, policy=PolicyRef("fleet", "ns", 1, "2026-01-01T00:00:00Z"),
                          previous=read_status(cluster.status_json),
                          observed=Observed(workloads=copy.deepcopy(cluster.workloads),
                                            config_maps=copy.deepcopy(cluster.config_maps)), now=T0)
    assert json.dumps(list(cluster.workloads.values()), sort_keys=True, default=str) == before  # a dry run
    return result


def test_every_stage_is_previewed_with_its_settings_and_restarts() -> None:
    result = preview(fleet(), SPEC)
    assert result.phase is Phase.PROGRESSING and not result.refused and result.master_restarts
    by_name = {w.name: w for w in result.workloads}
    assert [w.stage for w in result.workloads] == [StageName.MASTER, StageName.PREFILL, StageName.DECODE]
    assert "--eviction_ratio: 0.05 -> 0.1" in by_name["mooncake-master"].changes
    assert any("selective" in line for line in by_name["prefill"].changes) and by_name["prefill"].restarts
    assert any(e.reason == "MasterRestart" for e in result.events)


def test_an_applied_policy_previews_no_change() -> None:
    cluster = fleet()
    cluster.run(SPEC)
    result = preview(cluster, SPEC)
    assert result.phase is Phase.READY and not result.changes and not result.master_restarts
    # A connector-only edit restarts no master.
    edited = preview(cluster, spec_with(**{"connector.leaseMode": "leaseAll"}))
    assert edited.changes and not edited.master_restarts
    assert [w.name for w in edited.workloads if w.changes] == ["prefill", "decode"]


def test_a_refused_spec_says_why_and_lists_nothing() -> None:
    result = preview(fleet(), spec_with(**{"master.evictionRatio": 7}))
    assert result.refused and result.phase is Phase.INVALID and result.reason == "InvalidSpec"
    assert "evictionRatio" in result.message and result.workloads == ()


def test_ab_arms_are_named() -> None:
    result = preview(ab_fleet(), AB_SPEC)
    arms = {w.name: w.arm for w in result.workloads if w.stage is not StageName.MASTER}
    assert arms == {"prefill-a": "control", "prefill-b": "treatment", "decode-a": "control", "decode-b": "treatment"}
