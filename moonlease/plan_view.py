"""`moonlease plan -f`: the dry run's answer for a terminal or a script. Pure.

The decision is the operator's (`moonlease_operator.core.rollout.plan_preview`); this module
only lays it out and says which exit code it means.
"""

from __future__ import annotations

from typing import Any

from moonlease_operator.core.ab_plan import ABDesign
from moonlease_operator.core.rollout import PolicyPreview

#: Exit codes of `moonlease plan` (as `terraform plan -detailed-exitcode`, plus a refusal).
PLAN_IN_SYNC, PLAN_CHANGES, PLAN_REFUSED = 0, 2, 4


def plan_exit_code(preview: PolicyPreview) -> int:
    """0: nothing would change; 2: workloads would change; 4: refused, or its workloads missing."""
    if preview.refused:
        return PLAN_REFUSED
    return PLAN_CHANGES if preview.changes else PLAN_IN_SYNC


def preview_json(preview: PolicyPreview, name: str, namespace: str, *, approval: bool) -> dict[str, Any]:
    return {
        "name": name, "namespace": namespace, "phase": preview.phase.value, "reason": preview.reason,
        "message": preview.message, "refused": preview.refused, "desiredConfigHash": preview.desired_config_hash,
        "changes": preview.changes, "masterRestarts": preview.master_restarts,
        "masterRestartNeedsApproval": preview.master_restarts and approval,
        "workloads": [{"stage": w.stage.value, "kind": w.kind, "name": w.name, "arm": w.arm or None,
                       "restarts": w.restarts, "changes": list(w.changes), "held": w.held,
                       "restartsIfPromoted": w.restarts_if_promoted} for w in preview.workloads],
        "events": [{"type": e.type, "reason": e.reason, "message": e.message} for e in preview.events],
        "abTest": design_json(preview.ab_design) if preview.ab_design is not None else None,
    }


def design_json(design: ABDesign) -> dict[str, Any]:
    return {
        "alpha": round(design.alpha, 12), "holmFamily": design.family, "putFailureGuard": design.put_failure_guard,
        "minSamples": design.min_samples, "maxSamples": design.max_samples,
        "intervalSeconds": design.interval_seconds, "warmupSeconds": design.warmup_seconds,
        "tunedAt": design.tuned_at, "shortestSeconds": design.shortest_seconds,
        "longestSeconds": design.longest_seconds,
        "detectableEffectSigma": {"atMinSamples": design.detectable_at_min, "atMaxSamples": design.detectable_at_max},
        "conditions": [{"metric": c.metric, "direction": c.direction.value, "minEffect": c.min_effect,
                        "maxRegression": c.max_regression, "guardrail": c.guardrail} for c in design.conditions],
    }


def render_design(design: ABDesign) -> list[str]:
    """The A/B test's design: conditions, α with Holm's family, the looks, what it can detect."""
    count = len(design.conditions)
    lines = [f"A/B test: {count} condition{'s' if count != 1 else ''}, α {design.alpha:.3g} family-wise (Holm across "
             f"{design.family}" + ("; the put-failure guard joins once measured" if design.put_failure_guard else "")
             + f"), looks after every {design.interval_seconds}s interval from sample {design.min_samples} to "
             f"{design.max_samples} (after a {design.warmup_seconds}s warm-up: decided between "
             f"{design.shortest_seconds}s and {design.longest_seconds}s)",
             f"  {'metric':<20} {'direction':<15} {'minEffect':>10} {'maxRegression':>14}  kind"]
    for c in design.conditions:
        lines.append(f"  {c.metric:<20} {c.direction.value:<15} {c.min_effect:>10.4g} {c.max_regression:>14.4g}  "
                     + ("guardrail (must not regress)" if c.guardrail else "primary (must improve)"))
    lines.append(f"  detectable (80 % power, independent intervals): {design.detectable_at_min:.2f} σ beyond the "
                 f"threshold at {design.min_samples} samples, {design.detectable_at_max:.2f} σ at {design.max_samples}"
                 " (σ: the standard deviation of one interval's treatment - control; autocorrelated intervals need more)")
    return lines


def render_preview(preview: PolicyPreview, name: str, namespace: str, *, approval: bool) -> str:
    """One screen: the verdict, the master restart, then each workload of each stage."""
    head = f"{namespace}/{name}: "
    if preview.refused:
        return (f"{head}would be {preview.phase.value} ({preview.reason}); nothing would change\n"
                f"refused: {preview.message}\n")
    lines = [f"{head}would be {preview.phase.value}" + (f" — {preview.message}" if preview.message else ""),
             f"configuration: {preview.desired_config_hash}"]
    if preview.master_restarts:
        lines.append("master:  RESTARTS (restarting the master empties the Mooncake store)"
                     + ("; it waits for `moonlease approve` first" if approval else ""))
    else:
        lines.append("master:  no restart")
    changing = [w for w in preview.workloads if w.changes and not w.held]
    in_sync = [w for w in preview.workloads if not w.changes and not w.held]
    held = [w for w in preview.workloads if w.held]
    if changing:
        lines.append(f"  {'stage':<9}{'workload':<36}{'arm':<11}{'restarts':<10}changes")
    else:
        lines.append("  no workload changes now")
    for w in changing:
        lines.append(f"  {w.stage.value:<9}{w.kind + '/' + w.name:<36}{w.arm or '-':<11}"
                     f"{'yes' if w.restarts else 'no':<10}{w.changes[0]}")
        lines.extend(f"  {'':<66}{line}" for line in w.changes[1:])
    if in_sync:
        lines.append("  (in sync): " + ", ".join(f"{w.kind}/{w.name}" for w in in_sync))
    if held:
        lines.append("  held (the A/B control; changes only if the test promotes): " + ", ".join(
            f"{w.kind}/{w.name}" + (" (would restart)" if w.restarts_if_promoted else
                                    " (would change)" if w.changes else " (in sync)") for w in held))
    if preview.ab_design is not None:
        lines.extend(render_design(preview.ab_design))
    return "\n".join(lines) + "\n"
