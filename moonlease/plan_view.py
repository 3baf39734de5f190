"""`moonlease plan -f`: the dry run's answer for a terminal or a script. Pure.

The decision is the operator's (`moonlease_operator.core.rollout.plan_preview`); this module
only lays it out and says which exit code it means.
"""

from __future__ import annotations

from typing import Any

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
                       "restarts": w.restarts, "changes": list(w.changes)} for w in preview.workloads],
        "events": [{"type": e.type, "reason": e.reason, "message": e.message} for e in preview.events],
    }


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
    lines.append(f"  {'stage':<9}{'workload':<36}{'arm':<11}{'restarts':<10}changes")
    for w in preview.workloads:
        changes = list(w.changes) or ["(in sync)"]
        lines.append(f"  {w.stage.value:<9}{w.kind + '/' + w.name:<36}{w.arm or '-':<11}"
                     f"{'yes' if w.restarts else 'no':<10}{changes[0]}")
        lines.extend(f"  {'':<66}{line}" for line in changes[1:])
    if any(w.arm == "control" and w.changes for w in preview.workloads):
        lines.append("  (the control changes only when the A/B test promotes)")
    return "\n".join(lines) + "\n"
