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


def test_the_held_control_is_not_listed_as_changing_or_restarting() -> None:
    """Issue 26: `plan -f` listed the A/B control as restarting; it is held until the test
    promotes. Only the master and the treatment change now."""
    from moonlease.plan_view import plan_exit_code, preview_json, render_preview

    result = preview(ab_fleet(), AB_SPEC)
    by_name = {w.name: w for w in result.workloads}
    assert {n for n, w in by_name.items() if w.held} == {"prefill-a", "decode-a"}
    assert not any(by_name[n].restarts for n in ("prefill-a", "decode-a"))
    assert all(by_name[n].restarts_if_promoted and by_name[n].changes for n in ("prefill-a", "decode-a"))
    assert by_name["prefill-b"].restarts and by_name["decode-b"].restarts
    text = render_preview(result, "fleet", "ns", approval=False)
    table = [line for line in text.splitlines() if line.startswith("  ") and "Deployment/" in line[:60]]
    assert not any("prefill-a" in line or "decode-a" in line for line in table)
    assert ("held (the A/B control; changes only if the test promotes): Deployment/prefill-a (would restart),"
            " Deployment/decode-a (would restart)") in text
    listed = preview_json(result, "fleet", "ns", approval=False)["workloads"]
    assert {w["name"]: (w["held"], w["restarts"], w["restartsIfPromoted"]) for w in listed}["decode-a"] == (True, False, True)

    # With the treatment rolled out and measuring, nothing changes now: exit 0, the control held.
    cluster = ab_fleet()
    cluster.run(AB_SPEC)
    measuring = preview(cluster, AB_SPEC)
    assert not measuring.changes and plan_exit_code(measuring) == 0
    text = render_preview(measuring, "fleet", "ns", approval=False)
    assert "no workload changes now" in text and "(in sync): Deployment/mooncake-master, Deployment/prefill-b" in text


def test_the_plan_shows_the_ab_test_design_with_the_documented_detectable_effect() -> None:
    """Conditions, α, the looks and the minimum detectable effect the docs' table is computed
    with (core.sequential.minimum_detectable_effect, tuned where the analysis tunes it)."""
    import math

    from moonlease.plan_view import preview_json, render_preview
    from moonlease_operator.core.sequential import minimum_detectable_effect

    spec = copy.deepcopy(AB_SPEC)
    spec["rollout"]["abTest"].update(minSamples=5, maxSamples=30, warmupSeconds=60, conditions=[
        {"metric": "externalHitRate", "minEffect": 0.02, "maxRegression": 0.02},
        {"metric": "ttftP90", "direction": "LowerIsBetter", "maxRegression": 0.05, "guardrail": True}])
    design = preview(ab_fleet(), spec).ab_design
    assert design is not None and design.family == 2 and design.alpha == pytest.approx(0.05)
    assert design.tuned_at == round(math.sqrt(5 * 30)) == 12
    # the default spec's figure in docs/ab-testing.md's table: 1.31 σ at 30 intervals, 2 conditions
    assert f"{design.detectable_at_max:.2f}" == "1.31"
    assert design.detectable_at_min == pytest.approx(minimum_detectable_effect(5, conditions=2, tuned_at=12))
    assert (design.shortest_seconds, design.longest_seconds) == (60 + 5 * 10, 60 + 30 * 10)
    text = render_preview(preview(ab_fleet(), spec), "fleet", "ns", approval=False)
    assert "A/B test: 2 conditions, α 0.05 family-wise (Holm across 2" in text
    assert "from sample 5 to 30 (after a 60s warm-up: decided between 110s and 360s)" in text
    assert "ttftP90              LowerIsBetter            0           0.05  guardrail (must not regress)" in text
    assert f"{design.detectable_at_min:.2f} σ beyond the threshold at 5 samples, 1.31 σ at 30" in text
    as_json = preview_json(preview(ab_fleet(), spec), "fleet", "ns", approval=False)["abTest"]
    assert as_json["minSamples"] == 5 and as_json["alpha"] == pytest.approx(0.05)
    assert [c["metric"] for c in as_json["conditions"]] == ["externalHitRate", "ttftP90"]
    assert as_json["detectableEffectSigma"]["atMaxSamples"] == pytest.approx(design.detectable_at_max)
    assert preview_json(preview(fleet(), SPEC), "fleet", "ns", approval=False)["abTest"] is None
