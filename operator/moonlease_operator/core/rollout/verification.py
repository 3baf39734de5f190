"""A workload counts as done only once its running pods show the settings: every Ready vLLM
pod's connector reports the settings hash the policy expects (`core.connector_delivery`), every
Ready master pod runs the master's flags; and, rolling back, what the restored objects say."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from moonlease_operator.api import Reason, StageName, StagePhase, StageStatus
from moonlease_operator.core.connector_delivery import (
    evaluate_pod_settings,
    expected_settings_hash,
    file_settings_hash,
    refused_expected,
    settings_config_map_name,
    settings_file_text,
    settings_pods,
    template_reads_settings_file,
    unmounted_pod_problem,
)
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.fleet import Member, WorkloadKey
from moonlease_operator.core.health import (
    Health,
    WorkloadHealth,
    current_ready_pods,
    evaluate_master_pod,
    restored_master_flags,
)
from moonlease_operator.core.rollout.common import join
from moonlease_operator.core.rollout.context import PlanContext


def verify_settings(ctx: PlanContext, stages: Mapping[StageName, StageStatus]
                    ) -> tuple[dict[WorkloadKey, WorkloadHealth], tuple[EventNote, ...]]:
    """The members' health once their pods' settings are checked: a workload of a Progressing
    stage is complete only once its running pods show the settings, one of a stage Rolling
    back restored only once they run what the restored objects say. Until then it counts as
    progressing, with the per-pod reasons as its message (and an event when they change); a
    connector that refused exactly these settings fails it at once (it will not change its
    answer)."""
    health_of = dict(ctx.health)
    notes: list[EventNote] = []
    previous = {(t.kind.value, t.name): t.message for t in ctx.previous.targets}
    for member in ctx.fleet.members:
        stage = stages.get(member.stage)
        health = health_of[member.key]
        if stage is None or health.health is not Health.COMPLETE:
            continue
        if stage.phase is StagePhase.PROGRESSING and ctx.in_sync(member):
            forward = True  # (not written yet: re-applied and reported as such)
        elif stage.phase is StagePhase.ROLLING_BACK and ctx.changed_in_attempt(member) \
                and not ctx.rollback_pending(member):
            forward = False
        else:
            continue
        refused = False
        if member.target is None:
            problems = _master_problems(ctx, member, restored=not forward)
            what = "master flags not verified: " if forward else "restored master flags not verified: "
        else:
            problems, refused = _settings_problems(ctx, member, restored=not forward)
            what = ("connector settings not verified: " if forward
                    else "restored connector settings not verified: ")
        if not problems:
            continue
        message = what + join(problems)
        health_of[member.key] = dataclasses.replace(
            health, health=Health.FAILED if refused else Health.PROGRESSING, message=message)
        if previous.get(member.key) != message:
            notes.append(EventNote("Warning", Reason.SETTINGS_NOT_VERIFIED.value,
                                   f"{member.kind}/{member.name}: {message}"))
    return health_of, tuple(notes)


def _master_problems(ctx: PlanContext, member: Member, *, restored: bool = False) -> list[str]:
    """Ready master pods whose running pod spec lacks the policy's flags — or, `restored`,
    the flags its restored pod template gives back (with a config file, its content is
    covered by the template's hash, which the pods carry)."""
    if ctx.master.config_map is None and ctx.observed.pods is not None:
        obj = member.obj or {}
        flags: Mapping[str, str | None] = (
            restored_master_flags(obj, member.container, ctx.master.flags) if restored else ctx.master.flags)
        return [problem for pod in current_ready_pods(obj, ctx.pods() or ())
                if (problem := evaluate_master_pod(pod, member.container, flags)) is not None]
    return []


def _settings_problems(ctx: PlanContext, member: Member, *, restored: bool = False) -> tuple[list[str], bool]:
    """Per-pod reasons the connectors do not run the expected settings, and whether one of
    them refused exactly those. Forward, the policy's file is expected; `restored`, the file
    the rolled-back ConfigMap holds — and nothing of a workload whose restored template no
    longer reads a file (its pods restarted on their start-up settings: health said so)."""
    obj = member.obj or {}
    if restored:
        if not template_reads_settings_file(obj):
            return [], False
        config_map = settings_config_map_name(member.name)
        text = settings_file_text(ctx.observed.config_maps.get(config_map))
        expected = file_settings_hash(obj, member.container, text)
        if expected is None:
            return [f"ConfigMap {config_map} holds no settings file the connector accepts after the restore;"
                    " its pods keep the settings they run"], False
    else:
        expected = expected_settings_hash(obj, member.container, ctx.connector.file)
    if ctx.observed.pods is None:
        return ["pods not read"], False
    reports = ctx.observed.settings_reports or {}
    chosen = settings_pods(obj, ctx.pods() or ())
    # A pod that can never read the file fails the stage now: waiting would not change it.
    problems, refused = [unmounted_pod_problem(p) for p in chosen.unmounted], bool(chosen.unmounted)
    for pod in chosen.report:
        name = str((pod.get("metadata") or {}).get("name"))
        problem = evaluate_pod_settings(name, reports.get(name), expected)
        if problem is not None:
            problems.append(problem)
            refused = refused or refused_expected(reports.get(name), expected)
    return problems, refused
